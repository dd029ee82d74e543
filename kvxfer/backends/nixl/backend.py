"""The NIXL backend: rows move between processes through a NIXL agent over UCX.

It keeps the loopback backend's protocol (``kvxfer.backends.loopback``) over a real
transport. PUSH: the publisher WRITEs its rows into the fetcher's slots, then sends a
completion record (``kvxfer.wire``) as a NIXL notification; the fetcher's passive attempt
concludes from it. PULL: the fetcher READs, then notifies the publisher, whose passive
attempt concludes so its read lease can end. Records name the receiver's transfer id and
carry masks aligned with the receiver's hint groups; a record that arrives before its
fetch() is stashed by transfer id.

A progress thread owned by the backend posts the transfers (docs/performance.md: on host memory
``transfer()`` can block for seconds; only a push between device memory on both ends has
its first chunks posted by publish() itself, ``post_inline``), checks transfer state,
reads notifications, sends heartbeats to the peers of passive waits, enforces per-attempt
deadlines and handles cancel, injected faults and dead peers. Submissions go in chunks
(``plan``): a failure part-way reports exactly the chunks whose requests NIXL
completed. Chunks are 16 MiB, or 256 MiB between device memory on both ends, where a
request's fixed cost would otherwise exceed its transfer time (``plan.ChunkBytes``;
``chunk_bytes``).

A passive wait that is cancelled or times out concludes at once but stays unquiesced until
the peer answers its CANCEL_REQUEST (or is found dead): a NIXL notification needs the
receiver's metadata, so a peer that never loaded ours answers only when it later submits
that transfer (refused as withdrawn). ``shutdown()`` returns such waits, honestly.

Packed path (``packed``): a push of many small rows (``packed="auto"``: at least
``packed_min_descriptors`` descriptors per chunk after coalescing, by default 64 for device
memory and 2,048 for host memory, see ``MIN_DESCRIPTORS``; ``"always"``; ``"never"``)
gathers chunks into a registered bounce arena and WRITEs each as one descriptor into the
peer's arena, whose progress thread scatters it into the rows; arena slots are reused on
credits the receiver returns once it scattered, and a fetch() large enough to go packed
grants a few slots ahead, before the publisher asks (``packed.PREGRANT_SLOTS``), so
that a push published later starts without the request's round trip. The arena
(``arena_bytes`` in slots of ``packed_chunk_bytes``; HOST for host pools, DEVICE for CUDA
pools, the kind of the first regions registered; defaults in ``ARENA_DEFAULTS``, an
``arena_bytes`` given alone in the default slots or in two halves when smaller than two of
them; ``arena_bytes=0``: none, and no packed transfer to or from this backend) is
registered once and advertised in ``Hint.extras``. ``stats()`` and ``path_of(attempt)``
say which path carried each submission. Pull stays unpacked (see ``packed``).

Engine geometries (views and hints with a ``KVGeometry``, ``GEOMETRY = True``): a submission
between two layouts is planned by ``plan_between`` before anything is claimed (LayoutMismatch
refuses it with nothing touched) and moves the plan's segments instead of rows, as NIXL
descriptors or, for a push, packed through the arenas and scattered at the fetcher into its
layout (``geometry_path``, ``geometry_packed``); its masks prove blocks whose every run arrived.

UCX is progressed by this thread, which pauses ``poll_s`` between steps while transfers are
pending (a packed push waits on notification round trips, so a smaller pause helps it where
cores are spare). (NIXL's own progress thread spins a core per agent);
pass ``nixl_progress_thread=True`` to use NIXL's instead.

Metadata travels in the hint (``Hint.endpoint``). Where ``NIXL_ETCD_ENDPOINTS`` is set (or
``etcd=EtcdSettings(...)`` is given), kvxfer keeps each agent's metadata in etcd under a lease
instead (``etcd_metadata``), hints carry a short token naming the agent's process and
metadata generation, and a peer's metadata is looked up by agent name, rate-limited, by
whichever step needs it (a submission, a job waiting for its peer, a heartbeat).

What a dead peer can touch: nothing of its own any more (its process, endpoints and
queue pairs are gone). What remains is our side: our own requests towards it (we release
them; NIXL aborts them) and our UCX worker's handling of traffic it already received
(stopped by dropping the peer's endpoint). So a peer found dead (NIXL_ERR_REMOTE_DISCONNECT
on a post, a state check or a heartbeat) fails its attempts with the chunks proven so
far, and they are quiesced once no handle to it is alive and its remote state is dropped;
that also lets a restarted peer of the same name be added again.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

from kvxfer.backends.common.attempt import TrackedAttempt
from kvxfer.backends.common.devices import cuda_device_count, cuda_present, unique_agent_name
from kvxfer.backends.common.engine import BackendEngine, ProgressThread, conclude_from_record
from kvxfer.backends.common.integrity import CorruptFn, RowCheck
from kvxfer.backends.common.matching import match_rows
from kvxfer.backends.common.transfers import DEFAULT_HINT_TTL_S, put_bounded
from kvxfer.backends.common.transform import plan_between
from kvxfer.backends.nixl.agent import NixlAgent, PeerGone, PeerUnknown
from kvxfer.backends.nixl.checks import check_chunks_read, checked_masks, describe_extras, digest_posted, record_digests
from kvxfer.backends.nixl.etcd_metadata import EtcdSettings
from kvxfer.backends.nixl.geometry_packed import landing_slots_ahead
from kvxfer.backends.nixl.jobs import ActiveJob, PassiveWait, conclusion
from kvxfer.backends.nixl.liveness import HEARTBEAT, Liveness, LivenessHooks
from kvxfer.backends.nixl.packed import ARENA_EXTRA, Arena, PackedJob
from kvxfer.backends.nixl.packed_notes import NOTE_PREFIX, decode_note, ints
from kvxfer.backends.nixl.paths import MIN_DESCRIPTORS, PackedMode, Path
from kvxfer.backends.nixl.plan import ChunkBytes
from kvxfer.backends.nixl.receiver import PackedReceiver, ReceiverHooks
from kvxfer.backends.nixl.sender import SendPolicy, plan_job, start_job, step_job
from kvxfer.backends.nixl.stats import NixlStats, Tally
from kvxfer.contract import (
    Cancelled,
    CompletionRecord,
    Delivered,
    Failed,
    Hint,
    InvalidSubmission,
    MemoryKind,
    Peer,
    RecordStatus,
    SlotRegion,
    TransferMode,
    View,
    WakeFn,
)
from kvxfer.ucx_env import tcp_liveness
from kvxfer.wire import WireError, decode_completion, encode_completion

log = logging.getLogger(__name__)

BACKEND_KIND = "nixl"
IDLE_POLL_S = 0.01  # progress-thread pause with nothing pending (``poll_s`` while something is)
# Arena geometry by memory kind when not given: (bytes, slot bytes). Half the slots gather,
# half land. DEVICE: a notification round trip (~0.1-0.5 ms, docs/performance.md) is worth hundreds of
# MB at device speed, so slots are large and many MB are in flight per credit round. Across
# two H200s a 1 GiB push of 64 KiB rows went 1.5x faster with 1 GiB in 64 MiB slots than with
# 512 MiB in 32 MiB on two machines (bench/results/2026-11-29-h200x2-nixl).
ARENA_DEFAULTS = {MemoryKind.HOST: (64 << 20, 4 << 20), MemoryKind.DEVICE: (1 << 30, 64 << 20)}
KEPT = 4096  # slots granted ahead of a publish(), kept for it: the newest
PACKED = True  # this backend has the packed path (kvxfer bench checks for it)
__all__ = ["ARENA_DEFAULTS", "BACKEND_KIND", "MIN_DESCRIPTORS", "PACKED", "EtcdSettings", "NixlBackend", "NixlStats",
           "PackedMode", "Path", "cuda_device_count", "cuda_present", "unique_agent_name"]


def check_options(*, window: int, deadline_s: float, heartbeat_s: float, packed: str, arena_bytes: int | None,
                  packed_chunk_bytes: int | None, poll_s: float, post_inline: bool | None) -> None:
    """ValueError naming the first of NixlBackend's options that cannot work."""
    if window <= 0 or deadline_s <= 0 or heartbeat_s <= 0:
        raise ValueError("window, deadline_s and heartbeat_s must be positive")
    if packed not in ("auto", "always", "never"):
        raise ValueError(f"packed must be 'auto', 'always' or 'never', got {packed!r}")
    if arena_bytes is not None and (isinstance(arena_bytes, bool) or not isinstance(arena_bytes, int)
                                    or arena_bytes < 0):
        raise ValueError(f"arena_bytes must be a byte count >= 0 (0: no arena) or None, got {arena_bytes!r}")
    if arena_bytes and packed_chunk_bytes is not None and (
            packed_chunk_bytes <= 0 or arena_bytes < 2 * packed_chunk_bytes):
        raise ValueError(f"arena_bytes ({arena_bytes}) must hold at least 2 slots of packed_chunk_bytes "
                         f"({packed_chunk_bytes}), or be 0 for no arena")
    if poll_s < 0:
        raise ValueError("poll_s must not be negative")
    if post_inline not in (None, True, False):
        raise ValueError(f"post_inline must be None, True or False, got {post_inline!r}")




