"""Completion frames: what an IpcBackend's active end sends to say how a transfer ended.

A frame is a ``kvxfer.wire.encode_completion`` record, signed when a key is set. The usual
record, DELIVERED with every row of the passive end's hint, travels as 20 bytes instead:
``DONE_PREFIX`` and a token that the passive end looks up (``done_token``). It saves
encoding the record on the active end and decoding it on the passive end, which on a busy
host were most of a small transfer's latency. Unsigned, the token comes in the passive
end's hint (``EXTRA_DONE``); signed, both ends derive it from the key, so that it is no
easier to forge than a signed record. A doorbell (``doorbells``) stores the same token, folded
to 64 bits.
"""

from __future__ import annotations

import hmac
import logging
import secrets

from kvxfer.backends.ipc.jobs import ActiveJob
from kvxfer.contract import CompletionRecord, Hint, RecordStatus, constant_mask
from kvxfer.wire import WireError, decode_completion, encode_completion

log = logging.getLogger(__name__)

EXTRA_DONE = "ipc.done"  # unsigned hints only: the token of this transfer's "DELIVERED, every row"
DONE_PREFIX = b"KXD1"  # + a 16-byte token: that record in 20 bytes (a msgpack map never starts so)
TOKEN_BYTES = 16
TOKEN_FRAME_BYTES = len(DONE_PREFIX) + TOKEN_BYTES


class CompletionFrames:
    """Tokens and records of one backend (``name``, the agent that sends them), signed with
    ``key`` (b"": unsigned)."""

    def __init__(self, name: str, key: bytes) -> None:
        self.name = name
        self.key = key
        self._secret = secrets.token_bytes(32)  # derives the tokens of unsigned hints

    def done_token(self, transfer_id: str, sender: str, request: str) -> bytes:
        """The token that stands for "DELIVERED, every row" of one transfer. Signed (a key is
        set): both ends derive it from the key, the transfer and the sender, so that only a
        key holder can send it, as only one can sign a record. Unsigned: the passive end puts
        it in its hint (``EXTRA_DONE``), derived from a secret of its own."""
        secret = self.key or self._secret
        text = "\0".join(("kvxfer-ipc-done", transfer_id, sender, request)).encode("utf-8", "surrogatepass")
        return hmac.new(secret, text, "sha256").digest()[:TOKEN_BYTES]

    def hint_extras(self, transfer_id: str, request: str) -> tuple[tuple[str, bytes], ...]:
        """What our describe() says of the token: unsigned, the token itself; signed, nothing."""
        if self.key:
            return ()
        return ((EXTRA_DONE, self.done_token(transfer_id, "", request)),)

    def wait_token(self, own_id: str, hint: Hint, request: str) -> bytes:
        """The token a passive wait is ended by (signed: only its peer can send it)."""
        return self.done_token(own_id, hint.agent if self.key else "", request)

    def job_token(self, job: ActiveJob) -> bytes | None:
        """Derived once per job (the doorbell's value, then the frame): signed, it is an HMAC."""
        if job.token is None:
            if self.key:
                job.token = self.done_token(job.hint.transfer_id, self.name, job.view.request)
            else:
                token = job.hint.extra(EXTRA_DONE)
                job.token = token if token is not None and len(token) == TOKEN_BYTES else b""
        return job.token or None

    def delivered_frame(self, job: ActiveJob) -> bytes | None:
        """What tells the passive end that every row of its hint is in place: 20 bytes when it
        gave us a token (or we share a key), else the full record; None if it cannot be encoded."""
        if all(m is constant_mask(len(m), True) or bool(m.all()) for m in job.peer_masks):
            token = self.job_token(job)
            if token is not None:
                return DONE_PREFIX + token
        return self.encode(self.delivered_record(job))

    def delivered_record(self, job: ActiveJob) -> CompletionRecord:
        return CompletionRecord(job.hint.transfer_id, self.name, job.view.request, RecordStatus.DELIVERED,
                                job.peer_masks, "")

    def encode(self, record: CompletionRecord) -> bytes | None:
        try:
            return encode_completion(record, self.key)
        except WireError as exc:
            log.error("IPC backend %s: cannot encode a completion record: %s", self.name, exc)
            return None

    def decode(self, frame: bytes) -> CompletionRecord | None:
        """The record in a frame that is not a token; None (logged) when it is not one of ours."""
        try:
            return decode_completion(frame, self.key)
        except WireError as exc:
            log.warning("IPC backend %s: dropped a completion record: %s", self.name, exc)
            return None
