"""kvxfer.wire: the strict msgpack codec for hints, completion records and opaque blobs.

Every message is an envelope (``kvxfer.wire.envelope``) holding a wire version, a message
type (``hint``, ``hints``, ``completion`` or ``blob``), the body bytes and, when a key applies, an
HMAC-SHA256 (``kvxfer.wire.auth``: ``key=None`` uses ``KVXFER_HINT_KEY`` in hex,
``key=b""`` forces none). Decoding is strict: str keys, no ext types, exact key sets,
exact types, every string, array and message bounded (``kvxfer.wire.limits``), row
arrays as little-endian int64 bytes and masks as packed bits (``kvxfer.wire.arrays``),
and the result validated into the frozen contract types. Every refusal is a
``WireError`` naming the field and the problem; nothing else escapes a decode.
"""

from kvxfer.wire.auth import ENV_KEY, MIN_KEY_BYTES, hint_key_from_env
from kvxfer.wire.blob import decode_blob, encode_blob
from kvxfer.wire.envelope import WIRE_VERSION
from kvxfer.wire.errors import WireError
from kvxfer.wire.hint import decode_hint, encode_hint
from kvxfer.wire.hints import MAX_HINTS, decode_hints, encode_hints
from kvxfer.wire.limits import DEFAULT_LIMITS, Limits
from kvxfer.wire.record import decode_completion, encode_completion

__all__ = [
    "DEFAULT_LIMITS", "ENV_KEY", "Limits", "MIN_KEY_BYTES", "WIRE_VERSION", "WireError", "decode_blob",
    "decode_completion", "decode_hint", "encode_blob", "encode_completion", "encode_hint", "hint_key_from_env",
    "MAX_HINTS", "decode_hints", "encode_hints",
]
