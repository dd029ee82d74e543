"""The completion record one end sends the other when its side of a transfer ends."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvxfer.contract.arrays import BoolArray
from kvxfer.contract.outcome import freeze_mask


class RecordStatus(enum.Enum):
    DELIVERED = "delivered"
    FAILED = "failed"
    CANCELLED = "cancelled"
    CANCEL_REQUEST = "cancel_request"


@dataclass(frozen=True, eq=False)
class CompletionRecord:
    """``transfer_id`` is the *receiver's* id (from the receiver's own hint); ``masks`` align
    with the receiver's hint groups: True for each of its rows whose bytes are in place."""

    transfer_id: str
    sender: str
    request: str
    status: RecordStatus
    masks: tuple[BoolArray, ...]
    reason: str = ""

    def __init__(
        self, transfer_id: str, sender: str, request: str, status: RecordStatus,
        masks: Sequence[Any], reason: str = "",
    ) -> None:
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
