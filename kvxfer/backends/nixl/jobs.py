"""The nixl backend's bookkeeping for one attempt: which chunks are posted, proven, stuck.

An active job (push publisher, pull fetcher) moves bytes in chunks; a passive wait (push
fetcher, pull publisher) waits for the active end's completion record. Only the backend's
progress thread changes them after submission, through ``step_chunks``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvxfer.backends.common.attempt import TrackedAttempt
from kvxfer.backends.common.matching import proven_mask
from kvxfer.backends.common.transform import Oriented
from kvxfer.backends.nixl.agent import NixlAgent, PeerGone, XferError
from kvxfer.backends.nixl.packed_notes import Inbound
from kvxfer.contract import (
    BoolArray,
    Cancelled,
    Delivered,
    Failed,
    Hint,
    IndexArray,
    Outcome,
    RecordStatus,
    View,
)


class Carried(Protocol):
    """What a job's masks need of a chunk (an unpacked ``Chunk`` or a ``PackedChunk``)."""

    @property
    def group(self) -> int: ...
    @property
    def peer_group(self) -> int: ...
    @property
    def local_rows(self) -> IndexArray: ...
    @property
    def peer_rows(self) -> IndexArray: ...


@dataclass(eq=False)
class ActiveJob:
    """This end moves the bytes: WRITE into the peer's rows (push) or READ them (pull)."""

    attempt: TrackedAttempt
    view: View
    hint: Hint
    op: str                      # "WRITE" or "READ"
    chunks: list[Any]            # Chunk, or PackedChunk on the packed path (both are Carried)
    deadline: float
    injected: str | None = None  # the fault to report once the allowed rows are in
    ready: bool = True           # False while etcd has not delivered the peer's metadata
    next_chunk: int = 0
    not_before: float = 0.0      # paced posting (chunk_pause_s), for tests of mid-way faults
    inflight: dict[int, Any] = field(default_factory=dict)  # chunk index -> NIXL handle
    stuck: list[Any] = field(default_factory=list)           # handles NIXL would not release yet
    done: list[int] = field(default_factory=list)            # chunks proven delivered
    failure: str | None = None
    cancelled_by_peer: bool = False
    # NIXL does not abort a request that is still moving bytes when its handle is released
    # (seen with UCX over TCP: released READs and WRITEs still land), so requests in progress
    # are waited for even after a failure; only a peer known to be gone ends them sooner.
    peer_gone: bool = False
    # A push publisher's digests of the rows of the chunks it posted, aligned with the hint's
    # groups (checks.py: taken as chunks go, while their WRITEs move); None until one went.
    digests: list[Any] | None = None
    digested: int = 0            # chunks before this one have their rows in ``digests``
    read_check: Any = None       # a pull fetcher's check of its READ chunks (checks.ChunksRead; False: none)

    @property
    def touching(self) -> bool:
        """True while some NIXL request of this job may still access memory."""
        return bool(self.inflight or self.stuck)

    @property
    def finished(self) -> bool:
        """Nothing more will be posted: stopped (failure, cancel) or every chunk posted."""
        if self.touching:
            return False
        stopping = self.failure is not None or self.attempt.cancel_requested
        if not self.ready and not stopping:
            return False
        return stopping or self.next_chunk >= len(self.chunks)

    def masks(self) -> tuple[list[BoolArray], list[BoolArray]]:
        """(local masks aligned with the view, peer masks aligned with the hint) of proven
        chunks, read-only. A group whose every row is proven (the usual end) gets the shared
        all-True mask: nothing to fill, and the wire codec sends it without packing its bits."""
        done: list[Carried] = [self.chunks[i] for i in sorted(set(self.done))]  # a row is in one chunk
        local = self._masks([len(g) for g in self.view.groups], [(c.group, c.local_rows) for c in done])
        peer = self._masks([len(g) for g in self.hint.groups], [(c.peer_group, c.peer_rows) for c in done])
        return local, peer

    @staticmethod
    def _masks(sizes: list[int], proven: list[tuple[int, IndexArray]]) -> list[BoolArray]:
        parts: list[list[IndexArray]] = [[] for _ in sizes]
        for group, rows in proven:
            parts[group].append(rows)
        return [proven_mask(n, rows) for n, rows in zip(sizes, parts)]


@dataclass(eq=False)
class PassiveWait:
    """The peer moves the bytes; this end waits for its completion record."""

    attempt: TrackedAttempt
    view: View
    hint: Hint
    own_id: str
    deadline: float
    ask_again: float = 0.0  # when to ask the peer to stop (CANCEL_REQUEST), again while unanswered
    stop_reason: str = ""
    inbound: Inbound | None = None  # packed landing: set by the peer's request, or by fetch() granting ahead
    transform: Oriented | None = None  # between two geometries: the plan (made at submission)

    def masks(self) -> list[BoolArray]:
        """Rows known to be in place at this end: those scattered from packed chunks, else none."""
        if self.inbound is None:
            return self.view.row_masks()
        return [m.copy() for m in self.inbound.scattered]


