"""The ucx backend's pull request: the fetcher asks the publisher to send (``G``), naming
itself and, for an injected fault, how many rows it wants. Signed like completion records
when a key is set (``kvxfer.wire.auth``), so that no other process can start or shorten a
publisher's sends."""

from __future__ import annotations

import hmac
import struct
from dataclasses import dataclass

_HEAD = struct.Struct("<qH")  # row limit (-1: none), length of the sender's name
_MAC_BYTES = 16
_DOMAIN = b"kvxfer-ucx-pull\0"


@dataclass(frozen=True)
class PullRequest:
    transfer_id: str  # the publisher's
    sender: str       # the fetcher's agent name
    limit: int | None


def _mac(key: bytes, payload: bytes) -> bytes:
    return hmac.new(key, _DOMAIN + payload, "sha256").digest()[:_MAC_BYTES]


def encode_pull(request: PullRequest, key: bytes) -> bytes:
    """``G`` + the request (+ its MAC when ``key``)."""
    sender = request.sender.encode()
    head = _HEAD.pack(-1 if request.limit is None else request.limit, len(sender))
    payload = head + sender + request.transfer_id.encode()
    return b"G" + payload + (_mac(key, payload) if key else b"")


def decode_pull(body: bytes, key: bytes) -> PullRequest | None:
    """The request after the ``G``; None when it is malformed or, with a key, not signed by it."""
    if key:
        if len(body) < _MAC_BYTES or not hmac.compare_digest(_mac(key, body[:-_MAC_BYTES]), body[-_MAC_BYTES:]):
            return None
        body = body[:-_MAC_BYTES]
    if len(body) < _HEAD.size:
        return None
    limit, n = _HEAD.unpack_from(body)
    rest = body[_HEAD.size:]
    if len(rest) <= n or limit < -1:
        return None
    try:
        return PullRequest(rest[n:].decode("ascii"), rest[:n].decode(), None if limit < 0 else limit)
    except UnicodeDecodeError:
        return None
