"""The ucx backend's two kinds of transfer: the publisher sends its rows (``Sending``), the
fetcher receives them (``Receiving``), in push and in pull alike. Only the progress thread
changes them after submission."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvxfer.backends.common.attempt import TrackedAttempt
from kvxfer.backends.ucx.packing import scatter
from kvxfer.backends.ucx.runs import RunPlan
from kvxfer.backends.ucx.sums import LandedSums
from kvxfer.backends.ucx.transport import TRANSFER_TAG_BITS
from kvxfer.contract import (
    BoolArray,
    Cancelled,
    CompletionRecord,
    Delivered,
    Failed,
    Hint,
    IndexArray,
    Outcome,
    RecordStatus,
    View,
)


def transfer_tag(fetcher_transfer_id: str) -> int:
    """The data tag prefix of a transfer, from the fetcher's transfer id (both ends know it:
    it is in the fetcher's hint). 39 bits of a hash of a 96-bit random id."""
    digest = hashlib.sha256(fetcher_transfer_id.encode()).digest()
    return int.from_bytes(digest[:8], "big") >> (64 - TRANSFER_TAG_BITS)


@dataclass(eq=False)
class Sending:
    """This end publishes: its rows go to the fetcher as one tag message per run."""

    attempt: TrackedAttempt
    view: View
    hint: Hint                 # the fetcher's
    own_id: str                # ours: the fetcher's records name it
    plan: RunPlan
    to_send: IndexArray        # rows of each run to send (fewer after an injected fault)
    tag: int
    deadline: float
    go: bool                   # push: at once; pull: once the fetcher asks
    injected: str | None = None
    sums: bool = False         # the fetcher checks rows: our digests follow each batch of sends
    summed_to: int = 0         # runs before this one had their digests sent
    next_run: int = 0
    inflight: dict[int, tuple[Any, int, Any]] = field(default_factory=dict)  # first run -> (send, end run, buffer)
    sent: IndexArray = field(default_factory=lambda: np.zeros(0, np.int64))  # rows whose send completed
    failure: str | None = None
    peer_gone: bool = False
    told: bool = False         # our stopping record went to the fetcher
    acked: bool = False        # the fetcher's acknowledgement came
    ask_again: float = 0.0

    @property
    def stopping(self) -> bool:
        return self.failure is not None or self.attempt.cancel_requested or self.attempt.poll() is not None

    @property
    def all_posted(self) -> bool:
        return self.next_run >= self.plan.runs


@dataclass(eq=False)
class Receiving:
    """This end fetches: it receives the publisher's messages into its rows, each only once
    it has arrived and while the transfer is live."""

    attempt: TrackedAttempt
    view: View
    hint: Hint                 # the publisher's
    own_id: str                # ours: the publisher's records name it; the data tag comes from it
    plan: RunPlan
    tag: int
    deadline: float
    expected: IndexArray       # rows of each run to wait for (fewer after a fault or a stop)
    limit: int | None = None   # pull: our own injected fault, sent with the request
    asked: bool = False        # pull: the publisher was asked to send
    received: IndexArray = field(default_factory=lambda: np.zeros(0, np.int64))
    held: list[Any] = field(default_factory=list)  # messages that came before fetch(), to land
    posted: dict[int, tuple[Any, IndexArray, Any]] = field(default_factory=dict)  # first run -> (receive, rows per run, buffer)
    stopped: RecordStatus | None = None  # the publisher stopped early, and said so
    reason: str = ""
    peer_gone: bool = False
    acked: bool = False
    next_heartbeat: float = 0.0
    sums: LandedSums | None = None  # integrity on: the publisher's digests, as they come
    held_sums: list[Any] = field(default_factory=list)  # digests that came before fetch(), to keep

    @property
    def complete(self) -> bool:
        return bool(np.all(self.received >= self.expected))

    def masks(self) -> list[BoolArray]:
        """The rows whose receives completed, as masks over the view's groups."""
        return self.plan.local_masks(self.view, self.received)


