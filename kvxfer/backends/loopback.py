"""The in-process reference backend: host memory copies between backends of one fabric.

It keeps every rule of the contract with the simplest possible transport (``memmove``),
so it is the oracle the other backends are compared with. Push and pull work as the
peer backends do: the active end copies and then sends a completion record; the
passive end concludes from that record. Faults can be injected after k rows, and each
submission can be delayed, so that tests can exercise partial delivery and cancellation.

Integrity (``integrity=True``, the default; ``kvxfer.backends.common.integrity``): the end
that reads the source rows digests them (a push publisher as it copies, a pull publisher in
describe()) and the fetcher checks its rows where they landed; ``corrupt_landed`` is the
fetcher's test hook that changes landed bytes before that check. Between engine geometries a
push publisher digests each destination block's KV from the source segments it copied
(``plan_digest``) and the fetcher checks it with its own plan; a pull is not checked.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from kvxfer.backends.common.attempt import TrackedAttempt
from kvxfer.backends.common.engine import BackendEngine, ProgressThread, conclude_from_record, stop_reason
from kvxfer.backends.common.integrity import (
    DIGEST_EXTRA,
    CorruptFn,
    RowCheck,
    expected_from_hint,
    geometry_digests,
    group_digests,
    pack_digests,
    peer_masks_from_local,
    sent_digests,
)
from kvxfer.backends.common.matching import GroupMatch, coalesce, match_rows
from kvxfer.backends.common.transfers import DEFAULT_HINT_TTL_S
from kvxfer.backends.common.transform import Oriented, copy_runs, plan_between
from kvxfer.contract import (
    Cancelled,
    CompletionRecord,
    Delivered,
    Failed,
    Hint,
    MemoryKind,
    Peer,
    RecordStatus,
    SlotRegion,
    TransferMode,
    View,
    WakeFn,
)

log = logging.getLogger(__name__)

BACKEND_KIND = "loopback"


class LoopbackFabric:
    """The in-process 'network': backends by agent name, and record delivery between them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._agents: dict[str, LoopbackBackend] = {}

    def join(self, backend: LoopbackBackend) -> None:
        with self._lock:
            if backend.name in self._agents:
                raise ValueError(f"agent name {backend.name!r} is already on this fabric")
            self._agents[backend.name] = backend

    def leave(self, backend: LoopbackBackend) -> None:
        with self._lock:
            if self._agents.get(backend.name) is backend:
                del self._agents[backend.name]
            others = list(self._agents.values())
        for other in others:
            other._peer_gone(backend.name)

    def alive(self, name: str) -> bool:
        with self._lock:
            return name in self._agents

    def deliver(self, to: str, record: CompletionRecord) -> bool:
        with self._lock:
            target = self._agents.get(to)
        if target is None:
            return False
        target._inbox_put(record)
        return True


@dataclass(eq=False)
class _Active:
    """This end moves the bytes (push publisher, pull fetcher)."""

    attempt: TrackedAttempt
    view: View
    hint: Hint
    matches: list[GroupMatch]
    writes_peer: bool
    not_before: float
    cancelled_by_peer: bool = False
    transform: Oriented | None = None  # engine geometries at both ends: the plan moves the bytes
    fail_after_rows: int | None = None  # the backend's injected fault when it was submitted


@dataclass(eq=False)
class _Passive:
    """The peer moves the bytes; this end waits for its completion record."""

    attempt: TrackedAttempt
    view: View
    hint: Hint
    own_id: str
    deadline: float
    told_peer: bool = False
    transform: Oriented | None = None  # a push fetch between geometries, checked: its plan


@dataclass(eq=False)
class _Inbox:
    lock: threading.Lock = field(default_factory=threading.Lock)
    records: list[CompletionRecord] = field(default_factory=list)
    gone: list[str] = field(default_factory=list)


