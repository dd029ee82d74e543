"""Completion records on the wire: ``encode_completion`` / ``decode_completion``.

Body (a msgpack map, str keys, every key required)::

    transfer_id, sender, request: str (non-empty)    reason: str (may be empty)
    status: "delivered" | "failed" | "cancelled" | "cancel_request"
    masks: array of {rows: uint, bits: bin}, one per group of the receiver's hint;
           bits are packed least-significant-bit first (see ``kvxfer.wire.arrays``)

Optional: ``digests``: array of bin, one per mask, each its rows' uint64 row digests as
little-endian bytes (8 per row); absent when the record carries none. Inside the body, so
under the MAC when a key applies.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvxfer.contract import CompletionRecord, RecordStatus
from kvxfer.wire.arrays import mask_from_bytes, mask_to_bytes
from kvxfer.wire.envelope import Buffer, open_message, seal
from kvxfer.wire.errors import WireError
from kvxfer.wire.fields import Fields, check_str
from kvxfer.wire.limits import DEFAULT_LIMITS, Limits

_RECORD_KEYS = frozenset({"transfer_id", "sender", "request", "status", "reason", "masks"})
_OPTIONAL_KEYS = frozenset({"digests"})
_MASK_KEYS = frozenset({"rows", "bits"})
_LE_UINT64 = np.dtype("<u8")
_MAP_FIELDS = 16


def encode_completion(record: CompletionRecord, key: bytes | None = None, *, limits: Limits = DEFAULT_LIMITS) -> bytes:
    """The wire bytes of ``record``; signed with ``key`` (see ``kvxfer.wire.auth`` for None and b"")."""
    if not isinstance(record, CompletionRecord):
        raise WireError(f"encode_completion needs a CompletionRecord, got {type(record).__name__}")
    for name in ("transfer_id", "sender", "request"):
        check_str(getattr(record, name), f"completion record: field {name}", limits.string_bytes)
    check_str(record.reason, "completion record: field reason", limits.string_bytes, empty=True)
    if len(record.masks) > limits.groups:
        raise WireError(f"completion record: {len(record.masks)} masks, the limit is {limits.groups}")
    for i, mask in enumerate(record.masks):
        if mask.size > limits.rows:
            raise WireError(f"completion record: mask {i} has {mask.size} rows, the limit is {limits.rows}")
    body = {
        "transfer_id": record.transfer_id, "sender": record.sender, "request": record.request,
        "status": record.status.value, "reason": record.reason,
        "masks": [{"rows": int(m.size), "bits": mask_to_bytes(m)} for m in record.masks],
    }
    if record.digests:
        body["digests"] = [np.ascontiguousarray(d, dtype=_LE_UINT64).tobytes() for d in record.digests]
    return seal("completion", body, key, limits)


def decode_completion(data: Buffer, key: bytes | None = None, *, limits: Limits = DEFAULT_LIMITS) -> CompletionRecord:
    """The CompletionRecord in ``data``; WireError for anything malformed, oversized, of
    another version or type, unsigned while a key applies, or wrongly signed."""
    # The body map, the masks array and one map per mask, and the digests array.
    body, _mac = open_message(data, "completion", key, limits, max_items=max(limits.groups, _MAP_FIELDS),
                              max_containers=3 + limits.groups)
    f = Fields(body, "completion record", _RECORD_KEYS, _OPTIONAL_KEYS)
    text = limits.string_bytes
    strings = {name: f.text(name, text) for name in ("transfer_id", "sender", "request")}
    status = f.choice("status", RecordStatus)
    reason = f.text("reason", text, empty=True)
    masks = [_decode_mask(m, i, limits) for i, m in enumerate(f.array("masks", limits.groups))]
    digests = _decode_digests(f, masks, limits) if f.has("digests") else []
    try:
        return CompletionRecord(status=status, masks=masks, reason=reason, digests=digests, **strings)
    except (TypeError, ValueError) as exc:
        raise WireError(f"completion record: {exc}") from None


def _decode_mask(value: Any, index: int, limits: Limits) -> Any:
    where = f"completion record mask {index}"
    f = Fields(value, where, _MASK_KEYS)
    rows = f.uint("rows")
    return mask_from_bytes(rows, f.binary("bits", (limits.rows + 7) // 8), where, limits.rows)


def _decode_digests(f: Fields, masks: list[Any], limits: Limits) -> list[Any]:
    items = f.array("digests", limits.groups)
    if len(items) != len(masks):
        raise WireError(f"completion record: {len(items)} digest arrays for {len(masks)} masks")
    out = []
    for i, (item, mask) in enumerate(zip(items, masks)):
        if type(item) is not bytes:
            raise WireError(f"completion record: digests item {i} must be bin")
        if len(item) != 8 * mask.size:
            raise WireError(f"completion record: digests item {i} is {len(item)} bytes for {mask.size} rows, "
                            f"expected {8 * mask.size}")
        out.append(np.frombuffer(item, dtype=_LE_UINT64).astype(np.uint64, copy=False))
    return out