def take_received(wait: Receiving, state: Any) -> int | None:
    """Count the posted receives that ended (``state(request)``: UCX's PROC, DONE, GONE or an
    error), scattering packed ones into their rows; the first run whose receive failed, if one did."""
    failed = None
    for run, (request, counts, buffer) in list(wait.posted.items()):
        status = state(request)
        if status == "PROC":
            continue
        del wait.posted[run]
        if status == "DONE":
            if counts.size > 1:
                scatter(wait.view, wait.plan, run, counts, buffer)
            wait.received[run:run + counts.size] += counts
        elif status == "GONE":
            wait.peer_gone = True
        elif failed is None:
            failed = run
    return failed


def ending(wait: Receiving, now: float, deadline_s: float) -> Outcome | None:
    """How a live receiving transfer ends now, if it does: every expected row in (and no
    receive running), cancelled, its peer gone, or past its deadline. The masks are the
    rows whose receives completed."""
    if wait.complete and not wait.posted and (wait.sums is None or wait.sums.complete(wait.expected)):
        if wait.stopped is RecordStatus.CANCELLED:
            return Cancelled(True, wait.masks())
        if wait.stopped is RecordStatus.FAILED:
            return Failed(f"peer failed: {wait.reason}", wait.masks())
        if wait.limit is not None:
            return Failed(f"injected fault after {wait.limit} rows", wait.masks())
        return Delivered(tuple(wait.masks()))
    if wait.attempt.cancel_requested:
        return Cancelled(False, wait.masks())
    if wait.peer_gone:
        return Failed(f"ucx peer {wait.hint.agent!r} disconnected before completing", wait.masks())
    if now > wait.deadline:
        return Failed(f"timeout after {deadline_s:g}s waiting for peer {wait.hint.agent!r}", wait.masks())
    return None


def fits(record: CompletionRecord, view: View) -> bool:
    """The record's masks are one per group of ``view``, each of its length."""
    return len(record.masks) == len(view.groups) and all(
        m.shape == (len(g),) for m, g in zip(record.masks, view.groups))


def acknowledged(job: Sending, record: CompletionRecord) -> Outcome:
    """The publisher's outcome from the fetcher's acknowledgement: the rows it received."""
    if not fits(record, job.view):
        return Failed("peer sent a completion record of the wrong shape", job.view.row_masks())
    if record.status is RecordStatus.DELIVERED and job.injected is None:
        return Delivered(record.masks)
    if record.status is RecordStatus.CANCELLED:
        return Cancelled(not job.attempt.cancel_requested, record.masks)
    return Failed(job.injected or f"peer failed: {record.reason}", record.masks)


def acknowledgement(wait: Receiving, outcome: Outcome, sender: str) -> CompletionRecord:
    """The fetcher's record of how it concluded, with the rows of its outcome (not rows that
    landed after it), as masks over the publisher's hint groups: both ends report the same."""
    status = (RecordStatus.DELIVERED if isinstance(outcome, Delivered) else
              RecordStatus.CANCELLED if isinstance(outcome, Cancelled) else RecordStatus.FAILED)
    counts = wait.plan.rows_per_run(wait.view, list(outcome.masks))
    return CompletionRecord(wait.hint.transfer_id, sender, wait.view.request, status,
                            wait.plan.peer_masks(wait.hint, counts), getattr(outcome, "reason", ""))


def stop_record(job: Sending, sender: str) -> CompletionRecord:
    """The publisher stops early (a fault, cancel, a failure or timeout): which rows it sent."""
    cancelled = job.attempt.cancel_requested and job.injected is None and job.failure is None
    status = RecordStatus.CANCELLED if cancelled else RecordStatus.FAILED
    reason = "cancelled" if cancelled else (job.failure or job.injected or "stopped")
    return CompletionRecord(job.hint.transfer_id, sender, job.view.request, status,
                            job.plan.peer_masks(job.hint, job.sent), reason)


def end_idle(sending: list[Sending], receiving: list[Receiving]) -> None:
    """At shutdown, our progress thread gone: transfers with nothing of UCX's still reading or
    writing our rows conclude (Cancelled, if not concluded) and quiesce."""
    for job in sending:
        if not job.inflight:
            job.attempt.conclude(Cancelled(False, job.view.row_masks()))
            job.attempt.mark_quiesced()
    for wait in receiving:
        if not wait.posted:
            wait.attempt.conclude(Cancelled(False, wait.plan.local_masks(wait.view, wait.received)))
            wait.attempt.mark_quiesced()
