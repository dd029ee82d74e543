"""The ucx backend's control messages besides completion records, signed like them when a key
is set (``kvxfer.wire.auth``): the pull request (``G``: the fetcher asks the publisher to send,
naming itself and, for an injected fault, how many rows it wants), so that no other process can
start or shorten a publisher's sends; and the publisher's row digests (``S``)."""

from __future__ import annotations

import hmac
import struct
from dataclasses import dataclass

import numpy as np

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


# --- the publisher's digests of the rows it sent (``S``) ------------------------------------
_SUMS_HEAD = struct.Struct("<qqBHH")  # first run, end run, has digests, len(sender), len(transfer id)
_SUMS_DOMAIN = b"kvxfer-ucx-sums\0"


@dataclass(frozen=True, eq=False)
class RunSums:
    """The digests of the rows of runs ``first .. end-1``, in the plan's order, all rows of
    each run (``kvxfer.backends.common.integrity``); None: the publisher sends none (integrity
    is off there), so no row it sends can be checked."""

    transfer_id: str  # the fetcher's
    sender: str       # the publisher's agent name
    first: int
    end: int
    digests: np.ndarray | None


def encode_sums(sums: RunSums, key: bytes) -> bytes:
    """``S`` + the digests (+ their MAC when ``key``: a digest is an integrity check, the MAC
    says who sent it)."""
    sender, transfer = sums.sender.encode(), sums.transfer_id.encode()
    head = _SUMS_HEAD.pack(sums.first, sums.end, sums.digests is not None, len(sender), len(transfer))
    body = b"" if sums.digests is None else np.ascontiguousarray(sums.digests, dtype="<u8").tobytes()
    payload = head + sender + transfer + body
    return b"S" + payload + (hmac.new(key, _SUMS_DOMAIN + payload, "sha256").digest()[:_MAC_BYTES] if key else b"")


def decode_sums(body: bytes, key: bytes) -> RunSums | None:
    """The digests after the ``S``; None when malformed or, with a key, not signed by it."""
    if key:
        mac = hmac.new(key, _SUMS_DOMAIN + body[:-_MAC_BYTES], "sha256").digest()[:_MAC_BYTES]
        if len(body) < _MAC_BYTES or not hmac.compare_digest(mac, body[-_MAC_BYTES:]):
            return None
        body = body[:-_MAC_BYTES]
    if len(body) < _SUMS_HEAD.size:
        return None
    first, end, has, n_sender, n_id = _SUMS_HEAD.unpack_from(body)
    rest = body[_SUMS_HEAD.size:]
    tail = rest[n_sender + n_id:]
    if len(rest) < n_sender + n_id or not 0 <= first < end or len(tail) % 8 or (not has and tail):
        return None
    try:
        sender, transfer = rest[:n_sender].decode(), rest[n_sender:n_sender + n_id].decode("ascii")
    except UnicodeDecodeError:
        return None
    digests = np.frombuffer(tail, dtype="<u8").astype(np.uint64) if has else None
    return RunSums(transfer, sender, first, end, digests)
