"""Opaque payloads on the wire: ``encode_blob`` / ``decode_blob``.

For what has no contract type: a NIXL agent's metadata, small control messages. The
body names its ``kind`` (a short str chosen by the caller, e.g. ``"nixl-md"``) next to
the ``payload`` bytes; ``decode_blob`` refuses a blob of another kind, so one kind of
message cannot be taken for another. Body: ``{kind: str, payload: bin}``.
"""

from __future__ import annotations

from kvxfer.wire.envelope import Buffer, open_message, seal
from kvxfer.wire.errors import WireError
from kvxfer.wire.fields import Fields, check_str
from kvxfer.wire.limits import DEFAULT_LIMITS, Limits

_BLOB_KEYS = frozenset({"kind", "payload"})


def encode_blob(kind: str, payload: bytes, key: bytes | None = None, *, limits: Limits = DEFAULT_LIMITS) -> bytes:
    """The wire bytes of ``payload`` labelled ``kind``; signed with ``key`` (see ``kvxfer.wire.auth``)."""
    if not isinstance(kind, str):
        raise WireError(f"blob kind must be str, got {type(kind).__name__}")
    check_str(kind, "blob: field kind", limits.string_bytes)
    if not isinstance(payload, (bytes, bytearray, memoryview)):
        raise WireError(f"blob payload must be bytes, got {type(payload).__name__}")
    payload = bytes(payload)
    if len(payload) > limits.blob_bytes:
        raise WireError(f"blob {kind!r}: payload is {len(payload)} bytes, the limit is {limits.blob_bytes}")
    return seal("blob", {"kind": kind, "payload": payload}, key, limits)


def decode_blob(data: Buffer, kind: str, key: bytes | None = None, *, limits: Limits = DEFAULT_LIMITS) -> bytes:
    """The payload of a blob of ``kind`` in ``data``; WireError for a blob of another kind
    and for anything malformed, oversized, unsigned while a key applies, or wrongly signed."""
    body, _mac = open_message(data, "blob", key, limits, max_items=4, max_containers=1)
    f = Fields(body, "blob", _BLOB_KEYS)
    got = f.text("kind", limits.string_bytes)
    if got != kind:
        raise WireError(f"expected a blob of kind {kind!r}, got kind {got!r}")
    return f.binary("payload", limits.blob_bytes)
