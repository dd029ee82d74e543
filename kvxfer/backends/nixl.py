"""The NIXL backend: rows move between processes through a NIXL agent over UCX.

It keeps the loopback backend's protocol (``kvxfer.backends.loopback``) over a real
transport. PUSH: the publisher WRITEs its rows into the fetcher's slots, then sends a
completion record (``kvxfer.wire``) as a NIXL notification; the fetcher's passive attempt
concludes from it. PULL: the fetcher READs, then notifies the publisher, whose passive
attempt concludes so its read lease can end. Records name the receiver's transfer id and
carry masks aligned with the receiver's hint groups; a record that arrives before its
fetch() is stashed by transfer id.

A progress thread owned by the backend posts every transfer (PERF.md: on host memory
``transfer()`` can block for seconds), checks transfer state, reads notifications, sends
heartbeats to the peers of passive waits, enforces per-attempt deadlines and handles
cancel, injected faults and dead peers. Submissions go in chunks (``nixl_plan``): a
failure part-way reports exactly the chunks whose requests NIXL completed.

A passive wait that is cancelled or times out concludes at once but stays unquiesced until
the peer answers its CANCEL_REQUEST (or is found dead): a NIXL notification needs the
receiver's metadata, so a peer that never loaded ours answers only when it later submits
that transfer (refused as withdrawn). ``shutdown()`` returns such waits, honestly.

UCX is progressed by this thread (NIXL's own progress thread spins a core per agent);
pass ``nixl_progress_thread=True`` to use NIXL's instead.

Metadata travels in the hint (``Hint.endpoint``). Where ``NIXL_ETCD_ENDPOINTS`` is set,
the agent publishes its metadata to etcd instead, hints carry an empty endpoint, and a
peer's metadata is fetched from etcd by agent name (not tested here: no etcd in CI).

What a dead peer can touch: nothing of its own any more (its process, endpoints and
queue pairs are gone). What remains is our side: our own requests towards it (we release
them; NIXL aborts them) and our UCX worker's handling of traffic it already received
(stopped by dropping the peer's endpoint). So a peer found dead (NIXL_ERR_REMOTE_DISCONNECT
on a post, a state check or a heartbeat) fails its attempts with the chunks proven so
far, and they are quiesced once no handle to it is alive and its remote state is dropped;
that also lets a restarted peer of the same name be added again.
"""

from __future__ import annotations

import ctypes
import logging
import os
import secrets
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Hashable, Iterable
from typing import Any

from kvxfer.backends.attempt import TrackedAttempt
from kvxfer.backends.matching import check_agreement, match_rows
from kvxfer.backends.nixl_agent import NixlAgent, PeerGone, PeerUnknown
from kvxfer.backends.nixl_jobs import ActiveJob, PassiveWait, conclusion, step_chunks
from kvxfer.backends.nixl_plan import plan_chunks
from kvxfer.backends.regions import RegionTable
from kvxfer.backends.transfers import OwnTransfers, hint_groups
from kvxfer.contract import (
    Backend,
    Cancelled,
    Capabilities,
    CompletionRecord,
    Delivered,
    Failed,
    Hint,
    InvalidSubmission,
    MemoryKind,
    RecordStatus,
    SlotRegion,
    SubmissionRejected,
    TransferMode,
    View,
    WakeFn,
)
from kvxfer.wire import WireError, decode_completion, encode_completion

log = logging.getLogger(__name__)

BACKEND_KIND = "nixl"
HEARTBEAT = b""  # an empty notification: proves the peer is reachable, carries nothing


KEPT = 4096  # stashed records and withdrawn transfer ids kept


def _bounded_put(table: OrderedDict[Any, Any], key: Hashable, value: Any) -> None:
    table[key] = value
    table.move_to_end(key)
    while len(table) > KEPT:
        table.popitem(last=False)


def unique_agent_name(prefix: str = "kvxfer") -> str:
    """Host, process and a random suffix: unique across restarts of one process id."""
    return f"{prefix}-{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"