class NixlBackend(BackendEngine):
    """A NIXL agent (UCX) moving rows by WRITE (push) or READ (pull), with a progress thread."""

    KIND = BACKEND_KIND
    TITLE = "nixl"
    GEOMETRY = True  # engine geometries too (geometry_path, geometry_packed)

    def __init__(
        self,
        name: str | None = None,
        mode: TransferMode = TransferMode.PUSH,
        *,
        deadline_s: float = 30.0,
        hint_ttl_s: float = DEFAULT_HINT_TTL_S,
        chunk_bytes: int | ChunkBytes | None = None,
        window: int = 4,
        heartbeat_s: float = 0.25,
        coalesce: bool = True,
        fail_after_rows: int | None = None,
        chunk_pause_s: float = 0.0,
        use_etcd: bool | None = None,
        etcd: EtcdSettings | None = None,
        nixl_progress_thread: bool = False,
        packed: PackedMode = "auto",
        packed_min_descriptors: int | None = None,
        arena_bytes: int | None = None,
        packed_chunk_bytes: int | None = None,
        poll_s: float = 0.0001,
        post_inline: bool | None = None,
        integrity: bool = True,
        corrupt_landed: CorruptFn | None = None,
    ) -> None:
        # None: ChunkBytes' defaults (16 MiB, or 256 MiB between device memory on both ends);
        # an int: that size for every memory.
        sizes = ChunkBytes.of(chunk_bytes)
        check_options(window=window, deadline_s=deadline_s, heartbeat_s=heartbeat_s, packed=packed,
                      arena_bytes=arena_bytes, packed_chunk_bytes=packed_chunk_bytes, poll_s=poll_s,
                      post_inline=post_inline)
        # None: an unpacked push whose every chunk is device memory on both ends gets its
        # first ``window`` chunks (more, if some complete at once) posted by publish()
        # itself, sparing the progress thread's wake-up (about 0.2 ms on the GPU machine)
        # before the copy starts: there NIXL's transfer() only queues it. Host memory stays with the progress thread, as UCX may
        # do the whole copy inside transfer() (docs/performance.md). True/False: always/never.
        self.post_inline = post_inline
        self.poll_s = poll_s
        self.packed: PackedMode = packed
        self.packed_min_descriptors = packed_min_descriptors
        self.arena_bytes = arena_bytes
        self.packed_chunk_bytes = packed_chunk_bytes
        self.deadline_s = deadline_s
        self.chunk_bytes = sizes
        self.window = window
        self.heartbeat_s = heartbeat_s
        self.coalesce = coalesce
        self.fail_after_rows = fail_after_rows  # fault injection: fail after this many rows
        self.chunk_pause_s = chunk_pause_s      # pace chunk posts (tests kill a peer mid-way)
        name = name or unique_agent_name()
        self._agent = NixlAgent(name, use_etcd=use_etcd, etcd=etcd, progress_thread=nixl_progress_thread,
                                ucx=tcp_liveness(deadline_s))  # a silent peer is seen within a bound
        kinds = self._agent.reachable()
        if MemoryKind.DEVICE in kinds and not cuda_present():
            kinds = kinds - {MemoryKind.DEVICE}
        self._start_engine(name, mode, frozenset(kinds), hint_ttl_s)
        self.integrity = RowCheck(integrity, corrupt_landed)  # checks.py
        self._agent_closed = False  # shutdown() dropped peers and registrations
        self._active: list[ActiveJob] = []
        self._passive: dict[str, PassiveWait] = {}       # by this end's transfer id
        self._early: list[CompletionRecord] = []  # stashed records whose wait now exists
        # The packed path: our arena (made at the first register()), slots a fetcher granted
        # before our publish(), the receiving end, counters, paths.
        self._arena: Arena | None = None
        self._early_credits: OrderedDict[tuple[str, str], list[int]] = OrderedDict()  # granted before publish()
        self._tally = Tally()
        self._receiver = PackedReceiver(self.name, self._jobs_lock, self.integrity, ReceiverHooks(
            wait_for=self._wait_for, is_retired=self._own.is_retired, notify=self._notify, knows=self._agent.knows,
            count=self._tally.count, set_path=self._tally.set_path, end_passive=self._end_passive))
        self._liveness = Liveness(self.name, self._agent, self._jobs_lock, self._active, self._passive, LivenessHooks(
            send=self._send, stop_request=self._stop_request, end_passive=self._end_passive,
            forget_peer=self._receiver.forget_peer))
        self._kick = threading.Event()
        self._progress = ProgressThread(f"kvxfer-nixl-{self.name}", lambda: self._step(), self._pause,
                                        functools.partial(log.exception, "nixl backend %s: progress step failed",
                                                          self.name))
        self._progress.start()

    # --- the contract -----------------------------------------------------------------
    def register(self, regions: Iterable[SlotRegion]) -> tuple[SlotRegion, ...]:
        batch, skipped = self._reachable(regions)
        added = self._regions.add(batch)
        if added:
            if self._arena is None and self.arena_bytes != 0:
                first = added[0]
                size, slot = ARENA_DEFAULTS[first.memory_kind]
                size = self.arena_bytes or size
                # An arena size given alone keeps the default slot when two fit, else two halves.
                slot = self.packed_chunk_bytes or min(slot, size // 2)
                self._arena = self._receiver.arena = Arena(size, slot, first.memory_kind, first.device_id)
                added = [*added, self._arena.region(f"kvxfer-arena-{self.name}")]
            self._agent.register(added)
        return skipped

    def stats(self) -> NixlStats:
        return self._tally.stats()

    def path_of(self, attempt: TrackedAttempt) -> Path | None:
        """Which path carries (or carried) this attempt; for a passive wait, None until the
        peer's first packed chunk request or its completion record says."""
        return self._tally.path_of(attempt)

    def describe(self, view: View, audience: Peer | None = None) -> Hint:
        transfer_id = self._describe_checked(view)
        arena = ((ARENA_EXTRA, self._arena.info.pack()),) if self._arena is not None else ()
        return self._hint(view, transfer_id, audience, endpoint=self._agent.metadata,
                          extras=arena + describe_extras(self.integrity, self.mode, view))

    def shutdown(self) -> frozenset[TrackedAttempt]:
        """Stop taking work, cancel what runs, and return the attempts not proven quiesced.
        Called again later, it first makes one progress step on the caller's thread (the
        progress thread has exited): UCX moves what peers still send, and a confirmation that
        came since is applied, so the set shrinks to empty once the peers have answered."""
        with self._jobs_lock:
            again = self._closed and self._progress.stopping.is_set()
        if again:
            return self._shutdown_again()
        self._close_and_cancel(self._all_attempts, self._kick.set)
        if not self._progress.stop(self._kick.set, 10.0):  # stuck inside NIXL: nothing can be proven
            with self._jobs_lock:
                return frozenset(a for a in self._all_attempts() if not a.quiesced())
        # Our thread has exited: release what our own requests still hold, unless one is still
        # moving bytes to a live peer (NIXL would not abort it): that job stays unquiesced.
        for job in self._active:
            self._release_requests(job)
        for wait in self._passive.values():
            wait.attempt.conclude(Cancelled(False, wait.masks()))
        return self._left_after_shutdown()

    def _release_requests(self, job: ActiveJob) -> None:
        if not job.peer_gone and any(self._agent.state(h) == "PROC" for h in job.inflight.values()):
            return
        for handle in list(job.inflight.values()) + job.stuck:
            if not self._agent.release(handle):
                return
        job.inflight.clear()
        job.stuck.clear()
        local, _ = job.masks()
        job.attempt.conclude(Cancelled(False, local))
        job.attempt.mark_quiesced()

    def _shutdown_again(self) -> frozenset[TrackedAttempt]:
        left = frozenset(a for a in self._all_attempts() if not a.quiesced())
        if not left or self._progress.is_alive() or self._agent_closed:
            return left
        try:
            self._step()  # the only caller now: the progress thread has exited
        except Exception:
            log.exception("nixl backend %s: a progress step after shutdown failed", self.name)
        return self._left_after_shutdown()

    def _left_after_shutdown(self) -> frozenset[TrackedAttempt]:
        left = frozenset(a for a in self._all_attempts() if not a.quiesced())
        if not left:  # nothing can touch our regions any more: drop peers and registrations
            self._agent.close()
            self._agent_closed = True
        return left

    def _all_attempts(self) -> list[TrackedAttempt]:
        return [j.attempt for j in self._active] + [w.attempt for w in self._passive.values()]

    # --- submission -------------------------------------------------------------------
    def _check_peer_hint(self, hint: Hint) -> None:
        if hint.agent == self.name:
            raise InvalidSubmission(f"hint names this backend's own agent {self.name!r}")

    def _submit(self, view: View, hint: Hint, wake: WakeFn | None, *, fetching: bool) -> TrackedAttempt:
        admitted = self._admit(view, hint, fetching=fetching)
        # Two geometries: the plan, or LayoutMismatch with nothing touched (geometry_path).
        transform = plan_between(view, hint, fetching=fetching) if view.geometry is not None else None
        attempt = TrackedAttempt(wake, self._on_cancel, admitted.label)
        matches = match_rows(view, hint) if admitted.active and transform is None else []
        try:
            ready = self._agent.ensure_peer(hint.agent, hint.endpoint)
        except ValueError as exc:
            raise InvalidSubmission(str(exc)) from None
        except PeerGone as exc:
            # Nothing was posted: conclude at once rather than raise, so the caller sees why.
            self._own.consume(view, admitted.own_id)
            attempt.conclude(Failed(f"peer unreachable: {exc}", view.row_masks()))
            attempt.mark_quiesced()
            return attempt
        deadline = time.monotonic() + self.deadline_s
        with self._jobs_lock:
            self._refuse_if_closed()
            if admitted.active:
                # Refused while withdrawn, and the peer is told nothing here: it asks again
                # every heartbeat until answered, and now that we hold its metadata the next ask is.
                policy = self._policy()
                job = plan_job(policy, attempt, view, hint, matches, deadline, ready=ready, fetching=fetching,
                               arena=self._arena, agent=self.name, transform=transform)
                self._claim(hint, attempt)  # before anything is posted: withdraw() must see it
                self._start_job(policy, job)
                self._active.append(job)
            else:
                self._start_wait(PassiveWait(attempt, view, hint, admitted.own_id, deadline, transform=transform),
                                 fetching)
        self._own.consume(view, admitted.own_id)
        self._kick.set()
        return attempt

    def _policy(self) -> SendPolicy:
        return SendPolicy(packed=self.packed, min_descriptors=self.packed_min_descriptors, chunk_bytes=self.chunk_bytes,
                          coalesce=self.coalesce, post_inline=self.post_inline, window=self.window,
                          pause_s=self.chunk_pause_s, deadline_s=self.deadline_s, fail_after_rows=self.fail_after_rows)

    def _start_job(self, policy: SendPolicy, job: ActiveJob) -> None:
        """Under the jobs lock, once the hint is claimed (before the job is in _active, so the
        progress thread cannot step it meanwhile; under our lock, so that shutdown() finds
        what was posted)."""
        hint = job.hint
        ahead = self._early_credits.pop((hint.agent, hint.transfer_id), [])  # unused if unpacked
        if start_job(policy, job, self._agent, ahead):
            self._liveness.dead.add(hint.agent)  # as _peer_lost, whose lock we hold
        if isinstance(job, PackedJob):
            self._tally.count(packed_submissions=1)
            self._tally.set_path(job.attempt, "packed")
        else:
            self._tally.count(unpacked_submissions=1, chunks_posted_inline=job.next_chunk)
            self._tally.set_path(job.attempt, "unpacked")

    def _start_wait(self, wait: PassiveWait, fetching: bool) -> None:
        """Under the jobs lock: a passive wait, granted landing slots ahead where it pays."""
        ahead = landing_slots_ahead(wait, self._arena, packed=self.packed,
                                    min_descriptors=self.packed_min_descriptors) if fetching else 0
        if ahead:
            self._receiver.grant_ahead(wait, ahead)
        self._passive[wait.own_id] = wait
        early = self._stashed.pop(wait.own_id, None)
        if early is not None:
            # Handled by the progress thread, as every record: concluding here would call
            # wake inside fetch() and race that thread over the wait.
            self._early.append(early)

    def _on_cancel(self, attempt: TrackedAttempt) -> None:
        self._kick.set()

    def _wait_for(self, transfer_id: str) -> PassiveWait | None:
        with self._jobs_lock:
            return self._passive.get(transfer_id)

    # --- the progress thread ----------------------------------------------------------
    def _pause(self, busy: bool) -> None:
        self._kick.wait(timeout=self.poll_s if busy else IDLE_POLL_S)
        self._kick.clear()

    def _step(self) -> bool:
        to_land: list[tuple[str, dict[str, Any]]] = []
        for sender, messages in self._agent.notifications().items():
            if messages:
                self._receiver.heard_from(sender)
            for message in messages:
                self._on_message(sender, message, to_land)
        self._receiver.land(to_land)
        with self._jobs_lock:
            active = list(self._active)
            early, self._early = self._early, []
            ready = self._receiver.ready_requests(self._passive)
        for record in early:
            self._on_record(record)
        for transfer_id, sender, chunks, rows, held in ready:
            try:
                self._receiver.on_request(sender, transfer_id, chunks, rows, held)
            except ValueError as exc:
                log.warning("nixl backend %s: dropped a packed request from %r: %s", self.name, sender, exc)
        self._receiver.grant_credits()
        busy = False
        for job in active:
            busy |= self._advance(job)
        self._liveness.check_passive(self.deadline_s, self.heartbeat_s)
        self._liveness.heartbeat(self.heartbeat_s)
        self._liveness.drop_dead_peers()
        # A passive wait needs UCX progressed on our side too (AM-based lanes such as TCP move
        # the peer's data through our worker), so poll fast while one is pending.
        with self._jobs_lock:
            return busy or bool(self._passive)

    def _on_message(self, sender: str, message: bytes, to_land: list[tuple[str, dict[str, Any]]]) -> None:
        """Act on one notification; packed chunks are only collected (``to_land``), to land together."""
        if message == HEARTBEAT:  # proves only that the peer is there
            return
        if message.startswith(NOTE_PREFIX):
            try:
                note = decode_note(message)
                if note["k"] == "req":
                    chunks, rows, held = ints([note.get("n"), note.get("r", -1), note.get("h", 0)], "n/r/h")
                    self._receiver.on_request(sender, note["t"], chunks, rows, held)
                elif note["k"] == "credit":
                    self._on_credit(sender, note)
                else:
                    to_land.append((sender, note))
            except ValueError as exc:
                log.warning("nixl backend %s: dropped a packed note from %r: %s", self.name, sender, exc)
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
            self._on_cancel_request(record)
            return
        with self._jobs_lock:
            wait = self._passive.get(record.transfer_id)
            if wait is None:
                self._stash(record)
                return
        if record.sender != wait.hint.agent or record.request != wait.view.request:
            return  # not from the peer this transfer was described to: ignore it
        packed = wait.inbound is not None and wait.inbound.requested  # else the rows came unpacked
        self._tally.set_path(wait.attempt, "packed" if packed else "unpacked", first=True)
        check = self.integrity.record_check(wait.view, wait.transform, wait.inbound.sums if packed else None
                                            ) if self.mode is TransferMode.PUSH else None
        if packed:
            conclude_packed(wait, record, check)
        else:
            conclude_from_record(wait.attempt, wait.view, record, check)
        self._end_passive(wait)  # the active end sends its record only once its requests are done

    def _on_cancel_request(self, record: CompletionRecord) -> None:
        with self._jobs_lock:
            jobs = [j for j in self._active
                    if j.hint.transfer_id == record.transfer_id and j.hint.agent == record.sender]
            if not jobs:
                # Nothing of ours touches the peer's rows; refuse to start later, and say so.
                # Slots it granted us ahead are its own again once we answer: forget them.
                self._revoke(record)
                self._early_credits.pop((record.sender, record.transfer_id), None)
        for job in jobs:
            job.cancelled_by_peer = True
            job.attempt.cancel()
        if not jobs and self._agent.knows(record.sender):
            self._send(record.sender, self._withdrawn(record))

    def _end_passive(self, wait: PassiveWait) -> None:
        with self._jobs_lock:
            self._passive.pop(wait.own_id, None)
        self._receiver.release(wait)
        self._own.retire(wait.own_id)
        wait.attempt.mark_quiesced()

    def _on_credit(self, sender: str, note: dict[str, Any]) -> None:
        grant, ok, no = ints(note.get("grant"), "grant"), ints(note.get("ok"), "ok"), ints(note.get("no"), "no")
        with self._jobs_lock:
            jobs = [j for j in self._active if isinstance(j, PackedJob) and j.hint.agent == sender
                    and j.hint.transfer_id == note["t"]]
            if not jobs and grant and not ok and not no:
                # Granted by a fetch() ahead of our publish(): kept (bounded) for its push.
                put_bounded(self._early_credits, (sender, note["t"]), grant, KEPT)
        for job in jobs:
            job.on_credit(grant, ok, no)

    def _send(self, peer: str, record: CompletionRecord) -> bool:
        """Notify ``peer``; False when it is gone (then marked lost) or not loaded (yet)."""
        return self._notify(peer, encode_completion(record))

    def _notify(self, peer: str, message: bytes) -> bool:
        try:
            self._agent.notify(peer, message)
            return True
        except PeerUnknown as exc:
            log.info("nixl backend %s: %s", self.name, exc)
            return False
        except PeerGone as exc:
            log.info("nixl backend %s: %s", self.name, exc)
            self._peer_lost(peer)
            return False

    def _peer_lost(self, peer: str) -> None:
        self._liveness.lost(peer)

    # --- active jobs --------------------------------------------------------------------
    def _advance(self, job: ActiveJob) -> bool:
        """Step one job's chunks; conclude it once nothing can touch memory. True while busy."""
        posted = step_job(self._policy(), job, self._agent, self._arena)
        digest_posted(self.integrity, job)  # while the WRITEs just posted move
        check_chunks_read(self.integrity, job)  # while the READs still posted move
        if posted.chunks:
            self._tally.count(chunks_sent=posted.chunks, bytes_sent=posted.nbytes)
        lost = posted.lost
        if lost:
            self._peer_lost(job.hint.agent)
        if job.touching:
            if job.failure is not None and job.attempt.poll() is None:
                # Terminal now, with the rows proven so far (less those that failed their check);
                # quiesced (and the peer told) only once NIXL has ended the requests still in flight.
                job.attempt.conclude(conclusion(job, checked_masks(self.integrity, job)[0])[1])
            return True
        if not job.finished:
            # Paced, or waiting for the peer's metadata from etcd; a packed job waiting for
            # credits or acknowledgements polls fast: they come in a fraction of a millisecond.
            return isinstance(job, PackedJob) and job.requested
        local_masks, peer_masks, bad = checked_masks(self.integrity, job)
        status, outcome, reason = conclusion(job, local_masks, bad)
        # NIXL flushes the endpoint before a request is DONE, so the rows this record
        # marks are visible at the peer before the record can arrive.
        if job.hint.agent not in self._liveness.dead:
            self._send(job.hint.agent, CompletionRecord(job.hint.transfer_id, self.name, job.view.request, status,
                                                        peer_masks, reason, record_digests(self.integrity, job) or ()))
        with self._jobs_lock:
            if job in self._active:
                self._active.remove(job)
        job.attempt.conclude(outcome)
        job.attempt.mark_quiesced()
        return False


def conclude_packed(wait: PassiveWait, record: CompletionRecord, check: Any = None) -> None:
    """A packed wait's outcome: the rows in place are those this end scattered, whatever the
    record says, less those that fail ``check`` (see conclude_from_record)."""
    if wait.attempt.poll() is not None:
        return
    scattered = wait.masks()
    bad = check(scattered, record) if check is not None else None
    if record.status is RecordStatus.DELIVERED:
        if bad is not None:
            wait.attempt.conclude(Failed(bad, scattered))
        elif wait.inbound is not None and wait.inbound.landed_all:
            wait.attempt.conclude(Delivered(tuple(scattered)))
        else:
            wait.attempt.conclude(Failed("peer reported delivery but packed chunks are missing", scattered))
    elif record.status is RecordStatus.CANCELLED:
        wait.attempt.conclude(Cancelled(True, scattered))
    else:
        wait.attempt.conclude(Failed(f"peer failed: {record.reason}", scattered))
