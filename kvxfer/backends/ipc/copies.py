"""The row copies an IpcBackend's active end queues on its CUDA stream, and their events.

``CopyQueue`` owns the stream, the pool of completion events, the mappings of peers'
allocations and doorbell rings (``mappings``), and the jobs in flight in launch order.
The owner thread plans and queues a job's kernels (``launch``, under ``launch_lock``; a job
between two engine geometries is one layout-transform kernel, queued by ``geometry``);
the progress thread polls the oldest job's event (``next_finished``) and gives its
mappings and event back (``retire``). What a finished job tells the peer is the backend's.
"""

from __future__ import annotations

import collections
import logging
import threading
from types import ModuleType

import numpy as np

from kvxfer.backends.common.matching import GroupMatch, proven_mask
from kvxfer.backends.ipc.doorbells import BELL_WORDS, EXTRA_BELL, BellOpener, bell_export, bell_value, parse_bell
from kvxfer.backends.ipc.frames import CompletionFrames
from kvxfer.backends.ipc.geometry import queue_transform
from kvxfer.backends.ipc.jobs import ActiveJob
from kvxfer.backends.ipc.mappings import EXTRA_PREFIX, Export, Mappings
from kvxfer.backends.ipc.rowcheck import CheckPool, PickFn, arm, kernel_args, verdict
from kvxfer.contract import Hint, InvalidSubmission, MemoryKind, constant_mask

log = logging.getLogger(__name__)

# One kernel: (view group, its match, rows copied, (source base, slots), (destination base, slots)).
Launch = tuple[int, GroupMatch, int, tuple, tuple]


