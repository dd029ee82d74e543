"""The backend contract: typed rows, views, hints, attempts and outcomes.

This package depends on numpy and the standard library only. It imports no backend, no
lender and no torch, so that anything can build on it.
"""

from kvxfer.contract.arrays import BoolArray, IndexArray, constant_mask
from kvxfer.contract.backend import Attempt, Backend, Capabilities, WakeFn
from kvxfer.contract.errors import InvalidSubmission, KvxferError, SubmissionRejected, one_line
from kvxfer.contract.geometry import BlockOrder, HeadOrder, KVGeometry, LayoutMismatch, check_compatible
from kvxfer.contract.hint import DEFAULT_HINT_TTL_S, MAX_HINT_TTL_S, Hint, HintGroup, Peer, TransferMode
from kvxfer.contract.memory import MemoryKind, SlotRegion
from kvxfer.contract.outcome import Cancelled, Delivered, Failed, Outcome, check_masks, freeze_mask
from kvxfer.contract.record import CompletionRecord, RecordStatus
from kvxfer.contract.rows import CacheKind, LayerGroupRows, TokenRange, View

__all__ = [
    "one_line",
    "Attempt", "Backend", "CompletionRecord", "RecordStatus", "BoolArray", "constant_mask", "CacheKind", "Cancelled", "Capabilities", "Delivered",
    "Failed", "Hint", "HintGroup", "IndexArray", "InvalidSubmission", "KvxferError",
    "LayerGroupRows", "MemoryKind", "Outcome", "Peer", "SlotRegion", "SubmissionRejected",
    "TokenRange", "TransferMode", "View", "WakeFn", "check_masks", "freeze_mask",
    "BlockOrder", "HeadOrder", "KVGeometry", "LayoutMismatch", "check_compatible",
    "DEFAULT_HINT_TTL_S", "MAX_HINT_TTL_S",
]
