"""Same-node GPU-to-GPU backend: the peer's pool (or an engine's KV) mapped through CUDA IPC,
one kernel per group (per submission between two engine geometries).

It keeps the protocol every backend keeps (``kvxfer.backends.common.engine``): describe()
mints a transfer id; the active end (push: the publisher; pull: the fetcher) moves the
bytes and then sends a CompletionRecord; the passive end concludes from that record, and
asks the active end to stop (CANCEL_REQUEST) when it is cancelled or times out, staying
unquiesced until the active end confirms. Here:

- describe() carries, in ``Hint.extras``, a CUDA IPC handle for the allocation behind each
  region of the view (``ipc.region.<name>``; for an engine view, each region of its
  geometry) and this node's boot id (``ipc.node``); the ``endpoint`` is this backend's Unix
  socket, and the agent name is that socket's path.
- The active end opens each peer allocation once and caches the mapping (``mappings``),
  then queues one native row-copy kernel per view group on a stream it owns and records a
  CUDA event (``copies``); between two engine geometries, one layout-transform kernel for
  the whole submission, planned before anything is claimed (``geometry``). Its progress
  thread polls the event, and only then are rows True in masks. The kernels are queued
  inside publish()/fetch() itself: a launch is asynchronous and takes microseconds, and
  handing it to the progress thread would add a thread wake-up (tens of microseconds) to
  every small transfer's latency.
- Records travel as ``kvxfer.wire.encode_completion`` frames over Unix sockets
  (``channel``), signed when a key is set. A peer whose socket closes is gone: no new
  copy goes into its mappings, which close once the copies in flight have ended.
- The usual record, DELIVERED with every row of the passive end's hint, travels as 20 bytes
  instead: a done-token that the passive end looks up (``frames``, ``waits``).
- A passive end that busy-polls also names a doorbell word in its hint (``doorbells``):
  the active end queues a store of the transfer's token into it after its kernels, so the
  GPU tells the spinning passive end that every row is in place, before any CPU on the
  active end has looked. The token frame still follows; whichever comes first concludes.

It needs kvxfer._native built with CUDA and a visible GPU; without them construction raises
IpcUnavailable naming why, and the module still imports. ``cuda=kvxfer.testing.host_cuda``
runs the same control path over shared host memory, which is how CI tests it without a GPU.
"""

from __future__ import annotations

import collections
import functools
import logging
import os
import secrets
import socket
import time
from collections.abc import Iterable
from types import ModuleType

import numpy as np

from kvxfer import native
from kvxfer.backends.common.attempt import TrackedAttempt
from kvxfer.backends.common.engine import BackendEngine, ProgressThread, conclude_from_record, stop_reason
from kvxfer.backends.common.integrity import MISMATCH, RowCheck
from kvxfer.backends.common.matching import match_rows
from kvxfer.backends.common.transfers import DEFAULT_HINT_TTL_S
from kvxfer.backends.ipc.channel import Channel, PeerBusy
from kvxfer.backends.ipc.copies import CopyQueue
from kvxfer.backends.ipc.doorbells import EXTRA_BELL, bell_slot, bell_value
from kvxfer.backends.ipc.frames import DONE_PREFIX, TOKEN_FRAME_BYTES, CompletionFrames
from kvxfer.backends.ipc.geometry import export_names, peer_exports, plan_submission
from kvxfer.backends.ipc.jobs import ActiveJob, PassiveWait
from kvxfer.backends.ipc.mappings import EXTRA_PREFIX, Export
from kvxfer.backends.ipc.rowcheck import EXTRA_CHECK, PickFn
from kvxfer.backends.ipc.waits import PassiveWaits
from kvxfer.contract import (
    Cancelled,
    CompletionRecord,
    Delivered,
    Failed,
    Hint,
    InvalidSubmission,
    KvxferError,
    MemoryKind,
    Peer,
    RecordStatus,
    SlotRegion,
    TransferMode,
    View,
    WakeFn,
    constant_mask,
)
from kvxfer.wire.auth import resolve_key

log = logging.getLogger(__name__)

BACKEND_KIND = "ipc"
EXTRA_NODE = "ipc.node"
SHUTDOWN_JOIN_S = 10.0  # shutdown() waits this long for the progress thread; a later call finishes the rest