class LoopbackBackend(BackendEngine):
    """Reference backend over host memory, in one process."""

    KIND = BACKEND_KIND
    TITLE = "loopback"
    GEOMETRY = True

    def __init__(
        self,
        fabric: LoopbackFabric,
        name: str,
        mode: TransferMode = TransferMode.PUSH,
        *,
        fail_after_rows: int | None = None,
        delay_s: float = 0.0,
        deadline_s: float = 30.0,
        hint_ttl_s: float = DEFAULT_HINT_TTL_S,
        integrity: bool = True,
        corrupt_landed: CorruptFn | None = None,
    ) -> None:
        self._start_engine(name, mode, frozenset({MemoryKind.HOST}), hint_ttl_s)
        self.integrity = RowCheck(integrity, corrupt_landed)
        self.fail_after_rows = fail_after_rows
        self.delay_s = delay_s
        self.deadline_s = deadline_s
        self._fabric = fabric
        self._active: list[_Active] = []
        self._passive: dict[str, _Passive] = {}  # by this end's transfer id
        self._inbox = _Inbox()
        self._kick = threading.Event()
        fabric.join(self)
        self._progress = ProgressThread(f"kvxfer-loopback-{name}", lambda: self._step(), self._pause,
                                        functools.partial(log.exception, "loopback backend %s: progress step failed",
                                                          name))
        self._progress.start()

    # --- the contract -----------------------------------------------------------------
    def register(self, regions: Iterable[SlotRegion]) -> tuple[SlotRegion, ...]:
        batch, skipped = self._reachable(regions)
        self._regions.add(batch)
        return skipped

    def describe(self, view: View, audience: Peer | None = None) -> Hint:
        transfer_id = self._describe_checked(view)
        extras: tuple[tuple[str, bytes], ...] = ()
        if self.mode is TransferMode.PULL and self.integrity.applies(view):
            # The fetcher reads these rows itself: they are committed and pinned now.
            extras = ((DIGEST_EXTRA, pack_digests(group_digests(view))),)
        return self._hint(view, transfer_id, audience, extras=extras)

    def shutdown(self) -> frozenset[TrackedAttempt]:
        active: list[_Active] = []
        passive: list[_Passive] = []

        def attempts() -> list[TrackedAttempt]:  # under the lock that closes us: no job is missed
            active.extend(self._active)
            passive.extend(self._passive.values())
            return [j.attempt for j in active] + [w.attempt for w in passive]

        self._close_and_cancel(attempts, self._kick.set)
        stopped = self._progress.stop(self._kick.set, 10.0)
        self._fabric.leave(self)
        if not stopped:
            return frozenset(j.attempt for j in active + passive)
        # Active copies ran on our thread, which has exited: they can touch nothing more.
        for job in active:
            job.attempt.conclude(Cancelled(False, job.view.row_masks()))
            job.attempt.mark_quiesced()
        return frozenset(w.attempt for w in passive if not w.attempt.quiesced())

    # --- submission -------------------------------------------------------------------
    def _submit(self, view: View, hint: Hint, wake: WakeFn | None, *, fetching: bool) -> TrackedAttempt:
        admitted = self._admit(view, hint, fetching=fetching)
        now = time.monotonic()
        attempt = TrackedAttempt(wake, self._on_cancel, admitted.label)
        if admitted.active:
            transform = plan_between(view, hint, fetching=fetching) if view.geometry is not None else None
            matches = [] if transform is not None else match_rows(view, hint)
            job = _Active(attempt, view, hint, matches, writes_peer=not fetching,
                          not_before=now + self.delay_s, transform=transform, fail_after_rows=self.fail_after_rows)
            with self._jobs_lock:
                self._claim(hint, attempt)
                self._active.append(job)
        else:
            checked = fetching and view.geometry is not None and self.integrity.applies_geometry(view)
            wait = _Passive(attempt, view, hint, admitted.own_id, deadline=now + self.deadline_s,
                            transform=plan_between(view, hint, fetching=True) if checked else None)
            with self._jobs_lock:
                self._refuse_if_closed()
                self._passive[admitted.own_id] = wait
                early = self._stashed.pop(admitted.own_id, None)
            if early is not None:
                self._inbox_put(early)
        self._own.consume(view, admitted.own_id)
        self._kick.set()
        return attempt

    def _on_cancel(self, attempt: TrackedAttempt) -> None:
        self._kick.set()

    # --- the progress thread ----------------------------------------------------------
    def _inbox_put(self, record: CompletionRecord) -> None:
        with self._inbox.lock:
            self._inbox.records.append(record)
        self._kick.set()

    def _peer_gone(self, name: str) -> None:
        with self._inbox.lock:
            self._inbox.gone.append(name)
        self._kick.set()

    def _step(self) -> bool:
        self._drain_inbox()
        self._run_due_jobs()
        self._check_passive()
        return False

    def _pause(self, busy: bool) -> None:
        self._kick.wait(timeout=0.02)
        self._kick.clear()

    def _drain_inbox(self) -> None:
        with self._inbox.lock:
            records, self._inbox.records = self._inbox.records, []
            gone, self._inbox.gone = self._inbox.gone, []
        for record in records:
            self._on_record(record)
        for name in gone:
            with self._jobs_lock:
                waits = [w for w in self._passive.values() if w.hint.agent == name]
            for wait in waits:
                # The peer's thread has exited: nothing of it can touch our memory any more.
                wait.attempt.conclude(Failed(f"peer {name!r} left before completing", wait.view.row_masks()))
                self._end_passive(wait)

    def _on_record(self, record: CompletionRecord) -> None:
        if record.status is RecordStatus.CANCEL_REQUEST:
            with self._jobs_lock:
                jobs = [j for j in self._active
                        if j.hint.transfer_id == record.transfer_id and j.hint.agent == record.sender]
                if not jobs:  # nothing of ours touches the peer's rows: refuse to start later, and say so
                    self._revoke(record)
            for job in jobs:
                job.cancelled_by_peer = True
                job.attempt.cancel()
            if not jobs:
                self._fabric.deliver(record.sender, self._withdrawn(record))
            return
        with self._jobs_lock:
            wait = self._passive.get(record.transfer_id)
            if wait is None:
                self._stash(record)
                return
        if record.sender != wait.hint.agent or record.request != wait.view.request:
            return  # not from the peer this transfer was described to: ignore it
        # Concluded already: we gave up earlier, and the peer now confirms it stopped.
        fetching = self.mode is TransferMode.PUSH  # a passive wait fetches in push mode
        conclude_from_record(wait.attempt, wait.view, record,
                             self.integrity.record_check(wait.view, wait.transform) if fetching else None)
        self._end_passive(wait)

    def _end_passive(self, wait: _Passive) -> None:
        with self._jobs_lock:
            self._passive.pop(wait.own_id, None)
        self._own.retire(wait.own_id)
        wait.attempt.mark_quiesced()

    def _check_passive(self) -> None:
        now = time.monotonic()
        with self._jobs_lock:
            waits = list(self._passive.values())
        for wait in waits:
            reason = stop_reason(wait.attempt, wait.view.row_masks, now, wait.deadline, self.deadline_s,
                                 wait.hint.agent)
            if reason and not wait.told_peer:
                wait.told_peer = True
                # Stays unquiesced until the peer confirms that it stopped writing.
                if not self._fabric.deliver(wait.hint.agent, self._stop_request(wait.own_id, wait.view.request,
                                                                                 reason)):
                    self._end_passive(wait)

    def _run_due_jobs(self) -> None:
        now = time.monotonic()
        with self._jobs_lock:
            due = [j for j in self._active if j.not_before <= now or j.attempt.cancel_requested]
        for job in due:
            self._run_active(job)
            with self._jobs_lock:
                self._active.remove(job)
        with self._jobs_lock:
            if self._active:
                wait = min(j.not_before for j in self._active) - time.monotonic()
                if wait <= 0:
                    self._kick.set()

    def _run_active(self, job: _Active) -> None:
        if job.transform is not None:
            self._run_transform(job, job.transform)
            return
        local_masks = job.view.row_masks()
        peer_masks = [np.zeros(len(g), dtype=np.bool_) for g in job.hint.groups]
        peer_index = {g.layer_group: i for i, g in enumerate(job.hint.groups)}
        failure: str | None = None
        total = sum(m.local_rows.size for m in job.matches)
        budget = total if job.fail_after_rows is None else min(total, job.fail_after_rows)
        if budget < total:
            failure = f"injected fault after {budget} rows"
        moved = [0] * len(job.matches)
        for gi, match in enumerate(job.matches):
            if budget <= 0 or job.attempt.cancel_requested or match.peer is None:
                continue
            if not self._fabric.alive(job.hint.agent):
                failure = f"peer {job.hint.agent!r} is gone"
                break
            n = min(budget, match.local_rows.size)
            budget -= n
            local, peer = match.local_slots[:n], match.peer_slots[:n]
            if job.writes_peer:
                done = self._copy_runs(job, match.local.region.address, match.peer.address,
                                       match.local.region.slot_bytes, local, peer)
            else:
                done = self._copy_runs(job, match.peer.address, match.local.region.address,
                                       match.local.region.slot_bytes, peer, local)
            moved[gi] = done
            local_masks[gi][match.local_rows[:done]] = True
            peer_masks[peer_index[match.peer.layer_group]][match.peer_rows[:done]] = True
        digests = None
        if self.integrity.applies(job.view):
            if job.writes_peer:
                digests = sent_digests(job.matches, job.hint, moved)
            else:  # pull: our rows are the destination, the publisher's hint has the digests
                bad = self.integrity.check(job.view, local_masks, expected_from_hint(job.matches, job.hint))
                if bad is not None:
                    peer_masks_from_local(job.matches, job.hint, local_masks, peer_masks)
                    failure = bad if failure is None else f"{failure}; {bad}"
        self._finish(job, failure, local_masks, peer_masks, digests)

    def _run_transform(self, job: _Active, transform: Oriented) -> None:
        """Copy the plan's runs a block-sized batch at a time (a cancel stops between
        batches); ``fail_after_rows`` counts runs here."""
        plan = transform.plan
        budget = plan.runs if job.fail_after_rows is None else min(plan.runs, job.fail_after_rows)
        failure = f"injected fault after {budget} runs" if budget < plan.runs else None
        step = max(1, plan.runs // 8)
        done = 0
        while done < budget and not job.attempt.cancel_requested:
            if not self._fabric.alive(job.hint.agent):
                failure = f"peer {job.hint.agent!r} is gone"
                break
            end = min(budget, done + step)
            copy_runs(plan, done, end, memory=MemoryKind.HOST)
            done = end
        local_masks, peer_masks = transform.masks(done)
        # A push publisher digests the destination rows from the source segments it copied;
        # a pull between geometries carries none (integrity.py says why).
        digests = ([geometry_digests(transform, done * plan.planes)]
                   if job.writes_peer and self.integrity.applies_geometry(job.view) else None)
        self._finish(job, failure, local_masks, peer_masks, digests)

    def _finish(self, job: _Active, failure: str | None, local_masks: list, peer_masks: list,
                digests: list | None = None) -> None:
        outcome: Failed | Cancelled | Delivered
        if failure is not None:
            status, outcome = RecordStatus.FAILED, Failed(failure, local_masks)
        elif job.attempt.cancel_requested:
            status, outcome = RecordStatus.CANCELLED, Cancelled(job.cancelled_by_peer, local_masks)
        else:
            status, outcome = RecordStatus.DELIVERED, Delivered(tuple(local_masks))
        # The passive end learns what is in place on its side; then ours concludes.
        record = CompletionRecord(job.hint.transfer_id, self.name, job.view.request, status,
                                  peer_masks, failure or "", digests or ())
        self._fabric.deliver(job.hint.agent, record)
        job.attempt.conclude(outcome)
        job.attempt.mark_quiesced()

    @staticmethod
    def _copy_runs(job: _Active, src_base: int, dst_base: int, row_bytes: int,
                   src: np.ndarray, dst: np.ndarray) -> int:
        """Copy row runs in order; stop between runs on cancel. Returns rows copied."""
        src_start, dst_start, lengths = coalesce(src, dst)
        done = 0
        for s, d, n in zip(src_start.tolist(), dst_start.tolist(), lengths.tolist()):
            if job.attempt.cancel_requested:
                break
            ctypes.memmove(dst_base + d * row_bytes, src_base + s * row_bytes, n * row_bytes)
            done += n
        return done

