"""``BlobBackend``: the contract's publish and fetch over a blob store (``BlobDriver``).

    backend = BlobBackend(MemoryDriver(store))            # or MooncakeDriver(...)
    backend.register(pool_regions)                        # host memory; the driver registers it too
    hint = backend.describe(view)                         # the rows' store keys (see names.py)
    attempt = backend.publish(view, hint)                 # put each row under its key
    attempt = backend.fetch(view, hint)                   # get each row: a missing key is False

A store has no peer that moves bytes: this backend moves them itself, on one thread, in
batches of ``batch_rows`` keys, round robin over its submissions so that one large request
does not hold the others back. Per row: True only once the driver said OK for its key.
A submission that cannot succeed whole concludes Failed with the rows that did arrive
marked, naming what happened to the others (missing, failed, store full). Cancellation
and the deadline act between two batches; an attempt quiesces once no batch of it is in
the driver (drivers return only when they are done with the memory).

No driver stops the thread (guard.py): a call that raises, StoreError or anything else, or
answers anything but one status per key, fails that batch's rows, naming it, and the thread
serves the next batch. ``shutdown()`` returns every attempt not proven quiesced, the one
whose batch is in the driver included, and closes the driver once no call of it is running.

``fetch_wait_s``: how long a fetch waits for keys that are not there yet (a publisher still
putting them), checking with ``exists``; 0 (the default) takes what is there now, for a
lookup before asking a prefill worker. Submissions are refused (SubmissionRejected) while
``max_queued_rows`` rows wait: back-pressure instead of unbounded memory.

Integrity (``integrity=True``, the default): a put stores each row's digest under a second key
before the row, a get checks every landed row against it (``digests.py``); a row whose digest
differs or is missing is False and the fetch Failed, its reason starting "digest mismatch".
``corrupt_landed``: the test hook that changes landed rows before that check.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from kvxfer.backends.blob import guard
from kvxfer.backends.blob.digests import StoreDigests, batch_digests, corrupt_batch
from kvxfer.backends.blob.driver import BlobDriver, KeyStatus, Span
from kvxfer.backends.blob.names import Namer, hint_names, names_extras, request_names
from kvxfer.backends.common.attempt import TrackedAttempt
from kvxfer.backends.common.integrity import MISMATCH, CorruptFn, RowCheck
from kvxfer.backends.common.matching import check_submission, match_rows
from kvxfer.backends.common.regions import RegionTable
from kvxfer.backends.common.transfers import DEFAULT_HINT_TTL_S, OwnTransfers, hint_groups
from kvxfer.contract import (
    Attempt,
    Backend,
    BoolArray,
    Cancelled,
    Capabilities,
    Delivered,
    Failed,
    Hint,
    InvalidSubmission,
    MemoryKind,
    Peer,
    SlotRegion,
    SubmissionRejected,
    TransferMode,
    View,
    WakeFn,
)

log = logging.getLogger(__name__)

BACKEND_KIND = "blob"
IDLE_S = 0.005  # how often a fetch waiting for keys checks again


@dataclass(eq=False)
class _Job:
    """One submission's rows, flattened over its groups: row i goes under ``keys[i]``, from or
    into ``addresses[i]`` (``sizes[i]`` bytes), and its mask entry is ``masks[group[i]][row[i]]``."""

    put: bool
    attempt: TrackedAttempt
    view: View
    checked: bool  # digests stored (put) or checked (get)
    keys: list[bytes]
    addresses: np.ndarray
    sizes: np.ndarray
    group: np.ndarray
    row: np.ndarray
    slots: np.ndarray
    masks: list[BoolArray]
    deadline: float
    wait_until: float
    done: int = 0
    statuses: Counter[KeyStatus] = field(default_factory=Counter)
    first_bad: str = ""
    mismatched: int = 0  # rows that failed their digest check, or had none
    first_mismatch: str = ""

    @property
    def left(self) -> int:
        return len(self.keys) - self.done


class BlobBackend(Backend):
    """See the module docstring. The backend owns ``driver``: ``shutdown`` closes it."""

    def __init__(self, driver: BlobDriver, *, name: str = "blob", mode: TransferMode = TransferMode.PUSH,
                 namer: Namer = request_names, batch_rows: int = 256, max_queued_rows: int = 1 << 16,
                 timeout_s: float = 30.0, fetch_wait_s: float = 0.0, hint_ttl_s: float = DEFAULT_HINT_TTL_S,
                 memory_kinds: frozenset[MemoryKind] = frozenset({MemoryKind.HOST}), integrity: bool = True,
                 corrupt_landed: CorruptFn | None = None) -> None:
        if batch_rows < 1 or max_queued_rows < 1:
            raise ValueError(f"batch_rows and max_queued_rows must be >= 1, got {batch_rows}, {max_queued_rows}")
        if not 0 < timeout_s < float("inf") or not 0 <= fetch_wait_s < timeout_s:
            raise ValueError(f"timeout_s must be positive and fetch_wait_s in [0, timeout_s), got {timeout_s}, "
                             f"{fetch_wait_s}")
        self.driver = driver
        self.name = name
        self.mode = mode
        self._namer = namer
        self.batch_rows = batch_rows
        self.max_queued_rows = max_queued_rows
        self.timeout_s = timeout_s
        self.fetch_wait_s = fetch_wait_s
        self._kinds = memory_kinds
        self._regions = RegionTable(memory_kinds)
        self._own = OwnTransfers(name, hint_ttl_s)
        self._lock = threading.Condition()
        self._jobs: deque[_Job] = deque()
        self._running: _Job | None = None  # the job the thread is stepping: maybe in the driver now
        self._queued_rows = 0
        self._closed = False
        self._broken = ""  # why the thread ended before shutdown (then nothing is taken)
        # Who closes the driver: shutdown, once the thread has ended; or the thread as it ends,
        # when shutdown found it still in a driver call (never both, never during a call).
        self._thread_ended = False
        self._close_pending = False
        self._driver_closed = False
        self.bytes_moved = 0  # by this backend's finished batches (put and get), for the bench
        self.integrity = RowCheck(integrity, corrupt_landed)
        self._scratch_registered = False
        self._digests = StoreDigests(batch_rows) if integrity else None
        self._thread = threading.Thread(target=self._run, name=f"kvxfer-blob-{name}", daemon=True)
        self._thread.start()

    # --- the contract's calls ----------------------------------------------------------------
    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(memory_kinds=self._kinds, modes=frozenset({self.mode}),
                            max_rows_per_submission=self.max_queued_rows)

    @property
    def peer(self) -> Peer:
        return self._own.peer

    def register(self, regions: Iterable[SlotRegion]) -> tuple[SlotRegion, ...]:
        self._refuse_if_closed()
        taken, skipped = self._regions.reachable(regions)
        added = self._regions.add(taken)
        done: list[SlotRegion] = []
        try:
            if self._digests is not None and added and not self._scratch_registered:
                self.driver.register(self._digests.span)
                self._scratch_registered = True
            for region in added:
                self.driver.register(_span(region))
                done.append(region)
        except Exception as exc:
            for region in done:
                try:
                    self.driver.unregister(_span(region))
                except Exception as undo:
                    log.warning("blob backend %s: unregistering from store %r failed: %s", self.name,
                                self.driver.name, guard.named(undo))
            self._regions = _without(self._regions, self._kinds, added)
            raise InvalidSubmission(f"store {self.driver.name!r} refused to register {len(added)} regions: "
                                    f"{guard.named(exc)}") from None
        return skipped

    def describe(self, view: View, audience: Peer | None = None) -> Hint:
        self._refuse_if_closed()
        self._check_view(view, fetching=True)  # the hint may serve a fetch: the stricter checks
        extras = names_extras(view, self._namer(view))
        return Hint(backend=BACKEND_KIND, mode=self.mode, agent=self.peer.agent, request=view.request,
                    transfer_id=self._own.mint(view), layout=view.layout, groups=hint_groups(view), extras=extras,
                    run=self.peer.run, audience=audience, expires_ms=self._own.expiry())

    def publish(self, view: View, hint: Hint, wake: WakeFn | None = None) -> Attempt:
        return self._submit(view, hint, wake, put=True)

    def fetch(self, view: View, hint: Hint, wake: WakeFn | None = None) -> Attempt:
        return self._submit(view, hint, wake, put=False)

    def withdraw(self, hint: Hint) -> bool:
        return self._own.withdraw(hint)

    def shutdown(self) -> frozenset[Attempt]:
        """Submissions still queued end Cancelled here (no call of theirs is in the driver);
        the one the thread is running is cancelled and ends once its driver call returns,
        waited for up to ``timeout_s``. Returns what is not quiesced then: that one, if its
        call has not returned. The driver is closed once, never during a call: here when the
        thread has ended, else by the thread as it ends. Idempotent: a later call returns
        what is still not quiesced."""
        with self._lock:
            self._closed = True
            queued = list(self._jobs)
            self._jobs.clear()
            self._queued_rows -= sum(len(job.keys) for job in queued)
            running = self._running
            self._lock.notify_all()
        for job in queued:
            self._end(job, Cancelled(False, job.masks))
        if running is not None:
            running.attempt.cancel()
        self._thread.join(self.timeout_s)
        with self._lock:
            close = self._thread_ended and not self._driver_closed
            self._driver_closed |= close
            self._close_pending = not self._thread_ended
            left = frozenset(job.attempt for job in (*queued, running, self._running)
                             if job is not None and not job.attempt.quiesced())
        if close:
            guard.release(self.driver, self._spans(), self.name)
        return left

    def _spans(self) -> list[Span]:
        extra = [self._digests.span] if self._digests is not None and self._scratch_registered else []
        return [_span(r) for r in self._regions] + extra

    # --- submission --------------------------------------------------------------------------
    def _refuse_if_closed(self) -> None:
        if self._closed:
            raise SubmissionRejected(f"blob backend {self.name!r} is shut down")
        if self._broken:
            raise SubmissionRejected(f"blob backend {self.name!r} moves no more rows: {self._broken}")

    def _check_view(self, view: View, *, fetching: bool) -> None:
        if not isinstance(view, View):
            raise InvalidSubmission(f"expected a View, got {type(view).__name__}")
        if view.geometry is not None:
            raise InvalidSubmission(f"the blob backend stores pool rows only; request {view.request!r} lends an "
                                    "engine's KV (a geometry)")
        self._regions.check_view(view, for_fetch=fetching)

    def _submit(self, view: View, hint: Hint, wake: WakeFn | None, *, put: bool) -> Attempt:
        self._refuse_if_closed()
        self._check_view(view, fetching=not put)
        check_submission(view, hint, self._regions, BACKEND_KIND, self.mode, fetching=not put)
        self._own.check_for_us(hint)
        self._own.check_usable(hint)
        attempt = TrackedAttempt(wake, label=f"{'put' if put else 'get'} {view.request}")
        job = self._job(view, hint, attempt, put)
        with self._lock:
            self._refuse_if_closed()
            if self._queued_rows + len(job.keys) > self.max_queued_rows:
                raise SubmissionRejected(f"blob backend {self.name!r}: {self._queued_rows} rows are queued; "
                                         f"{len(job.keys)} more would pass max_queued_rows={self.max_queued_rows}")
            self._own.use(hint, attempt)
            self._jobs.append(job)
            self._queued_rows += len(job.keys)
            self._lock.notify()
        return attempt

    def _job(self, view: View, hint: Hint, attempt: TrackedAttempt, put: bool) -> _Job:
        """The rows with a counterpart in the hint, under the hint's names (InvalidSubmission
        if it names none); rows without one stay False."""
        keys: list[bytes] = []
        addresses, sizes, groups, rows, slots = [], [], [], [], []
        for i, match in enumerate(match_rows(view, hint)):
            if match.peer is None or match.local_rows.size == 0:
                continue
            names = hint_names(hint, match.peer.layer_group, len(match.peer))
            keys += [names[r] for r in match.peer_rows.tolist()]
            region = match.local.region
            addresses.append(region.address + match.local_slots * region.slot_bytes)
            sizes.append(np.full(match.local_rows.size, region.slot_bytes, dtype=np.int64))
            groups.append(np.full(match.local_rows.size, i, dtype=np.int64))
            rows.append(match.local_rows)
            slots.append(match.local_slots)
        now = time.monotonic()
        wait = 0.0 if put else self.fetch_wait_s
        return _Job(put, attempt, view, self._digests is not None and self.integrity.applies(view), keys,
                    _cat(addresses), _cat(sizes), _cat(groups), _cat(rows), _cat(slots), view.row_masks(False),
                    now + self.timeout_s, now + wait)

    # --- the backend's thread ----------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._serve()
        except BaseException as exc:  # what _serve lets through (a driver's SystemExit, say): no call is running
            log.exception("blob backend %s: its thread ended", self.name)
            self._fail_all(f"its thread ended on {guard.named(exc)}")
        finally:
            with self._lock:
                self._thread_ended = True
                close = self._close_pending and not self._driver_closed
                self._driver_closed |= close
            if close:  # shutdown() found this thread in a driver call that has returned since
                guard.release(self.driver, self._spans(), self.name)

    def _serve(self) -> None:
        while True:
            with self._lock:
                while not self._jobs and not self._closed:
                    self._lock.wait()
                if not self._jobs:
                    return
                job = self._running = self._jobs.popleft()
            try:
                finished = self._step(job)
            except Exception as exc:  # not the driver's (guard.py catches those): end the job, serve the next
                log.exception("blob backend %s: %s failed", self.name, job.attempt.label)
                finished = self._end(job, Failed(f"blob backend {self.name!r}: {guard.named(exc)}", job.masks))
            with self._lock:
                self._running = None
                if finished:
                    self._queued_rows -= len(job.keys)
                else:
                    self._jobs.append(job)  # round robin: the next submission's batch goes first
                    if self._closed and not job.attempt.cancel_requested:
                        job.attempt.cancel()

    def _fail_all(self, reason: str) -> None:
        """The thread is ending with submissions left: fail them (none is in the driver) and
        take no more."""
        with self._lock:
            self._broken = reason
            jobs = [*self._jobs, *([self._running] if self._running is not None else [])]
            self._jobs.clear()
            self._running = None
            self._queued_rows = 0
        for job in jobs:
            self._end(job, Failed(f"blob backend {self.name!r}: {reason}", job.masks))

    def _step(self, job: _Job) -> bool:
        """One batch of ``job``, or its conclusion; True once it concluded and quiesced."""
        now = time.monotonic()
        if job.attempt.cancel_requested:
            return self._end(job, Cancelled(False, job.masks))
        if now > job.deadline:
            return self._end(job, Failed(f"store {self.driver.name!r}: deadline of {self.timeout_s:g}s passed with "
                                         f"{job.left} of {len(job.keys)} rows not {'put' if job.put else 'read'}",
                                         job.masks))
        if job.left == 0:
            return self._end(job, self._verdict(job))
        if not job.put and now < job.wait_until and not self._present(job):
            time.sleep(IDLE_S if len(self._jobs) == 0 else 0)
            return False
        self._batch(job)
        return False

    def _present(self, job: _Job) -> bool:
        return guard.present(self.driver, job.keys[job.done:])

    def _batch(self, job: _Job) -> None:
        end = min(job.done + self.batch_rows, len(job.keys))
        keys, addresses, sizes = job.keys[job.done:end], job.addresses[job.done:end], job.sizes[job.done:end]
        digest_ok = None
        if job.checked and job.put:  # read for sending: digests first, so a row found has its digest
            digest_ok, failure = self._put_digests(job, end, keys)
            job.first_bad = job.first_bad or failure
        statuses, failure = guard.move(self.driver, job.put, keys, addresses, sizes)
        job.first_bad = job.first_bad or failure
        said_ok = np.fromiter((s is KeyStatus.OK for s in statuses), dtype=np.bool_, count=len(keys))
        ok = said_ok.copy()
        if job.checked and not job.put:
            digest_ok = self._check_digests(job, end, keys, ok)
        if digest_ok is not None:
            failed = ok & ~digest_ok
            if failed.any():
                ok &= digest_ok
                job.mismatched += int(failed.sum())
                job.first_mismatch = job.first_mismatch or (
                    f"row {int(job.row[job.done + int(np.flatnonzero(failed)[0])])}")
        for g in np.unique(job.group[job.done:end]).tolist():
            sel = job.group[job.done:end] == g
            job.masks[g][job.row[job.done:end][sel]] = ok[sel]
        job.statuses.update(statuses)
        if not job.first_bad and not said_ok.all():
            i = int(np.flatnonzero(~said_ok)[0])
            job.first_bad = f"key {keys[i].hex()} of row {int(job.row[job.done + i])} is {statuses[i].value}"
        self.bytes_moved += int(sizes[ok].sum())
        job.done = end

    def _put_digests(self, job: _Job, end: int, keys: list[bytes]) -> tuple[np.ndarray, str]:
        assert self._digests is not None
        digests = batch_digests(job.view, job.group[job.done:end], job.slots[job.done:end])
        return self._digests.put(self.driver, keys, digests)

    def _check_digests(self, job: _Job, end: int, keys: list[bytes], landed: np.ndarray) -> np.ndarray:
        """Which rows of the batch carry the bytes that were put: landed, with a stored digest
        that their bytes match."""
        assert self._digests is not None
        if not landed.any():
            return landed
        stored, expected, _failure = self._digests.get(self.driver, keys)
        group, slots = job.group[job.done:end][landed], job.slots[job.done:end][landed]
        if self.integrity.corrupt is not None:
            corrupt_batch(self.integrity.corrupt, job.view, group, slots)
        good = np.zeros(len(keys), dtype=np.bool_)
        good[landed] = stored[landed] & (batch_digests(job.view, group, slots) == expected[landed])
        self.integrity.rows_failed += int((landed & ~good).sum())
        return good

    def _verdict(self, job: _Job) -> Delivered | Failed:
        bad = {s: n for s, n in job.statuses.items() if s is not KeyStatus.OK}
        if job.mismatched:
            what = "stored with their digest" if job.put else "landed with the bytes that were put"
            return Failed(f"{MISMATCH}: {job.mismatched} of {len(job.keys)} rows not {what} in store "
                          f"{self.driver.name!r} (first: {job.first_mismatch})", job.masks)
        if not bad:
            return Delivered(tuple(job.masks))
        counts = ", ".join(f"{n} {s.value}" for s, n in sorted(bad.items(), key=lambda kv: kv[0].value))
        return Failed(f"store {self.driver.name!r}: {sum(bad.values())} of {len(job.keys)} rows not "
                      f"{'stored' if job.put else 'read'} ({counts}; first: {job.first_bad})", job.masks)

    def _end(self, job: _Job, outcome: Delivered | Failed | Cancelled) -> bool:
        job.attempt.conclude(outcome)
        job.attempt.mark_quiesced()  # no batch of it is in the driver: every call has returned
        return True


def _span(region: SlotRegion) -> Span:
    return Span(region.address, region.slot_bytes * region.slots)


def _cat(parts: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(parts).astype(np.int64, copy=False) if parts else np.zeros(0, dtype=np.int64)


def _without(table: RegionTable, kinds: frozenset[MemoryKind], drop: list[SlotRegion]) -> RegionTable:
    fresh = RegionTable(kinds)
    fresh.add([r for r in table if r not in drop])
    return fresh