def disconnected(job: ActiveJob) -> None:
    """The job's peer is gone: NIXL reported NIXL_ERR_REMOTE_DISCONNECT."""
    job.peer_gone = True
    job.failure = job.failure or f"peer {job.hint.agent!r} disconnected (NIXL_ERR_REMOTE_DISCONNECT)"


def check_deadline_and_peer(job: ActiveJob, agent: NixlAgent, now: float, deadline_s: float) -> None:
    """A job past its deadline fails; one waiting for its peer's metadata (etcd) asks again."""
    if now > job.deadline and job.failure is None:
        job.failure = f"timeout after {deadline_s:g}s moving rows with peer {job.hint.agent!r}"
    if not job.ready and job.failure is None:
        try:
            job.ready = agent.ensure_peer(job.hint.agent, job.hint.endpoint)
        except (ValueError, PeerGone) as exc:
            job.failure = f"peer {job.hint.agent!r} unreachable: {exc}"


def reap_requests(job: ActiveJob, agent: NixlAgent, what: str, on_done: Callable[[int], None],
                  on_ended: Callable[[int, bool], None]) -> bool:
    """Check the job's requests in flight: ``on_done(index)`` for each that completed, then
    ``on_ended(index, released)`` for each that ended, however (a handle NIXL would not
    release yet is kept in ``stuck``). Requests still in progress are waited for even after a
    failure (see ActiveJob.peer_gone). True when the peer turned out to be disconnected."""
    lost = False
    for index, handle in list(job.inflight.items()):
        state = agent.state(handle)
        if state == "PROC" and not job.peer_gone:
            continue
        if state == "DONE":
            on_done(index)
        elif state == "GONE":
            lost = True
            disconnected(job)
        elif state == "ERR":
            job.failure = job.failure or f"NIXL reported an error on {what} {index} with peer {job.hint.agent!r}"
        del job.inflight[index]
        released = agent.release(handle)
        if not released:
            job.stuck.append(handle)
        on_ended(index, released)
    job.stuck = [h for h in job.stuck if not agent.release(h)]
    return lost


def step_chunks(job: ActiveJob, agent: NixlAgent, *, window: int, pause_s: float, deadline_s: float) -> bool:
    """Check the job's requests, then post more (at most ``window`` in flight, none once it
    stops). A request that is DONE proves its chunk; once the job fails, requests still in
    progress are waited for (see ActiveJob.peer_gone), then their rows count as proven or
    not by how they ended. Returns True when the peer turned out to be disconnected."""
    now = time.monotonic()
    check_deadline_and_peer(job, agent, now, deadline_s)
    lost = reap_requests(job, agent, "chunk", job.done.append, lambda index, released: None)
    while (job.failure is None and not job.attempt.cancel_requested and job.ready
           and len(job.inflight) < window and job.next_chunk < len(job.chunks) and now >= job.not_before):
        if _post_next_chunk(job, agent):
            return True
        if job.failure is not None:
            break
        if pause_s:
            job.not_before = time.monotonic() + pause_s
            break
    return lost


def _post_next_chunk(job: ActiveJob, agent: NixlAgent) -> bool:
    """Post the job's next chunk; True when the peer turned out to be disconnected."""
    index = job.next_chunk
    chunk = job.chunks[index]
    job.next_chunk += 1
    try:
        post = agent.post(job.op, chunk.local_descs, chunk.local_kind, chunk.remote_descs, chunk.remote_kind,
                          job.hint.agent)
    except PeerGone:
        disconnected(job)
        return True
    except XferError as exc:
        job.failure = str(exc)
        return False
    if post.state == "DONE":
        job.done.append(index)
        if not agent.release(post.handle):
            job.stuck.append(post.handle)
    else:
        job.inflight[index] = post.handle
    return False


def conclusion(job: ActiveJob, local: list[BoolArray] | None = None,
               bad: str | None = None) -> tuple[RecordStatus, Outcome, str]:
    """The record status, local outcome and reason of a finished job (``local``: its local
    masks, when the caller has them already; ``bad``: why rows failed their integrity check)."""
    if local is None:
        local, _ = job.masks()
    complete = len(job.done) == len(job.chunks)
    if job.failure is not None:
        return RecordStatus.FAILED, Failed(job.failure, local), job.failure
    if job.injected is not None and complete:
        return RecordStatus.FAILED, Failed(job.injected, local), job.injected
    if job.attempt.cancel_requested and not complete:
        return RecordStatus.CANCELLED, Cancelled(job.cancelled_by_peer, local), "cancelled"
    if bad is not None:
        return RecordStatus.FAILED, Failed(bad, local), bad
    return RecordStatus.DELIVERED, Delivered(tuple(local)), ""
