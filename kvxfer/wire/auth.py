"""The shared key and the HMAC-SHA256 that authenticates a message.

Key selection, the same for every encode/decode function's ``key`` argument:

- ``key=None`` (the default): the key in the environment variable ``KVXFER_HINT_KEY``,
  read at each call; no key when the variable is unset or empty.
- ``key=b""``: no key, whatever the environment says (to force unsigned messages).
- any other bytes: that key. It must be at least ``MIN_KEY_BYTES`` long.

``KVXFER_HINT_KEY`` holds the key as **hex** (e.g. the output of ``openssl rand -hex 32``),
surrounding whitespace ignored; anything that is not hex of at least ``MIN_KEY_BYTES``
bytes is refused with a WireError naming the variable, never used as raw text, so that a
typo cannot silently become a different key.

Policy on decode: with a key, an unsigned or wrongly signed message is refused. Without
a key, a *signed* message is refused too: one end has a key and the other does not, a
misconfiguration that should stop the first message rather than half-authenticate.
"""

from __future__ import annotations

import hashlib
import hmac
import os

from kvxfer.wire.errors import WireError

ENV_KEY = "KVXFER_HINT_KEY"
MIN_KEY_BYTES = 16
MAC_BYTES = 32
_DOMAIN = b"kvxfer-wire-mac\x00"


def hint_key_from_env() -> bytes | None:
    """The key in ``KVXFER_HINT_KEY`` (hex), or None when the variable is unset or empty."""
    text = os.environ.get(ENV_KEY, "").strip()
    if not text:
        return None
    try:
        key = bytes.fromhex(text)
    except ValueError:
        raise WireError(
            f"{ENV_KEY} must be the key in hex (e.g. `openssl rand -hex 32`); its value is not hex"
        ) from None
    if len(key) < MIN_KEY_BYTES:
        raise WireError(f"{ENV_KEY} holds a {len(key)}-byte key; at least {MIN_KEY_BYTES} bytes are needed")
    return key


def resolve_key(key: bytes | None) -> bytes | None:
    """The key a call uses: the argument, the environment's for None, none for b""."""
    if key is None:
        return hint_key_from_env()
    if not isinstance(key, (bytes, bytearray, memoryview)):
        raise WireError(f"key must be bytes or None, got {type(key).__name__}")
    key = bytes(key)
    if not key:
        return None
    if len(key) < MIN_KEY_BYTES:
        raise WireError(f"key is {len(key)} bytes; at least {MIN_KEY_BYTES} bytes are needed")
    return key


def mac(key: bytes, version: int, msg_type: str, body: bytes) -> bytes:
    """HMAC-SHA256 over the version, the message type and the body bytes.

    The type is inside the MAC so that a signed completion record can never be replayed
    as a signed hint (or a blob of one kind as another) by rewriting the envelope.
    """
    tag = msg_type.encode()
    signed = b"".join((_DOMAIN, version.to_bytes(4, "big"), len(tag).to_bytes(2, "big"), tag, body))
    return hmac.new(key, signed, hashlib.sha256).digest()


def verify(key: bytes, version: int, msg_type: str, body: bytes, given: bytes) -> bool:
    return hmac.compare_digest(mac(key, version, msg_type, body), given)