def cuda_present() -> bool:
    """True when the CUDA driver reports a device (checked without importing torch)."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
        count = ctypes.c_int(0)
        return cuda.cuInit(0) == 0 and cuda.cuDeviceGetCount(ctypes.byref(count)) == 0 and count.value > 0
    except OSError:
        return False


class NixlBackend(Backend):
    """A NIXL agent (UCX) moving rows by WRITE (push) or READ (pull), with a progress thread."""

    def __init__(
        self,
        name: str | None = None,
        mode: TransferMode = TransferMode.PUSH,
        *,
        deadline_s: float = 30.0,
        chunk_bytes: int = 16 << 20,
        window: int = 4,
        heartbeat_s: float = 0.25,
        coalesce: bool = True,
        fail_after_rows: int | None = None,
        chunk_pause_s: float = 0.0,
        use_etcd: bool | None = None,
        nixl_progress_thread: bool = False,
    ) -> None:
        if chunk_bytes <= 0 or window <= 0 or deadline_s <= 0 or heartbeat_s <= 0:
            raise ValueError("chunk_bytes, window, deadline_s and heartbeat_s must be positive")
        self.name = name or unique_agent_name()
        self.mode = mode
        self.deadline_s = deadline_s
        self.chunk_bytes = chunk_bytes
        self.window = window
        self.heartbeat_s = heartbeat_s
        self.coalesce = coalesce
        self.fail_after_rows = fail_after_rows  # fault injection: fail after this many rows
        self.chunk_pause_s = chunk_pause_s      # pace chunk posts (tests kill a peer mid-way)
        self._agent = NixlAgent(self.name, use_etcd=use_etcd, progress_thread=nixl_progress_thread)
        kinds = self._agent.reachable()
        if MemoryKind.DEVICE in kinds and not cuda_present():
            kinds = kinds - {MemoryKind.DEVICE}
        self._kinds = frozenset(kinds)
        self._regions = RegionTable(self._kinds)
        self._own = OwnTransfers()
        self._closed = False
        self._lock = threading.Lock()  # guards the job tables below
        self._active: list[ActiveJob] = []
        self._passive: dict[str, PassiveWait] = {}       # by this end's transfer id
        # Records that came before their fetch, and (peer agent, its transfer id) pairs the peer
        # withdrew; both bounded, oldest dropped first, so a confused peer cannot grow them.
        self._stashed: OrderedDict[str, CompletionRecord] = OrderedDict()
        self._revoked: OrderedDict[tuple[str, str], None] = OrderedDict()
        self._dead: set[str] = set()                     # peers found disconnected, not yet dropped
        self._replies: list[tuple[str, CompletionRecord]] = []  # withdrawals owed to peers
        self._next_heartbeat = 0.0
        self._kick = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"kvxfer-nixl-{self.name}", daemon=True)
        self._thread.start()

    # --- the contract -----------------------------------------------------------------
    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(memory_kinds=self._kinds, modes=frozenset({TransferMode.PUSH, TransferMode.PULL}))

    def register(self, regions: Iterable[SlotRegion]) -> None:
        self._refuse_if_closed()
        added = self._regions.add(regions)
        if added:
            self._agent.register(added)

    def describe(self, view: View) -> Hint:
        self._refuse_if_closed()
        self._regions.check_view(view, for_fetch=False)
        return Hint(
            backend=BACKEND_KIND, mode=self.mode, agent=self.name, request=view.request,
            transfer_id=self._own.mint(view), layout=view.layout, groups=hint_groups(view),
            endpoint=self._agent.metadata,
        )

    def fetch(self, view: View, hint: Hint, wake: WakeFn | None = None) -> TrackedAttempt:
        return self._submit(view, hint, wake, fetching=True)

    def publish(self, view: View, hint: Hint, wake: WakeFn | None = None) -> TrackedAttempt:
        return self._submit(view, hint, wake, fetching=False)

    def shutdown(self) -> frozenset[TrackedAttempt]:
        with self._lock:
            if self._closed and self._stop.is_set():
                return frozenset(a for a in self._all_attempts() if not a.quiesced())
            self._closed = True
            active = list(self._active)
            passive = list(self._passive.values())
        for job in active:
            job.attempt.cancel()
        for wait in passive:
            wait.attempt.cancel()
        # Peers get a moment to confirm that they stopped touching our memory.
        grace = time.monotonic() + 1.0
        while time.monotonic() < grace and not all(j.attempt.quiesced() for j in active + passive):
            self._kick.set()
            time.sleep(0.005)
        self._stop.set()
        self._kick.set()
        self._thread.join(timeout=10.0)
        if self._thread.is_alive():  # stuck inside NIXL: nothing can be proven
            return frozenset(j.attempt for j in active + passive if not j.attempt.quiesced())
        # Our thread has exited: release what our own requests still hold (NIXL aborts them).
        for job in self._active:
            for handle in list(job.inflight.values()) + job.stuck:
                if not self._agent.release(handle):
                    break
            else:
                job.inflight.clear()
                job.stuck.clear()
                local, _ = job.masks()
                job.attempt.conclude(Cancelled(False, local))
                job.attempt.mark_quiesced()
        for wait in self._passive.values():
            wait.attempt.conclude(Cancelled(False, wait.view.row_masks()))
        left = frozenset(a for a in self._all_attempts() if not a.quiesced())
        if not left:  # nothing can touch our regions any more: drop peers and registrations
            self._agent.close()
        return left

    def _all_attempts(self) -> list[TrackedAttempt]:
        return [j.attempt for j in self._active] + [w.attempt for w in self._passive.values()]

    # --- submission -------------------------------------------------------------------
    def _refuse_if_closed(self) -> None:
        if self._closed:
            raise SubmissionRejected(f"nixl backend {self.name!r} is shut down")

    def _submit(self, view: View, hint: Hint, wake: WakeFn | None, *, fetching: bool) -> TrackedAttempt:
        self._refuse_if_closed()
        if not isinstance(hint, Hint):
            raise InvalidSubmission(f"expected a Hint, got {type(hint).__name__}")
        self._regions.check_view(view, for_fetch=fetching)
        check_agreement(view, hint, BACKEND_KIND, self.mode)
        if hint.request != view.request:
            raise InvalidSubmission(f"hint is for request {hint.request!r}, the view for {view.request!r}")
        if hint.agent == self.name:
            raise InvalidSubmission(f"hint names this backend's own agent {self.name!r}")
        own_id = self._own.lookup(view)
        active = fetching == (self.mode is TransferMode.PULL)
        label = f"{self.name}:{'fetch' if fetching else 'publish'}:{view.request}"
        attempt = TrackedAttempt(wake, self._on_cancel, label)
        matches = match_rows(view, hint) if active else []
        try:
            ready = self._agent.ensure_peer(hint.agent, hint.endpoint)
        except ValueError as exc:
            raise InvalidSubmission(str(exc)) from None
        except PeerGone as exc:
            # Nothing was posted: conclude at once rather than raise, so the caller sees why.
            self._own.consume(view, own_id)
            attempt.conclude(Failed(f"peer unreachable: {exc}", view.row_masks()))
            attempt.mark_quiesced()
            return attempt
        deadline = time.monotonic() + self.deadline_s
        with self._lock:
            self._refuse_if_closed()
            if active:
                if (hint.agent, hint.transfer_id) in self._revoked:
                    # The peer asked us to withdraw before we had its metadata to answer; now
                    # we can, and its wait quiesces once it hears that nothing will move.
                    self._replies.append((hint.agent, CompletionRecord(
                        hint.transfer_id, self.name, view.request, RecordStatus.CANCELLED, [], "withdrawn")))
                    self._kick.set()
                    raise InvalidSubmission(
                        f"peer {hint.agent!r} withdrew transfer {hint.transfer_id} (cancelled or timed out): "
                        "describe again")
                total = sum(int(m.local_rows.size) for m in matches if m.peer is not None)
                limit = self.fail_after_rows
                injected = f"injected fault after {limit} rows" if limit is not None and limit < total else None
                chunks = plan_chunks(matches, hint, chunk_bytes=self.chunk_bytes,
                                     row_limit=limit if injected else None, coalesce_runs=self.coalesce)
                self._active.append(ActiveJob(attempt, view, hint, "READ" if fetching else "WRITE", chunks,
                                              deadline, injected=injected, ready=ready))
                early = None
            else:
                self._passive[own_id] = PassiveWait(attempt, view, hint, own_id, deadline)
                early = self._stashed.pop(own_id, None)
        self._own.consume(view, own_id)
        if early is not None:
            self._on_record(early)
        self._kick.set()
        return attempt

    def _on_cancel(self, attempt: TrackedAttempt) -> None:
        self._kick.set()

    # --- the progress thread ----------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                busy = self._step()
            except Exception:  # keep progressing other attempts; the failing one times out
                log.exception("nixl backend %s: progress step failed", self.name)
                busy = False
            self._kick.wait(timeout=0.0005 if busy else 0.01)
            self._kick.clear()

    def _step(self) -> bool:
        for sender, messages in self._agent.notifications().items():
            for message in messages:
                self._on_message(sender, message)
        with self._lock:
            active = list(self._active)
            replies, self._replies = self._replies, []
        for peer, record in replies:
            self._send(peer, record)
        busy = False
        for job in active:
            busy |= self._advance(job)
        self._check_passive()
        self._heartbeat()
        self._drop_dead_peers()
        # A passive wait needs UCX progressed on our side too (AM-based lanes such as TCP move
        # the peer's data through our worker), so poll fast while one is pending.
        with self._lock:
            return busy or bool(self._passive)

    def _on_message(self, sender: str, message: bytes) -> None:
        if message == HEARTBEAT:
            return
        try:
            record = decode_completion(message)
        except WireError as exc:
            log.warning("nixl backend %s: dropped a malformed notification from %r: %s", self.name, sender, exc)
            return
        if record.sender != sender:
            log.warning("nixl backend %s: record claims sender %r but came from agent %r", self.name,
                        record.sender, sender)
            return
        self._on_record(record)

    def _on_record(self, record: CompletionRecord) -> None:
        if record.status is RecordStatus.CANCEL_REQUEST:
            with self._lock:
                jobs = [j for j in self._active
                        if j.hint.transfer_id == record.transfer_id and j.hint.agent == record.sender]
                if not jobs:
                    # Nothing of ours touches the peer's rows; refuse to start later, and say so.
                    _bounded_put(self._revoked, (record.sender, record.transfer_id), None)
            for job in jobs:
                job.cancelled_by_peer = True
                job.attempt.cancel()
            if not jobs and self._agent.knows(record.sender):
                self._send(record.sender, CompletionRecord(
                    record.transfer_id, self.name, record.request, RecordStatus.CANCELLED, [], "withdrawn"))
            return
        with self._lock:
            wait = self._passive.get(record.transfer_id)
            if wait is None:
                if not self._own.is_retired(record.transfer_id):
                    _bounded_put(self._stashed, record.transfer_id, record)
                return
        if record.sender != wait.hint.agent or record.request != wait.view.request:
            return  # not from the peer this transfer was described to: ignore it
        if wait.attempt.poll() is None:
            masks = record.masks
            if record.status is RecordStatus.CANCELLED and not masks:
                wait.attempt.conclude(Cancelled(True, wait.view.row_masks()))
            elif len(masks) != len(wait.view.groups) or any(
                    m.shape != (len(g),) for m, g in zip(masks, wait.view.groups)):
                wait.attempt.conclude(Failed("peer sent a completion record of the wrong shape",
                                             wait.view.row_masks()))
            elif record.status is RecordStatus.DELIVERED:
                wait.attempt.conclude(Delivered(masks))
            elif record.status is RecordStatus.CANCELLED:
                wait.attempt.conclude(Cancelled(True, masks))
            else:
                wait.attempt.conclude(Failed(f"peer failed: {record.reason}", masks))
        self._end_passive(wait)  # the active end sends its record only once its requests are done

    def _end_passive(self, wait: PassiveWait) -> None:
        with self._lock:
            self._passive.pop(wait.own_id, None)
        self._own.retire(wait.own_id)
        wait.attempt.mark_quiesced()

    def _send(self, peer: str, record: CompletionRecord) -> bool:
        """Notify ``peer``; False when it is gone (then marked lost) or not loaded (yet)."""
        try:
            self._agent.notify(peer, encode_completion(record))
            return True
        except PeerUnknown as exc:
            log.info("nixl backend %s: %s", self.name, exc)
            return False
        except PeerGone as exc:
            log.info("nixl backend %s: %s", self.name, exc)
            self._peer_lost(peer)
            return False

    def _peer_lost(self, peer: str) -> None:
        with self._lock:
            self._dead.add(peer)
            jobs = [j for j in self._active if j.hint.agent == peer]
        for job in jobs:
            job.failure = job.failure or f"peer {peer!r} disconnected (NIXL_ERR_REMOTE_DISCONNECT)"

    # --- active jobs --------------------------------------------------------------------
    def _advance(self, job: ActiveJob) -> bool:
        """Step one job's chunks; conclude it once nothing can touch memory. True while busy."""
        lost = step_chunks(job, self._agent, window=self.window, pause_s=self.chunk_pause_s,
                           deadline_s=self.deadline_s)
        if lost:
            self._peer_lost(job.hint.agent)
        if job.touching:
            return True
        if not job.finished:
            return False  # paced, or waiting for the peer's metadata from etcd
        status, outcome, reason = conclusion(job)
        # NIXL flushes the endpoint before a request is DONE, so the rows this record
        # marks are visible at the peer before the record can arrive.
        if job.hint.agent not in self._dead:
            _, peer_masks = job.masks()
            self._send(job.hint.agent, CompletionRecord(
                job.hint.transfer_id, self.name, job.view.request, status, peer_masks, reason))
        with self._lock:
            if job in self._active:
                self._active.remove(job)
        job.attempt.conclude(outcome)
        job.attempt.mark_quiesced()
        return False

    # --- passive waits, heartbeats, dead peers ------------------------------------------
    def _check_passive(self) -> None:
        now = time.monotonic()
        with self._lock:
            waits = list(self._passive.values())
        for wait in waits:
            reason = None
            if wait.attempt.poll() is not None:
                pass
            elif wait.attempt.cancel_requested:
                wait.attempt.conclude(Cancelled(False, wait.view.row_masks()))
                reason = "cancelled"
            elif now > wait.deadline:
                wait.attempt.conclude(Failed(
                    f"timeout after {self.deadline_s:g}s waiting for peer {wait.hint.agent!r}", wait.view.row_masks()
                ))
                reason = "timeout"
            if reason:
                wait.stop_reason = reason
            if wait.attempt.poll() is not None and not wait.told_peer and self._agent.knows(wait.hint.agent):
                # Stays unquiesced until the peer confirms that it stopped (or is found dead).
                # An etcd peer not loaded yet is asked again once it is.
                wait.told_peer = self._send(wait.hint.agent, CompletionRecord(
                    wait.own_id, self.name, wait.view.request, RecordStatus.CANCEL_REQUEST, [],
                    wait.stop_reason or "stopped"))

    def _heartbeat(self) -> None:
        """An idle peer's death is seen only when something is posted to it (PERF.md)."""
        now = time.monotonic()
        if now < self._next_heartbeat:
            return
        self._next_heartbeat = now + self.heartbeat_s
        with self._lock:
            peers = {w.hint.agent: w.hint.endpoint for w in self._passive.values() if w.hint.agent not in self._dead}
        for peer, endpoint in peers.items():
            try:
                if not self._agent.knows(peer) and not self._agent.ensure_peer(peer, endpoint):
                    continue  # etcd has not delivered its metadata yet
                self._agent.notify(peer, HEARTBEAT)
            except (PeerGone, PeerUnknown, ValueError) as exc:
                log.info("nixl backend %s: heartbeat: %s", self.name, exc)
                self._peer_lost(peer)

    def _drop_dead_peers(self) -> None:
        with self._lock:
            dead = [p for p in self._dead if not any(j.hint.agent == p and j.touching for j in self._active)]
            waits = [w for w in self._passive.values() if w.hint.agent in dead]
        for peer in dead:
            # No request of ours to it is alive; dropping its endpoint stops our worker from
            # acting on anything it sent. A restarted peer of that name can now be added.
            self._agent.forget(peer)
            with self._lock:
                self._dead.discard(peer)
        for wait in waits:
            wait.attempt.conclude(Failed(f"peer {wait.hint.agent!r} disconnected before completing",
                                         wait.view.row_masks()))
            self._end_passive(wait)