class CopyQueue:
    """Row-copy kernels on one stream of ``device``, through ``native`` (kvxfer._native, or
    its emulation); ``name`` is the backend's, for logs."""

    def __init__(self, native: ModuleType, device: int, stream: int, name: str, frames: CompletionFrames,
                 pick: PickFn | None = None) -> None:
        self.native = native
        self.checks = CheckPool(native, device)  # the row check's verdict bytes (rowcheck)
        self._pick = pick  # the fault hook: rows the kernel damages where they land, before its check
        self.device = device
        self.stream = stream
        self.name = name
        self._frames = frames  # a doorbell stores the job's done-token
        self.launch_lock = threading.Lock()  # launches enter the stream and in_flight in one order
        self.map_lock = threading.Lock()  # mappings: acquired at launch, released by the progress thread
        self.in_flight: collections.deque[ActiveJob] = collections.deque()
        self.gone: set[bytes] = set()  # peer endpoints seen gone (written by the progress thread)
        self.mappings = Mappings(native, device)
        self._events: collections.deque[int] = collections.deque()
        self._export_cache: dict[bytes, Export] = {}  # packed export -> Export (hints repeat them)
        self._bell_opener = BellOpener(native, device)
        self._bell_paths: dict[bytes, str] = {}  # EXTRA_BELL past its slot -> the ring's path, checked
        self._bad_bells: set[str] = set()  # peers' rings that could not be opened: sockets only

    # --- what a peer's hint offers (the owner thread, before anything is claimed) -------------
    def peer_exports(self, hint: Hint, matches: list[GroupMatch]) -> dict[str, Export]:
        exports: dict[str, Export] = {}
        for match in matches:
            peer = match.peer
            if peer is None or match.local_rows.size == 0:
                continue
            if peer.memory_kind is not MemoryKind.DEVICE:
                raise InvalidSubmission(f"peer group {peer.layer_group!r} is {peer.memory_kind.name} memory")
            exports[peer.region] = self.export_of(hint, peer.region, peer.address,
                                                  peer.slot_bytes * peer.region_slots)
        return exports

    def export_of(self, hint: Hint, region: str, address: int, nbytes: int) -> Export:
        """The allocation the peer exported for ``region`` (``[address, +nbytes)`` in the
        peer's process), checked to hold it; InvalidSubmission when the hint lacks it."""
        data = hint.extra(EXTRA_PREFIX + region)
        if data is None:
            raise InvalidSubmission(f"the peer's hint has no IPC handle for region {region!r}")
        export = self._export_cache.get(data)
        if export is None:
            try:
                export = Export.unpack(data, region)
            except ValueError as exc:
                raise InvalidSubmission(str(exc)) from exc
            if len(self._export_cache) >= 4096:
                self._export_cache.clear()
            self._export_cache[data] = export
        offset = address - export.alloc_base
        if offset < 0 or offset + nbytes > export.alloc_size:
            raise InvalidSubmission(f"peer region {region!r} lies outside the allocation it exported")
        return export

    def peer_bell(self, hint: Hint) -> tuple[str, int] | None:
        data = hint.extra(EXTRA_BELL)
        if data is None:
            return None
        path = self._bell_paths.get(data[4:])  # a peer's hints repeat its ring's path
        if path is not None:
            slot = int.from_bytes(data[:4], "little")
            if slot < BELL_WORDS:
                return path, slot
        try:
            path, slot = parse_bell(data)
        except ValueError as exc:
            raise InvalidSubmission(str(exc)) from exc
        if len(self._bell_paths) >= 1024:
            self._bell_paths.clear()
        self._bell_paths[data[4:]] = path
        return path, slot

    # --- queueing (the owner thread, under launch_lock) ---------------------------------
    def launch(self, job: ActiveJob, fail_after_rows: int | None) -> None:
        """Queue the job's kernels and its event, and the job after the jobs in flight. Every
        outcome is left to the progress thread, which finishes jobs in launch order. The last
        kernel, the doorbell store and the event go in one native call (cuda_copy_rows_then):
        on a small transfer each call through the binding, and the Python between two calls,
        costs microseconds."""
        if job.transform is not None:
            queue_transform(self, job, fail_after_rows)  # engine geometries: one kernel (geometry)
        else:
            self._queue(job, fail_after_rows)
        self.in_flight.append(job)

    def _queue(self, job: ActiveJob, fail_after_rows: int | None) -> None:
        copied: list[tuple[int, GroupMatch, int]] = []  # (group, match, rows) whose kernel is queued
        plan, rows = self._plan(job, fail_after_rows)
        if not plan:
            self._set_masks(job, copied)
            return
        event, event_error = self.take_event()
        bell_ptr, bell_value = self.bell_target(job, rows)
        recorded = False
        if job.checked:
            job.check = self.checks.take(rows)
            job.check_launches = arm(job.check, plan, job.writes_peer, self._pick)
        for k, (gi, match, n, src, dst) in enumerate(plan):
            row = match.local.region.slot_bytes
            check = kernel_args(job.check, job.check_launches[k] if job.check else None, self._pick is not None)
            try:
                # Slot bounds were checked already: ours by check_view, the peer's by HintGroup
                # (and its region against the exported allocation), so the kernel is told -1.
                if k == len(plan) - 1 and event:
                    bell_error, error = self.native.cuda_copy_rows_then(
                        src[0], row, src[1], dst[0], row, dst[1], n, row, self.stream, self.device,
                        bell_ptr, bell_value, event, **check)
                    if bell_error:
                        log.info("IPC backend %s: doorbell store failed (%s); the record still goes", self.name,
                                 bell_error)
                    recorded, event_error = not error, error or None
                else:
                    self.native.cuda_copy_rows(src[0], row, src[1], dst[0], row, dst[1], n, row, self.stream,
                                               self.device, -1, -1, **check)
            except (self.native.CopyError, MemoryError, RuntimeError) as exc:
                # A large copy goes in chunks: some may be queued already. The job waits for
                # an event like any other before anything is reported (their rows stay False).
                job.failure = f"row copy launch failed: {exc}"
                job.launched = True
                break
            job.nbytes += n * row
            job.launched = True
            copied.append((gi, match, n))
        if job.check is not None:
            job.check_launches = job.check_launches[:len(copied)]  # the kernels that were queued
        if not self.seal(job, event, recorded, event_error):
            copied = []
        self._set_masks(job, copied)

    def seal(self, job: ActiveJob, event: int, recorded: bool, event_error: str | None) -> bool:
        """After a job's kernels: its event recorded (unless the last launch did), or, when
        none can be, the whole stream waited for (job.failure says why). False when the
        stream failed: then nothing says which of the job's bytes landed."""
        if event and not recorded and event_error is None:
            try:
                self.native.event_record(event, self.stream)
                recorded = True
            except self.native.CopyError as exc:
                event_error = str(exc)
        if recorded:
            job.event = event
            return True
        # Without an event we cannot tell when the kernels end: wait for the whole stream.
        if event:
            self.drop_event(event)
        job.failure = f"cannot record a completion event: {event_error}"
        try:
            self.native.stream_synchronize(self.stream)
        except self.native.CopyError as sync_exc:
            job.failure = f"the copy stream failed: {sync_exc}"
            return False
        return True

    def _plan(self, job: ActiveJob, fail_after_rows: int | None) -> tuple[list[Launch], int]:
        """(group, match, rows, src, dst) of each kernel to queue, with the peer's mappings
        acquired (held by the job), and the rows they copy; job.failure says why fewer rows
        than asked will move."""
        plan: list[Launch] = []
        if job.hint.endpoint in self.gone:
            job.failure = f"peer {job.hint.agent!r} is gone"
            return plan, 0
        total = sum(m.local_rows.size for m in job.matches if m.peer is not None)
        budget = total if fail_after_rows is None else min(total, fail_after_rows)
        if budget < total:
            job.failure = f"injected fault after {budget} rows"
        planned = 0
        for gi, match in enumerate(job.matches):
            peer = match.peer
            if budget <= 0 or peer is None or match.local_rows.size == 0:
                continue
            n = min(budget, match.local_rows.size)
            try:
                with self.map_lock:
                    mapping = self.mappings.acquire(job.hint.endpoint, job.exports[peer.region])
            except (self.native.CopyError, RuntimeError) as exc:
                job.failure = f"cannot map the peer's region {peer.region!r}: {exc}"
                break
            job.mappings.append(mapping)
            peer_base = mapping.translate(peer.address, match.local.region.slot_bytes * peer.region_slots)
            if peer_base is None:
                job.failure = f"peer region {peer.region!r} lies outside its mapped allocation"
                break
            local = match.local.region
            local_slots, peer_slots = match.local_slots, match.peer_slots
            if n < local_slots.size:  # a fault injected part way
                local_slots, peer_slots = local_slots[:n], peer_slots[:n]
            if job.writes_peer:
                src, dst = (local.address, local_slots), (peer_base, peer_slots)
            else:
                src, dst = (peer_base, peer_slots), (local.address, local_slots)
            plan.append((gi, match, n, src, dst))
            planned += n
            budget -= n
        return plan, planned

    def take_event(self) -> tuple[int, str | None]:
        """A completion event (recycled, or new) and None; or 0 and why none could be made."""
        try:
            return (self._events.pop() if self._events else self.native.event_create(self.device)), None
        except self.native.CopyError as exc:
            return 0, str(exc)

    def drop_event(self, event: int) -> None:
        """Destroy an event that must not be reused. One the driver refuses to destroy (its
        context is broken) is lost either way: logged, and shutdown goes on giving back the rest."""
        try:
            self.native.event_destroy(event)
        except self.native.CopyError as exc:
            log.warning("IPC backend %s: cannot destroy a completion event: %s", self.name, exc)

    def bell_target(self, job: ActiveJob, rows: int) -> tuple[int, int]:
        """(address, value) of the store into the passive end's doorbell word, queued after the
        job's kernels; (0, 0) for none. Only when every row of its hint is being copied (the
        doorbell means DELIVERED, all rows). A ring that cannot be opened costs only the
        doorbell: the record still goes."""
        if job.bell is None or job.failure is not None or rows != sum(map(len, job.hint.groups)):
            return 0, 0
        token = self._frames.job_token(job)
        path, slot = job.bell
        if token is None or path in self._bad_bells:
            return 0, 0
        try:
            with self.map_lock:
                ring = self.mappings.acquire(job.hint.endpoint, bell_export(path), self._bell_opener)
        except (self.native.CopyError, OSError, RuntimeError) as exc:
            log.info("IPC backend %s: peer %r's doorbell ring is unusable (%s); sockets only", self.name,
                     job.hint.agent, exc)
            if len(self._bad_bells) >= 1024:
                self._bad_bells.clear()
            self._bad_bells.add(path)
            return 0, 0
        job.mappings.append(ring)
        return ring.base + 8 * slot, bell_value(token)

    @staticmethod
    def _set_masks(job: ActiveJob, copied: list[tuple[int, GroupMatch, int]]) -> None:
        """The rows whose kernels are queued, set after queueing them so that this overlaps
        the copy; reported only after the event says the kernels finished. Read-only, so that
        outcomes and records take them without copying."""
        local: list[np.ndarray | None] = [None] * len(job.view.groups)
        peer: list[np.ndarray | None] = [None] * len(job.hint.groups)
        if copied:
            peer_index = {g.layer_group: i for i, g in enumerate(job.hint.groups)}
            for gi, match, n in copied:
                assert match.peer is not None
                local[gi] = proven_mask(len(match.local), [match.local_rows[:n]])
                pi = peer_index[match.peer.layer_group]
                peer[pi] = proven_mask(len(job.hint.groups[pi]), [match.peer_rows[:n]])
        job.local_masks = [m if m is not None else constant_mask(len(g), False) for m, g in zip(local, job.view.groups)]
        job.peer_masks = [m if m is not None else constant_mask(len(g), False) for m, g in zip(peer, job.hint.groups)]

    # --- waiting for copies ---------------------------------------------------------------
    def spin_send(self, job: ActiveJob, spin_us: int, fd: int, data: bytes) -> int:
        """Wait up to ``spin_us`` for the job's event, then write ``data`` to ``fd`` in the same
        native call; the bytes written (0: the copy had not ended)."""
        done, sent = self.native.event_spin_send(job.event, spin_us, fd, data)
        return int(sent) if done else 0

    def spin_check_send(self, job: ActiveJob, spin_us: int, fd: int, data: bytes) -> int:
        """``spin_send`` for a checked job: in the same native call, the frame goes only once the
        copy ended and every row checked out (else 0: the progress thread reports the rows that failed)."""
        if job.check is None:
            return 0
        rows = sum(launch.n for launch in job.check_launches)
        done, sent = self.native.event_spin_send(job.event, spin_us, fd, data, job.check.host, rows)
        return int(sent) if done else 0

    def apply_check(self, job: ActiveJob) -> int:
        """Once the job's kernels ended: rows that failed their check False in both ends' masks and
        the job failed naming them; the rows that failed."""
        if job.check is None:
            return 0
        peer_index = {g.layer_group: i for i, g in enumerate(job.hint.groups)}
        failed, reason = verdict(job.check, job.check_launches, job.local_masks, job.peer_masks, peer_index)
        if reason is not None:
            job.failure = reason if job.failure is None else f"{job.failure}; {reason}"
        return failed

    def watch_head(self, spin_us: int) -> None:
        """Wait up to ``spin_us`` for the oldest copy's event, spinning natively with the GIL
        released: a full pass of the loop (socket poll, waits, deadlines) costs tens of
        microseconds of Python on a busy host, which would add as much to every small
        transfer, and a Python spin would take the GIL from an owner thread that is
        submitting the next request meanwhile."""
        job = self.in_flight[0]
        if not job.event:
            return
        try:
            self.native.event_spin_send(job.event, spin_us, -1, b"")
        except self.native.CopyError:
            pass  # next_finished queries again and reports it

    def next_finished(self) -> tuple[ActiveJob, str | None] | None:
        """The oldest job, taken off the queue, if its copy has ended, with the device error it
        ended with; None while it runs. One stream: events complete in queue order."""
        if not self.in_flight:
            return None
        job = self.in_flight[0]
        error = None
        if job.event:
            try:
                if not self.native.event_query(job.event):
                    return None
            except self.native.CopyError as exc:
                error = f"the row copy failed on the device: {exc}"
        self.in_flight.popleft()
        return job, error

    def retire(self, job: ActiveJob, device_error: str | None) -> None:
        """A finished job gives back its mappings, its check bytes, and its event to the pool."""
        with self.map_lock:
            for mapping in job.mappings:
                self.mappings.release(mapping)
        job.mappings.clear()
        if job.check is not None and device_error is None:  # after a device fault, never reused (CheckPool)
            self.checks.give(job.check)
        job.check = None
        if job.event:
            if device_error is None:
                self._events.append(job.event)
            else:
                # Nothing says what state a device error left it in: reused, an event that still
                # reads complete would report the next job's rows delivered before its kernel ran.
                self.drop_event(job.event)
            job.event = 0

    def peer_gone(self, peer: bytes) -> None:
        with self.launch_lock:  # no launch into its mappings from here on
            self.gone.add(peer)
        with self.map_lock:
            self.mappings.peer_gone(peer)

    # --- shutdown (once the progress thread has exited) -----------------------------------
    def drain(self) -> bool:
        """Wait for every kernel queued; False if the stream failed (logged)."""
        # A submission that passed the closed check on another thread just before shutdown
        # finishes its launch first, so its job is in in_flight and its event in hand here;
        # none starts after (the backend is closed). Not held below: finishing a job may find
        # its peer gone, and peer_gone takes this lock.
        with self.launch_lock:
            pass
        try:
            self.native.stream_synchronize(self.stream)
            return True
        except self.native.CopyError as exc:
            log.error("IPC backend %s: stream failed at shutdown: %s", self.name, exc)
            return False

    def close_mappings(self) -> None:
        """Unmap every peer allocation and ring, unregister the check bytes, and destroy the pooled events."""
        self.checks.close()
        with self.map_lock:
            still_mapped = self.mappings.close_all()
        if still_mapped:
            log.error("IPC backend %s: %d mappings still in use at shutdown, left open", self.name, still_mapped)
        while self._events:
            self.drop_event(self._events.pop())

    def destroy_stream(self) -> None:
        self.native.stream_destroy(self.stream)
