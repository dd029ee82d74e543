"""The envelope every message travels in: version, message type, body bytes, optional MAC.

On the wire a message is one msgpack map with str keys::

    {"kvxfer": 1, "type": "hint" | "completion" | "blob", "body": <bin>, "mac": <bin, 32>}

``kvxfer`` is the wire version (and marks the bytes as ours); ``body`` is itself a
msgpack map, kept as bytes so that the MAC covers exactly what was sent and nothing of
it is parsed before the MAC is checked; ``mac`` is present only on signed messages (see
``kvxfer.wire.auth``). The type is checked before the body is read, so a completion
record can never decode as a hint.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, NoReturn, Union

import msgpack

from kvxfer.wire.auth import MAC_BYTES, mac, resolve_key, verify
from kvxfer.wire.errors import WireError
from kvxfer.wire.fields import Fields, describe
from kvxfer.wire.limits import Limits

Buffer = Union[bytes, bytearray, memoryview]  # what decode_* accept
WIRE_VERSION = 1
MESSAGE_TYPES = frozenset({"hint", "hints", "completion", "blob"})
_ENVELOPE_KEYS = frozenset({"kvxfer", "type", "body"})


def _refuse_ext(code: int, data: bytes) -> NoReturn:
    raise ValueError(f"msgpack ext type {code} is not allowed")


def container_budget(max_containers: int) -> Callable[[Any], Any]:
    """A msgpack list_hook/object_hook that lets through at most ``max_containers`` arrays and
    maps, then raises ValueError: each one-byte empty array becomes a Python list of about 70
    bytes, so nested arrays would cost 70 times their size in memory before any check."""
    left = [max_containers]

    def counted(obj: Any) -> Any:
        left[0] -= 1
        if left[0] < 0:
            raise ValueError(f"more than {max_containers} arrays and maps")
        return obj

    return counted


def unpack(data: Buffer, what: str, limits: Limits, *, max_items: int, max_containers: int) -> Any:
    """Strict msgpack: str map keys only, no ext types, every object bounded in size, and at
    most ``max_containers`` arrays and maps in all.

    Any msgpack failure (truncation, trailing bytes, bad UTF-8, nesting too deep, a size
    beyond the limits, too many containers: see container_budget) becomes a WireError
    naming ``what``.
    """
    counted = container_budget(max_containers)
    try:
        return msgpack.unpackb(
            data, raw=False, strict_map_key=True, use_list=True, ext_hook=_refuse_ext,
            list_hook=counted, object_hook=counted,
            # str and bin need their bytes present, so the message limit bounds them; the
            # field checks then name an oversized string. Array and map headers can claim
            # counts the data does not hold, so those get the tight bound.
            max_bin_len=limits.message_bytes, max_str_len=limits.message_bytes,
            max_array_len=max_items, max_map_len=max_items,
            max_ext_len=0,
        )
    # msgpack's refusals are ValueError subclasses (ExtraData, FormatError, StackError, bad
    # UTF-8, limits exceeded, non-str keys) or UnpackException (OutOfData for truncation).
    except (ValueError, msgpack.UnpackException) as exc:
        detail = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        raise WireError(f"{what} is not valid msgpack within the limits ({detail})"[:300]) from None


_packers = threading.local()


def pack(obj: Any, what: str) -> bytes:
    # One Packer per thread: msgpack.packb builds a new one per call, a third of a small
    # record's encoding time; a Packer is not safe to share between threads.
    packer = getattr(_packers, "packer", None)
    if packer is None:
        packer = _packers.packer = msgpack.Packer(use_bin_type=True)
    try:
        return packer.pack(obj)
    except (OverflowError, TypeError, ValueError) as exc:  # e.g. an int beyond uint64
        raise WireError(f"cannot encode {what}: {type(exc).__name__}: {exc}"[:300]) from None


def seal(msg_type: str, body: dict[str, Any], key: bytes | None, limits: Limits) -> bytes:
    """Encode ``body`` as a message of ``msg_type``, signed when a key applies."""
    body_bytes = pack(body, f"{msg_type} body")
    envelope: dict[str, Any] = {"kvxfer": WIRE_VERSION, "type": msg_type, "body": body_bytes}
    key = resolve_key(key)
    if key is not None:
        envelope["mac"] = mac(key, WIRE_VERSION, msg_type, body_bytes)
    data = pack(envelope, f"{msg_type} message")
    if len(data) > limits.message_bytes:
        raise WireError(f"{msg_type} message is {len(data)} bytes, the limit is {limits.message_bytes}")
    return data


def open_message(
    data: Any, msg_type: str, key: bytes | None, limits: Limits, *, max_items: int, max_containers: int
) -> tuple[Any, bytes | None]:
    """The decoded body of a message of ``msg_type``, after version, type and MAC checks,
    and the MAC it was verified with (None for an unsigned message). The envelope may hold
    no container but itself; the body at most ``max_containers``."""
    view: Buffer
    if type(data) is bytes:  # what sockets hand over: nothing to convert
        view = data
    else:
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise WireError(f"a {msg_type} message must be bytes, got {type(data).__name__}")
        try:
            view = memoryview(data)
            if not view.c_contiguous:
                raise WireError(f"a {msg_type} message must be contiguous bytes, got a strided memoryview")
            view = view.cast("B")  # msgpack refuses buffers of wider items
        except (ValueError, TypeError) as exc:  # a released memoryview, say
            raise WireError(f"a {msg_type} message cannot be read as bytes: {exc}") from None
    if len(view) > limits.message_bytes:
        raise WireError(f"message is {len(view)} bytes, the limit is {limits.message_bytes}")
    key = resolve_key(key)
    outer = unpack(view, "message", limits, max_items=8, max_containers=1)
    if type(outer) is not dict or "kvxfer" not in outer:
        raise WireError(f"not a kvxfer wire message (expected a map with a 'kvxfer' version field, got {describe(outer)})")
    version = outer["kvxfer"]
    if type(version) is not int or version != WIRE_VERSION:
        shown = version if type(version) is int else describe(version)
        raise WireError(f"unsupported wire version {shown}: this end speaks version {WIRE_VERSION}")
    env = Fields(outer, "message envelope", _ENVELOPE_KEYS, frozenset({"mac"}))
    got_type = outer["type"]
    if type(got_type) is not str or got_type not in MESSAGE_TYPES:
        shown = repr(got_type)[:40] if type(got_type) is str else describe(got_type)
        raise WireError(f"message envelope: field type must be one of {sorted(MESSAGE_TYPES)}, got {shown}")
    if got_type != msg_type:
        raise WireError(f"expected a {msg_type} message, got a {got_type} message")
    body = env.binary("body", limits.message_bytes)
    given: bytes | None = None
    if env.has("mac"):
        given = env.binary("mac", MAC_BYTES)
        if key is None:
            raise WireError(
                f"{msg_type} message is signed but no key is configured here: set KVXFER_HINT_KEY as the sender did"
            )
        if len(given) != MAC_BYTES or not verify(key, WIRE_VERSION, msg_type, body, given):
            raise WireError(f"{msg_type} message has a wrong MAC: signed with another key, or altered on the way")
    elif key is not None:
        raise WireError(f"{msg_type} message is unsigned but a key is configured: refusing unauthenticated messages")
    return unpack(body, f"{msg_type} body", limits, max_items=max_items, max_containers=max_containers), given
