"""The completion record one end sends the other when its side of a transfer ends."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from kvxfer.contract.arrays import BoolArray
from kvxfer.contract.outcome import freeze_mask


class RecordStatus(enum.Enum):
    DELIVERED = "delivered"
    FAILED = "failed"
    CANCELLED = "cancelled"
    CANCEL_REQUEST = "cancel_request"


@dataclass(frozen=True, eq=False)
class CompletionRecord:
    """A message about one transfer between its two ends.

    ``transfer_id`` is always the id that the *passive* end minted in its describe() (the
    end whose rows the other end writes in push or reads in pull); the active end holds it
    as ``hint.transfer_id``. The active end sends DELIVERED, FAILED or CANCELLED with
    ``masks`` aligned with the passive end's hint groups (True: that row's bytes are in
    place at the destination). The passive end sends CANCEL_REQUEST (no masks) to withdraw;
    the active end then stops and answers with its final record, which proves that it no
    longer touches the passive end's memory.

    ``digests``: empty, or one uint64 array per mask, of its length: the digest of each row
    the active end read as it sent it (its value for a row whose mask is False means
    nothing). The receiving end checks its rows against them where they landed; how a
    digest is computed is the backends' business, not the contract's.
    """

    transfer_id: str
    sender: str
    request: str
    status: RecordStatus
    masks: tuple[BoolArray, ...]
    reason: str = ""
    digests: tuple[npt.NDArray[np.uint64], ...] = ()

    def __init__(
        self, transfer_id: str, sender: str, request: str, status: RecordStatus,
        masks: Sequence[Any], reason: str = "", digests: Sequence[Any] = (),
    ) -> None:
        if not (type(transfer_id) is str and transfer_id and type(sender) is str and sender
                and type(request) is str and request):  # one test for the usual record, then say which
            for name, value in (("transfer_id", transfer_id), ("sender", sender), ("request", request)):
                if not isinstance(value, str) or not value:
                    raise ValueError(f"CompletionRecord.{name} must be a non-empty str, got {value!r}")
        if not isinstance(status, RecordStatus):
            raise TypeError(f"CompletionRecord.status must be a RecordStatus, got {status!r}")
        object.__setattr__(self, "transfer_id", transfer_id)
        object.__setattr__(self, "sender", sender)
        object.__setattr__(self, "request", request)
        object.__setattr__(self, "status", status)
        object.__setattr__(self, "masks", tuple(freeze_mask(m, i) for i, m in enumerate(masks)))
        object.__setattr__(self, "reason", str(reason))
        object.__setattr__(self, "digests", _freeze_digests(digests, self.masks))


def _freeze_digests(digests: Sequence[Any], masks: tuple[BoolArray, ...]) -> tuple[npt.NDArray[np.uint64], ...]:
    """Read-only uint64 copies, one per mask and of its length (or none at all)."""
    if isinstance(digests, np.ndarray) or not isinstance(digests, Sequence):
        raise TypeError("CompletionRecord.digests must be a sequence of uint64 arrays, one per mask")
    if not digests:
        return ()
    if len(digests) != len(masks):
        raise ValueError(f"CompletionRecord has {len(digests)} digest arrays for {len(masks)} masks")
    frozen = []
    for i, (values, mask) in enumerate(zip(digests, masks)):
        if getattr(values, "dtype", None) != np.uint64:
            raise TypeError(f"CompletionRecord digest array {i} must have dtype uint64")
        if values.shape != mask.shape:
            raise ValueError(f"CompletionRecord digest array {i} has shape {values.shape}, its mask {mask.shape}")
        out = np.array(values, dtype=np.uint64, copy=True)
        out.flags.writeable = False
        frozen.append(out)
    return tuple(frozen)