IDLE_WAIT_S = 0.02  # the progress thread's longest sleep (or spin, with busy_poll) between passes
HEAD_SPIN_US = 200  # how long the progress thread spins on the oldest copy's event per pass
# publish()/fetch() of at most OWNER_SPIN_BYTES waits up to OWNER_SPIN_US for its own copy (a
# few microseconds of kernel after the launch) and sends the record itself: any hand-off to
# the progress thread costs a thread wake-up, tens of microseconds on a busy host.
OWNER_SPIN_BYTES = 8 << 20
OWNER_SPIN_US = 30


class IpcUnavailable(KvxferError):
    """The IPC backend cannot run in this process (no compiled CUDA module, no GPU)."""


def node_identity() -> bytes:
    """This machine's boot id: CUDA IPC handles mean nothing on another node (or boot)."""
    try:
        with open("/proc/sys/kernel/random/boot_id", "rb") as f:
            return f.read().strip()
    except OSError:
        return socket.gethostname().encode()


def _no_wake() -> None:
    """A later shutdown() only waits for the thread: the first one woke it, and the channel
    may be closed by now."""


def _no_pause(busy: bool) -> None:
    """The step waits itself (Channel.wait and spin): a wait between steps would only add to it."""


class IpcBackend(BackendEngine):
    """GPU-to-GPU on one node through CUDA IPC mappings of the peer's regions."""

    KIND = BACKEND_KIND
    TITLE = "IPC"
    GEOMETRY = True  # engine geometries too: one layout-transform kernel per submission (geometry)

    def __init__(
        self,
        name: str = "ipc",
        mode: TransferMode = TransferMode.PUSH,
        *,
        device: int = 0,
        key: bytes | None = None,
        deadline_s: float = 30.0,
        hint_ttl_s: float = DEFAULT_HINT_TTL_S,
        fail_after_rows: int | None = None,
        dead_peer_grace_s: float = 0.5,
        busy_poll: bool = False,
        doorbell: bool = True,
        cuda: ModuleType | None = None,
        integrity: bool = True,
        corrupt_rows: PickFn | None = None,
    ) -> None:
        # ``cuda``: the CUDA calls to make, kvxfer._native by default; kvxfer.testing.host_cuda
        # emulates them over shared host memory so that CI runs this control path without a GPU.
        # ``key`` signs completion records (kvxfer.wire.auth); None takes KVXFER_HINT_KEY, read
        # here once rather than at every record (a malformed value fails here, by name).
        if cuda is None:
            try:
                cuda = native.cuda_module()
            except native.RowCopyError as exc:
                raise IpcUnavailable(f"IpcBackend needs kvxfer._native with CUDA and a visible GPU: {exc}") from exc
        self._native: ModuleType = cuda
        visible = int(cuda.device_count())
        if not 0 <= device < visible:
            raise IpcUnavailable(f"IpcBackend: device {device} does not exist ({visible} visible)")
        self.device = device
        self.deadline_s = deadline_s
        self.fail_after_rows = fail_after_rows
        # A dead peer's last kernels may still run while its process is torn down.
        self.dead_peer_grace_s = dead_peer_grace_s
        # While transfers are pending, the progress thread polls its sockets without sleeping
        # (one busy core, the GIL left free): a record is seen without a thread wake-up, which
        # costs tens of microseconds on a virtual machine. For latency-critical decode ends.
        self.busy_poll = busy_poll
        signing_key = resolve_key(key) or b""  # b"": unsigned, whatever the environment says later
        self._node = node_identity()
        self._exports: dict[str, Export] = {}
        self._unsent: collections.deque[tuple[bytes, bytes]] = collections.deque()  # peer busy: sent again
        self._released = False  # shutdown() gave back the stream, mappings, ring and channel
        stream = cuda.stream_create(device)
        self._channel = Channel(f"{name}-{os.getpid()}-{secrets.token_hex(3)}")
        # The agent name is the socket path: records can be answered.
        self._start_engine(self._channel.path, mode, frozenset({MemoryKind.DEVICE}), hint_ttl_s)
        self._frames = CompletionFrames(self.name, signing_key)
        # Row integrity (rowcheck): the copy kernel checks each row where it landed; ``corrupt_rows``
        # picks rows for it to damage first (fault injection). rows_failed: those refused here.
        self.integrity = RowCheck(integrity)
        self._copies = CopyQueue(cuda, device, stream, self.name, self._frames, corrupt_rows)
        # A busy-polling passive end also offers a doorbell word (doorbells); False: sockets only.
        self._waits = PassiveWaits(self._jobs_lock, self._own.retire, self.name, doorbell and busy_poll)
        self._progress = ProgressThread(f"kvxfer-ipc-{name}", self._step, _no_pause,
                                        functools.partial(log.exception, "IPC backend %s: progress step failed",
                                                          self.name))
        self._progress.start()

    @property
    def doorbell(self) -> bool:
        """Whether our describe() offers a doorbell word (False once no ring could be made)."""
        return self._waits.doorbell

    @property
    def bells_rung(self) -> int:
        """Waits concluded by their doorbell (the socket record came later)."""
        return self._waits.bells_rung

    # --- the contract -----------------------------------------------------------------
    def register(self, regions: Iterable[SlotRegion]) -> tuple[SlotRegion, ...]:
        batch, skipped = self._reachable(regions)
        exports: dict[str, Export] = {}
        for region in batch:
            if region.device_id != self.device:
                raise InvalidSubmission(f"region {region.name!r} is on device {region.device_id}, "
                                        f"this backend runs on device {self.device}")
            if region.name in self._exports:
                continue
            try:
                handle, base, size = self._native.ipc_export(self.device, region.address)
            except self._native.CopyError as exc:
                raise InvalidSubmission(f"region {region.name!r} cannot be exported through CUDA IPC: {exc}") from exc
            if region.address + region.nbytes > base + size:
                raise InvalidSubmission(f"region {region.name!r} runs past the end of its CUDA allocation")
            exports[region.name] = Export(handle, base, size)
        added = self._regions.add(batch)
        for region in added:
            self._exports[region.name] = exports[region.name]
        return skipped

    def describe(self, view: View, audience: Peer | None = None) -> Hint:
        transfer_id = self._describe_checked(view)
        names = export_names(view)  # an engine view's: every region of its geometry
        extras = ((EXTRA_NODE, self._node),) + tuple((EXTRA_PREFIX + n, self._exports[n].pack()) for n in names)
        extras += self._frames.hint_extras(transfer_id, view.request)
        if self.integrity.enabled:  # the active end's kernel checks every row, whatever its own setting
            extras += ((EXTRA_CHECK, b"1"),)
        ring = self._waits.make_ring()
        if ring is not None:
            extras += ((EXTRA_BELL, ring.extra(bell_slot(transfer_id))),)
        return self._hint(view, transfer_id, audience, endpoint=self._channel.endpoint, extras=extras)

    def shutdown(self) -> frozenset[TrackedAttempt]:
        active: list[ActiveJob] = []
        passive: list[PassiveWait] = []

        def attempts() -> list[TrackedAttempt]:  # under the lock that closes us: no job is missed
            active.extend(self._copies.in_flight)
            passive.extend(self._waits.by_id.values())
            return [j.attempt for j in active] + [w.attempt for w in passive]

        first = self._close_and_cancel(attempts, self._channel.wake)
        stopped = self._progress.stop(self._channel.wake if first else _no_wake, SHUTDOWN_JOIN_S)
        if stopped and not self._released:
            # A call whose join timed out (a wake callback held it up) left this to the next.
            self._release()
        with self._jobs_lock:
            left = {w.attempt for w in passive} | {w.attempt for w in self._waits.by_id.values()}
            left |= {j.attempt for j in active} | {j.attempt for j in self._copies.in_flight}
        return frozenset(a for a in left if not a.quiesced())

    def _release(self) -> None:
        """Once our thread has exited: wait for our kernels, then nothing of ours touches any
        memory, and everything the backend holds is given back."""
        self._released = True
        stream_ok = self._copies.drain()
        while self._copies.in_flight:
            self._finish(self._copies.in_flight.popleft(), None if stream_ok else "the copy stream failed")
        self._copies.close_mappings()
        self._waits.close_ring()
        if stream_ok:
            self._copies.destroy_stream()
        self._channel.close()

    # --- submission (the owner's thread) ----------------------------------------------
    def _check_peer_hint(self, hint: Hint) -> None:
        if not hint.endpoint:
            raise InvalidSubmission("the peer's hint has no endpoint (socket path)")
        if hint.extra(EXTRA_NODE) != self._node:
            raise InvalidSubmission("the peer is on another node (or did not say): CUDA IPC works on one node only")

    def _submit(self, view: View, hint: Hint, wake: WakeFn | None, *, fetching: bool) -> TrackedAttempt:
        admitted = self._admit(view, hint, fetching=fetching)
        # Two geometries: the plan, or LayoutMismatch with nothing claimed, mapped or told (geometry).
        transform = plan_submission(view, hint, fetching=fetching, active=admitted.active)
        attempt = TrackedAttempt(wake, self._on_cancel, admitted.label)
        if admitted.active:
            copies = self._copies
            matches = match_rows(view, hint) if transform is None else []
            exports = copies.peer_exports(hint, matches) if transform is None else peer_exports(copies, hint)
            job = ActiveJob(attempt, view, hint, matches, exports, writes_peer=not fetching,
                            bell=copies.peer_bell(hint), transform=transform,
                            checked=transform is None and (self.integrity.enabled or bool(hint.extra(EXTRA_CHECK))))
            # launch_lock before _jobs_lock, here and wherever both are taken.
            with copies.launch_lock:
                with self._jobs_lock:
                    self._claim(hint, attempt)
                copies.launch(job, self.fail_after_rows)
            if job.launched and job.failure is None:
                # Made while the kernels run; sent once the event completes cleanly.
                job.frame = self._frames.delivered_frame(job)
                self._send_if_copied(job)
                job.delivered = Delivered(tuple(job.local_masks))
            # Woken only now: woken earlier, the progress thread takes the GIL while we encode,
            # often finds the copy done, and encodes the record a second time.
            self._channel.wake()
        else:
            wait = PassiveWait(attempt, view, hint, admitted.own_id, deadline=time.monotonic() + self.deadline_s)
            wait.token = self._frames.wait_token(admitted.own_id, hint, view.request)
            wait.delivered = Delivered(tuple(constant_mask(len(g), True) for g in view.groups))
            if self._waits.ring is not None:  # our describe() named a doorbell word for it
                wait.bell = bell_value(wait.token)
            with self._jobs_lock:
                self._refuse_if_closed()
                early = self._waits.add(wait)
            if early:
                self._waits.on_token(wait.token)
            self._channel.wake()
        self._own.consume(view, admitted.own_id)
        return attempt

    def _send_if_copied(self, job: ActiveJob) -> None:
        """A small copy has often ended by now, or ends within microseconds: then the record
        goes to the peer from here, saving it the progress thread's wake-up. Waits at most
        OWNER_SPIN_US for the copy, and never for the socket (send_with() gives up instead)."""
        if job.frame is None or not job.event:
            return
        with job.send_lock:
            if job.sent:
                return
            spin_us = OWNER_SPIN_US if job.nbytes <= OWNER_SPIN_BYTES else 0
            # The wait and the socket write are one native call (no Python between them); a
            # checked job reads its rows' verdicts between the two.
            write = self._copies.spin_check_send if job.checked else self._copies.spin_send
            try:
                job.sent = self._channel.send_with(job.hint.endpoint, job.frame, functools.partial(write, job, spin_us))
            except self._copies.native.CopyError:
                return  # the progress thread reports it

    def _on_cancel(self, attempt: TrackedAttempt) -> None:
        self._channel.wake()

    # --- the progress thread ----------------------------------------------------------
    def _step(self) -> bool:
        copies, waits = self._copies, self._waits
        if copies.in_flight:
            copies.watch_head(HEAD_SPIN_US)
        busy = bool(copies.in_flight)
        spun = not busy and self.busy_poll and bool(waits.by_id)
        if spun:
            # Returns as soon as a socket has input or a watched doorbell word is set.
            self._channel.spin(IDLE_WAIT_S, *waits.bell_watch())
        if waits.by_bell:
            waits.check_bells()
        # While copies are in flight, look without sleeping: their events are polled, and
        # a sleep's granularity (or a driver callback's wake-up, measured slower on an
        # H200 host) would dominate a small transfer's latency.
        frames, gone = self._channel.wait(0.0 if busy or spun else IDLE_WAIT_S)
        if frames and waits.by_bell:
            # A wait registered while we slept in wait() may have its doorbell and its
            # record both here now: the doorbell is stored before the record is sent, so
            # looking again first means it, not the record, ends the wait.
            waits.check_bells()
        for frame in frames:  # first: a peer's record is what a waiting owner needs soonest
            self._on_frame(frame)
        gone += self._channel.flush()  # the rest of a record the owner thread began
        for peer in gone:
            self._on_peer_gone(peer)
        if self._unsent:
            self._send_unsent()
        self._take_stashed()
        while (finished := copies.next_finished()) is not None:
            self._finish(*finished)
        self._check_passive()
        if busy:
            os.sched_yield()
        return busy

    def _take_stashed(self) -> None:
        """Records that came before their wait, now that it is registered."""
        with self._jobs_lock:
            stashed = [w for w in self._waits.by_id if w in self._stashed]
        for own_id in stashed:
            with self._jobs_lock:
                record = self._stashed.pop(own_id, None)
            if record is not None:
                self._on_record(record)

    def _on_frame(self, frame: bytes) -> None:
        if len(frame) == TOKEN_FRAME_BYTES and frame.startswith(DONE_PREFIX):
            self._waits.on_token(frame[len(DONE_PREFIX):])
            return
        record = self._frames.decode(frame)
        if record is not None:
            self._on_record(record)

    def _send(self, peer: bytes, record: CompletionRecord | None, frame: bytes | None = None) -> bool:
        """Send ``frame``, or ``record`` encoded when no frame is given. A peer that cannot be
        sent to is gone (the channel's rule): its mappings close and its waits fail, also when
        this is the first we hear of it (we had never connected to it before)."""
        if frame is None and record is not None:
            frame = self._frames.encode(record)
        if frame is None:
            return False
        try:
            if self._channel.send(peer, frame):
                return True
        except PeerBusy as exc:
            log.info("IPC backend %s: %s; the frame goes later", self.name, exc)
            self._unsent.append((peer, frame))
            return True
        self._on_peer_gone(peer)
        return False

    def _send_unsent(self) -> None:
        """Frames a busy peer could not take (progress thread): each goes once it can."""
        for _ in range(len(self._unsent)):
            peer, frame = self._unsent.popleft()
            if peer in self._copies.gone:
                continue
            try:
                if not self._channel.send(peer, frame):
                    self._on_peer_gone(peer)
            except PeerBusy:
                self._unsent.append((peer, frame))

    def _on_peer_gone(self, peer: bytes) -> None:
        self._copies.peer_gone(peer)
        now = time.monotonic()
        with self._jobs_lock:
            waits = [w for w in self._waits.by_id.values() if w.hint.endpoint == peer]
        for wait in waits:
            wait.attempt.conclude(Failed(f"peer {wait.hint.agent!r} is gone", wait.view.row_masks()))
            wait.gone_at = now  # quiesced after the grace period (_check_passive)

    def _on_record(self, record: CompletionRecord) -> None:
        if record.status is RecordStatus.CANCEL_REQUEST:
            self._on_cancel_request(record)
            return
        with self._jobs_lock:
            wait = self._waits.by_id.get(record.transfer_id)
            if wait is None:
                self._stash(record)
                return
        if record.sender != wait.hint.agent or record.request != wait.view.request:
            return  # not from the peer this transfer was described to: ignore it
        # Concluded already: we gave up earlier, and the peer now confirms it stopped.
        conclude_from_record(wait.attempt, wait.view, record)
        if record.status is RecordStatus.FAILED and record.reason.startswith(MISMATCH):
            # The publisher's kernel refused rows that landed here: every row it did not deliver.
            self.integrity.rows_failed += sum(int(m.size - np.count_nonzero(m)) for m in record.masks)
        self._waits.end(wait)

    def _on_cancel_request(self, record: CompletionRecord) -> None:
        # launch_lock first (the order _submit takes them): a launch in progress finishes and
        # its job is in in_flight before we look, so a job being launched is never missed
        # (which would tell the peer "withdrawn" while our kernels still touch its rows).
        with self._copies.launch_lock, self._jobs_lock:
            jobs = [j for j in list(self._copies.in_flight)
                    if j.hint.transfer_id == record.transfer_id and j.hint.agent == record.sender]
            if not jobs:
                # Nothing of ours touches the peer's rows; refuse to start later, and say so.
                self._revoke(record)
        for job in jobs:
            job.cancelled_by_peer = True
            job.attempt.cancel()
        if not jobs:
            self._send(record.sender.encode(), self._withdrawn(record))

    def _check_passive(self) -> None:
        now = time.monotonic()
        with self._jobs_lock:
            waits = list(self._waits.by_id.values())
        for wait in waits:
            if wait.gone_at is not None:
                if now >= wait.gone_at + self.dead_peer_grace_s:
                    self._waits.end(wait)
                continue
            if not wait.watching:
                try:
                    conn = self._channel.connect(wait.hint.endpoint)
                except PeerBusy as exc:
                    log.info("IPC backend %s: %s; asked again on the next pass", self.name, exc)
                    conn = None
                else:
                    wait.watching = True
                    if conn is None:
                        wait.attempt.conclude(Failed(f"peer {wait.hint.agent!r} is not listening",
                                                     wait.view.row_masks()))
                        wait.gone_at = now
                        continue
            reason = stop_reason(wait.attempt, wait.view.row_masks, now, wait.deadline, self.deadline_s,
                                 wait.hint.agent)
            if reason and not wait.told_peer:
                wait.told_peer = True
                # Stays unquiesced until the peer confirms that it stopped writing.
                if not self._send(wait.hint.endpoint, self._stop_request(wait.own_id, wait.view.request, reason)):
                    wait.gone_at = now

    # --- copies that ended ------------------------------------------------------------
    def _finish(self, job: ActiveJob, device_error: str | None) -> None:
        with job.send_lock:
            owner_sent = job.sent
            job.sent = True  # from here on the owner thread sends nothing and leaves the event alone
        if device_error is None:
            failed = self._copies.apply_check(job)  # 0 when the owner sent DELIVERED: it checked first
            if not job.writes_peer:  # a fetch: they landed here (a push's fetcher counts its own)
                self.integrity.rows_failed += failed
        self._copies.retire(job, device_error)
        if owner_sent:
            # The owner saw the event complete and told the peer DELIVERED: so it ended.
            self._complete(job, RecordStatus.DELIVERED, job.delivered or Delivered(tuple(job.local_masks)), "",
                           send=False)
            return
        if device_error is not None:
            # After a device fault nothing says which rows landed: report none.
            job.local_masks = job.view.row_masks()
            job.peer_masks = [np.zeros(len(g), dtype=np.bool_) for g in job.hint.groups]
            job.failure = device_error
        if job.failure is not None:
            self._complete(job, RecordStatus.FAILED, Failed(job.failure, job.local_masks), job.failure)
        elif not job.launched and job.attempt.cancel_requested:
            self._complete(job, RecordStatus.CANCELLED, Cancelled(job.cancelled_by_peer, job.local_masks), "")
        elif job.cancelled_by_peer:
            self._complete(job, RecordStatus.CANCELLED, Cancelled(True, job.local_masks), "")
        else:
            self._complete(job, RecordStatus.DELIVERED, job.delivered or Delivered(tuple(job.local_masks)), "")

    def _complete(self, job: ActiveJob, status: RecordStatus, outcome: Delivered | Failed | Cancelled,
                  reason: str, *, send: bool = True) -> None:
        """Tell the passive end what is in place on its side (unless the owner thread did);
        then ours concludes."""
        frame = job.frame if status is RecordStatus.DELIVERED else None
        record = None
        if frame is None:
            record = CompletionRecord(job.hint.transfer_id, self.name, job.view.request, status,
                                      job.peer_masks or [np.zeros(len(g), dtype=np.bool_) for g in job.hint.groups],
                                      reason)
        if send and not self._send(job.hint.endpoint, record, frame) and status is RecordStatus.DELIVERED:
            outcome = Failed(f"peer {job.hint.agent!r} is gone; its completion record was not delivered",
                             job.local_masks)
        job.attempt.conclude(outcome)
        job.attempt.mark_quiesced()
