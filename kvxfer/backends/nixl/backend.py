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
(``nixl_plan``): a failure part-way reports exactly the chunks whose requests NIXL
completed. Chunks are 16 MiB, or 256 MiB between device memory on both ends, where a
request's fixed cost would otherwise exceed its transfer time (``nixl_plan.ChunkBytes``;
``chunk_bytes``).

A passive wait that is cancelled or times out concludes at once but stays unquiesced until
the peer answers its CANCEL_REQUEST (or is found dead): a NIXL notification needs the
receiver's metadata, so a peer that never loaded ours answers only when it later submits
that transfer (refused as withdrawn). ``shutdown()`` returns such waits, honestly.

Packed path (``nixl_packed``): a push of many small rows (``packed="auto"``: at least
``packed_min_descriptors`` descriptors per chunk after coalescing, by default 64 for device
memory and 2,048 for host memory, see ``MIN_DESCRIPTORS``; ``"always"``; ``"never"``)
gathers chunks into a registered bounce arena and WRITEs each as one descriptor into the
peer's arena, whose progress thread scatters it into the rows; arena slots are reused on
credits the receiver returns once it scattered, and a fetch() large enough to go packed
grants a few slots ahead, before the publisher asks (``nixl_packed.PREGRANT_SLOTS``), so
that a push published later starts without the request's round trip. The arena
(``arena_bytes`` in slots of ``packed_chunk_bytes``; HOST for host pools, DEVICE for CUDA
pools, the kind of the first regions registered; defaults in ``ARENA_DEFAULTS``, an
``arena_bytes`` given alone in the default slots or in two halves when smaller than two of
them; ``arena_bytes=0``: none, and no packed transfer to or from this backend) is
registered once and advertised in ``Hint.extras``. ``stats()`` and ``path_of(attempt)``
say which path carried each submission. Pull stays unpacked (see ``nixl_packed``).

UCX is progressed by this thread, which pauses ``poll_s`` between steps while transfers are
pending (a packed push waits on notification round trips, so a smaller pause helps it where
cores are spare). (NIXL's own progress thread spins a core per agent);
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
import weakref
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

from kvxfer.backends.common.attempt import TrackedAttempt, cancel_and_wait_quiet
from kvxfer.backends.common.matching import check_submission, match_rows
from kvxfer.backends.common.regions import RegionTable
from kvxfer.backends.common.transfers import DEFAULT_HINT_TTL_S, OwnTransfers, hint_groups, put_bounded
from kvxfer.backends.nixl.agent import NixlAgent, PeerGone, PeerUnknown
from kvxfer.backends.nixl.jobs import ActiveJob, PassiveWait, conclusion, step_chunks
from kvxfer.backends.nixl.notes import NOTE_PREFIX, Inbound, decode_note, ints
from kvxfer.backends.nixl.packed import (
    ARENA_EXTRA,
    PREGRANT_SLOTS,
    Arena,
    ArenaInfo,
    Landing,
    PackedJob,
    plan_packed,
    request_slots,
    rows_from_runs,
    step_packed,
)
from kvxfer.backends.nixl.plan import ChunkBytes, count_descriptors, plan_chunks
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
    Peer,
    RecordStatus,
    SlotRegion,
    SubmissionRejected,
    TransferMode,
    View,
    WakeFn,
)
from kvxfer.native import RowCopyError
from kvxfer.wire import WireError, decode_completion, encode_completion

log = logging.getLogger(__name__)

BACKEND_KIND = "nixl"
HEARTBEAT = b""  # an empty notification: proves the peer is reachable, carries nothing
IDLE_POLL_S = 0.01  # progress-thread pause with nothing pending (``poll_s`` while something is)
# Arena geometry by memory kind when not given: (bytes, slot bytes). Half the slots gather,
# half land. DEVICE: a notification round trip (~0.1-0.5 ms, docs/performance.md) is worth hundreds of
# MB at device speed, so slots are large and many MB are in flight per credit round. Across
# two H200s a 1 GiB push of 64 KiB rows went 1.5x faster with 1 GiB in 64 MiB slots than with
# 512 MiB in 32 MiB on two machines (bench/results/gpu2-h200x2-nixl-packed-2026-11-29l).
ARENA_DEFAULTS = {MemoryKind.HOST: (64 << 20, 4 << 20), MemoryKind.DEVICE: (1 << 30, 64 << 20)}


KEPT = 4096  # stashed records and withdrawn transfer ids kept
PACKED = True  # this backend has the packed path (kvxfer bench checks for it)
PackedMode = Literal["auto", "always", "never"]
Path = Literal["packed", "unpacked"]
# packed="auto" packs a push when its host-sized chunks (``ChunkBytes.host``, 16 MiB by
# default) average at least this many descriptors (runs after coalescing) each. DEVICE:
# every descriptor costs ~12 µs in UCX while the device gathers and scatters at TB/s
# (docs/performance.md), so pack early. HOST: packing adds two memcpys to
# NIXL's one; measured on the 2-core CPU machine (bench/nixl_packed.py, 256 MiB of scattered
# rows, two processes, best of 3-7 over several runs) packed was 2.2-2.9x unpacked at 4 KiB
# rows, 0.8-1.1x at 16 KiB, 0.5-0.65x at 64 KiB, so with 16 MiB chunks only rows of about
# 8 KiB or less (2,048 per chunk) go packed.
MIN_DESCRIPTORS = {MemoryKind.DEVICE: 64, MemoryKind.HOST: 2048}


@dataclass(frozen=True)
class NixlStats:
    """Counters since the backend started: which path carried submissions, and the packed
    traffic each end saw (sent by the active end, scattered by the receiving one)."""

    packed_submissions: int = 0     # pushes this end sent packed
    unpacked_submissions: int = 0   # pushes and pulls this end moved one descriptor per run
    packed_received: int = 0        # transfers that landed here packed
    chunks_sent: int = 0
    bytes_sent: int = 0
    chunks_scattered: int = 0
    bytes_scattered: int = 0
    credits_granted: int = 0
    credits_ahead: int = 0          # of those, granted at fetch() before the sender asked
    chunks_posted_inline: int = 0   # unpacked chunks posted by the owner's publish() (``post_inline``)


def unique_agent_name(prefix: str = "kvxfer") -> str:
    """Host, process and a random suffix: unique across restarts of one process id."""
    return f"{prefix}-{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"


def cuda_device_count() -> int:
    """Devices the CUDA driver reports, 0 without a driver (asked without importing torch)."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
        count = ctypes.c_int(0)
        return count.value if cuda.cuInit(0) == 0 and cuda.cuDeviceGetCount(ctypes.byref(count)) == 0 else 0
    except OSError:
        return 0


def cuda_present() -> bool:
    """True when the CUDA driver reports a device (checked without importing torch)."""
    return cuda_device_count() > 0


class NixlBackend(Backend):
    """A NIXL agent (UCX) moving rows by WRITE (push) or READ (pull), with a progress thread."""

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
        nixl_progress_thread: bool = False,
        packed: PackedMode = "auto",
        packed_min_descriptors: int | None = None,
        arena_bytes: int | None = None,
        packed_chunk_bytes: int | None = None,
        poll_s: float = 0.0001,
        post_inline: bool | None = None,
    ) -> None:
        # None: ChunkBytes' defaults (16 MiB, or 256 MiB between device memory on both ends);
        # an int: that size for every memory.
        sizes = ChunkBytes.of(chunk_bytes)
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
        self.name = name or unique_agent_name()
        self.mode = mode
        self.deadline_s = deadline_s
        self.chunk_bytes = sizes
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
        self._own = OwnTransfers(self.name, hint_ttl_s)
        self._closed = False
        self._agent_closed = False  # shutdown() dropped peers and registrations
        self._lock = threading.Lock()  # guards the job tables below
        self._active: list[ActiveJob] = []
        self._passive: dict[str, PassiveWait] = {}       # by this end's transfer id
        # Records that came before their fetch, and (peer agent, its transfer id) pairs the peer
        # withdrew; both bounded, oldest dropped first, so a confused peer cannot grow them.
        self._stashed: OrderedDict[str, CompletionRecord] = OrderedDict()
        self._revoked: OrderedDict[tuple[str, str], None] = OrderedDict()
        self._dead: set[str] = set()                     # peers found disconnected, not yet dropped
        self._early: list[CompletionRecord] = []  # stashed records whose wait now exists
        self._next_heartbeat = 0.0
        # The packed path: our arena (made at the first register()), requests for arena slots
        # that came before their fetch(), slots a fetcher granted before our publish(), the
        # waits landing in the arena, counters, paths.
        self._arena: Arena | None = None
        self._early_requests: OrderedDict[str, tuple[str, int, int, int]] = OrderedDict()
        self._early_credits: OrderedDict[tuple[str, str], list[int]] = OrderedDict()  # granted before publish()
        self._heard: OrderedDict[str, None] = OrderedDict()  # peers whose notifications reached us (bounded)
        self._inbound: dict[str, PassiveWait] = {}
        self._counts: dict[str, int] = dict.fromkeys(NixlStats.__dataclass_fields__, 0)
        self._paths: weakref.WeakKeyDictionary[TrackedAttempt, Path] = weakref.WeakKeyDictionary()
        self._kick = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"kvxfer-nixl-{self.name}", daemon=True)
        self._thread.start()

    # --- the contract -----------------------------------------------------------------
    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(memory_kinds=self._kinds, modes=frozenset({TransferMode.PUSH, TransferMode.PULL}))

    def register(self, regions: Iterable[SlotRegion]) -> tuple[SlotRegion, ...]:
        self._refuse_if_closed()
        batch, skipped = self._regions.reachable(regions)
        added = self._regions.add(batch)
        if added:
            if self._arena is None and self.arena_bytes != 0:
                first = added[0]
                size, slot = ARENA_DEFAULTS[first.memory_kind]
                size = self.arena_bytes or size
                # An arena size given alone keeps the default slot when two fit, else two halves.
                slot = self.packed_chunk_bytes or min(slot, size // 2)
                self._arena = Arena(size, slot, first.memory_kind, first.device_id)
                added = [*added, self._arena.region(f"kvxfer-arena-{self.name}")]
            self._agent.register(added)
        return skipped

    def stats(self) -> NixlStats:
        with self._lock:
            return NixlStats(**self._counts)

    def path_of(self, attempt: TrackedAttempt) -> Path | None:
        """Which path carries (or carried) this attempt; for a passive wait, None until the
        peer's first packed chunk request or its completion record says."""
        with self._lock:
            return self._paths.get(attempt)

    def _count(self, **deltas: int) -> None:
        with self._lock:
            for key, value in deltas.items():
                self._counts[key] += value

    @property
    def peer(self) -> Peer:
        return self._own.peer

    def describe(self, view: View, audience: Peer | None = None) -> Hint:
        self._refuse_if_closed()
        # As a fetch checks it: the hint exposes these rows, in push mode to a one-sided WRITE
        # that no later refusal can take back.
        self._regions.check_view(view, for_fetch=True)
        return Hint(
            backend=BACKEND_KIND, mode=self.mode, agent=self.name, request=view.request,
            transfer_id=self._own.mint(view), layout=view.layout, groups=hint_groups(view),
            endpoint=self._agent.metadata, run=self._own.peer.run, audience=audience, expires_ms=self._own.expiry(),
            extras=((ARENA_EXTRA, self._arena.info.pack()),) if self._arena is not None else (),
        )

    def fetch(self, view: View, hint: Hint, wake: WakeFn | None = None) -> TrackedAttempt:
        return self._submit(view, hint, wake, fetching=True)

    def publish(self, view: View, hint: Hint, wake: WakeFn | None = None) -> TrackedAttempt:
        return self._submit(view, hint, wake, fetching=False)

    def withdraw(self, hint: Hint) -> bool:
        return self._own.withdraw(hint)

    def shutdown(self) -> frozenset[TrackedAttempt]:
        """Stop taking work, cancel what runs, and return the attempts not proven quiesced.
        Called again later, it first makes one progress step on the caller's thread (the
        progress thread has exited): UCX moves what peers still send, and a confirmation that
        came since is applied, so the set shrinks to empty once the peers have answered."""
        with self._lock:
            again = self._closed and self._stop.is_set()
        if again:
            return self._shutdown_again()
        with self._lock:
            self._closed = True
            active = list(self._active)
            passive = list(self._passive.values())
        cancel_and_wait_quiet([j.attempt for j in active] + [w.attempt for w in passive], self._kick.set)
        self._stop.set()
        self._kick.set()
        self._thread.join(timeout=10.0)
        if self._thread.is_alive():  # stuck inside NIXL: nothing can be proven
            return frozenset(j.attempt for j in active + passive if not j.attempt.quiesced())
        # Our thread has exited: release what our own requests still hold, unless one is still
        # moving bytes to a live peer (NIXL would not abort it): that job stays unquiesced.
        for job in self._active:
            if not job.peer_gone and any(self._agent.state(h) == "PROC" for h in job.inflight.values()):
                continue
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
            wait.attempt.conclude(Cancelled(False, wait.masks()))
        left = frozenset(a for a in self._all_attempts() if not a.quiesced())
        if not left:  # nothing can touch our regions any more: drop peers and registrations
            self._agent.close()
            self._agent_closed = True
        return left

    def _shutdown_again(self) -> frozenset[TrackedAttempt]:
        left = frozenset(a for a in self._all_attempts() if not a.quiesced())
        if not left or self._thread.is_alive() or self._agent_closed:
            return left
        try:
            self._step()  # the only caller now: the progress thread has exited
        except Exception:
            log.exception("nixl backend %s: a progress step after shutdown failed", self.name)
        left = frozenset(a for a in self._all_attempts() if not a.quiesced())
        if not left:
            self._agent.close()
            self._agent_closed = True
        return left

    def _all_attempts(self) -> list[TrackedAttempt]:
        return [j.attempt for j in self._active] + [w.attempt for w in self._passive.values()]

    # --- submission -------------------------------------------------------------------
    def _refuse_if_closed(self) -> None:
        if self._closed:
            raise SubmissionRejected(f"nixl backend {self.name!r} is shut down")

    def _submit(self, view: View, hint: Hint, wake: WakeFn | None, *, fetching: bool) -> TrackedAttempt:
        self._refuse_if_closed()
        check_submission(view, hint, self._regions, BACKEND_KIND, self.mode, fetching=fetching)
        self._own.check_for_us(hint)
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
                self._own.check_usable(hint)
                if (hint.agent, hint.transfer_id) in self._revoked:
                    # Refused, and the peer is told nothing here: it asks again every heartbeat
                    # until answered, and now that we hold its metadata the next ask is.
                    raise InvalidSubmission(
                        f"peer {hint.agent!r} withdrew transfer {hint.transfer_id} (cancelled or timed out): "
                        "describe again")
                total = sum(int(m.local_rows.size) for m in matches if m.peer is not None)
                limit = self.fail_after_rows
                injected = f"injected fault after {limit} rows" if limit is not None and limit < total else None
                row_limit = limit if injected else None
                remote = None if fetching else self._packed_target(matches, hint, row_limit)
                ahead = self._early_credits.pop((hint.agent, hint.transfer_id), [])  # unused if unpacked
                job: ActiveJob
                if remote is not None and self._arena is not None:
                    packed = plan_packed(matches, hint, chunk_bytes=min(self._arena.slot_bytes, remote.slot_bytes),
                                         row_limit=row_limit)
                    job = PackedJob(attempt, view, hint, "WRITE", packed, deadline, injected=injected, ready=ready,
                                    remote=remote)
                    self._own.use(hint, attempt)  # before anything is posted: withdraw() must see it
                    job.on_credit(ahead, [], [])
                    # Ask for arena slots now rather than on the progress thread's next step:
                    # the request's round trip is on this push's critical path.
                    if request_slots(job, self._agent):
                        self._dead.add(hint.agent)  # as _peer_lost, whose lock we hold
                    self._counts["packed_submissions"] += 1
                    self._paths[attempt] = "packed"
                else:
                    chunks = plan_chunks(matches, hint, chunk_bytes=self.chunk_bytes, row_limit=row_limit,
                                         coalesce_runs=self.coalesce)
                    job = ActiveJob(attempt, view, hint, "READ" if fetching else "WRITE", chunks, deadline,
                                    injected=injected, ready=ready)
                    self._own.use(hint, attempt)  # before anything is posted: withdraw() must see it
                    if self._posts_inline(job):
                        # Before the job is in _active, so the progress thread cannot step it
                        # meanwhile; under our lock, so that shutdown() finds what was posted.
                        if step_chunks(job, self._agent, window=self.window, pause_s=0.0, deadline_s=self.deadline_s):
                            self._dead.add(hint.agent)  # as _peer_lost, whose lock we hold
                        self._counts["chunks_posted_inline"] += job.next_chunk
                    self._counts["unpacked_submissions"] += 1
                    self._paths[attempt] = "unpacked"
                self._active.append(job)
            else:
                wait = PassiveWait(attempt, view, hint, own_id, deadline)
                ahead = self._slots_ahead(view, hint) if fetching else 0
                if ahead:
                    wait.inbound = Inbound(hint.agent, ahead, view.row_masks(), -1, requested=False)
                    self._inbound[own_id] = wait
                self._passive[own_id] = wait
                early = self._stashed.pop(own_id, None)
                if early is not None:
                    # Handled by the progress thread, as every record: concluding here would
                    # call wake inside fetch() and race that thread over the wait.
                    self._early.append(early)
        self._own.consume(view, own_id)
        self._kick.set()
        return attempt

    def _slots_ahead(self, view: View, hint: Hint) -> int:
        """Landing slots to grant a fetch() before its sender asks: only when the sender has
        an arena and the view is large enough that its push would go packed under ``auto``."""
        arena = self._arena
        if arena is None or self.packed == "never" or hint.extra(ARENA_EXTRA) is None:
            return 0
        if view.rows < (self.packed_min_descriptors or MIN_DESCRIPTORS[arena.memory_kind]):
            return 0
        if any((g.region.memory_kind, g.region.device_id) != (arena.memory_kind, arena.device_id)
               for g in view.groups):
            return 0
        nbytes = sum(len(g) * g.region.slot_bytes for g in view.groups)
        return min(PREGRANT_SLOTS, -(-nbytes // arena.slot_bytes))

    def _posts_inline(self, job: ActiveJob) -> bool:
        """Whether publish() posts this unpacked push's first chunks itself (``post_inline``)."""
        if job.op != "WRITE" or not job.ready or not job.chunks or self.chunk_pause_s or self.post_inline is False:
            return False
        return self.post_inline or all(
            c.local_kind is MemoryKind.DEVICE and c.remote_kind is MemoryKind.DEVICE for c in job.chunks)

    def _on_cancel(self, attempt: TrackedAttempt) -> None:
        self._kick.set()

    def _packed_target(self, matches: list[Any], hint: Hint, row_limit: int | None) -> ArenaInfo | None:
        """The peer's arena when this push goes packed, else None (see the module docstring)."""
        arena = self._arena
        if self.packed == "never" or arena is None:
            return None
        try:
            remote = ArenaInfo.of(hint)
        except ValueError as exc:
            raise InvalidSubmission(str(exc)) from None
        if remote is None:
            return None
        # Counted per host-sized chunk whatever the memory: MIN_DESCRIPTORS was measured so
        # (with 16 MiB chunks), and an unpacked push of device rows then goes in larger ones.
        descriptors, chunks = count_descriptors(matches, chunk_bytes=self.chunk_bytes.host, row_limit=row_limit,
                                                coalesce_runs=self.coalesce)
        if chunks == 0:
            return None
        if self.packed == "auto":
            floor = self.packed_min_descriptors or MIN_DESCRIPTORS[arena.memory_kind]
            if descriptors < floor * chunks:
                return None  # few, large descriptors: NIXL moves them as fast without a copy
        fit = min(arena.slot_bytes, remote.slot_bytes)
        for m in matches:
            if m.peer is None or m.local_rows.size == 0:
                continue
            region = m.local.region
            if (region.memory_kind, region.device_id) != (arena.memory_kind, arena.device_id) \
                    or (m.peer.memory_kind, m.peer.device_id) != (remote.memory_kind, remote.device_id) \
                    or region.slot_bytes > fit:
                log.debug("nixl backend %s: group %s cannot go packed (memory or row size)", self.name,
                          m.local.layer_group)
                return None
        return remote

    # --- the progress thread ----------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                busy = self._step()
            except Exception:  # keep progressing other attempts; the failing one times out
                log.exception("nixl backend %s: progress step failed", self.name)
                busy = False
            self._kick.wait(timeout=self.poll_s if busy else IDLE_POLL_S)
            self._kick.clear()

    def _step(self) -> bool:
        to_land: list[tuple[str, dict[str, Any]]] = []
        for sender, messages in self._agent.notifications().items():
            if messages:
                put_bounded(self._heard, sender, None, KEPT)
            for message in messages:
                self._on_message(sender, message, to_land)
        self._land_chunks(to_land)
        with self._lock:
            active = list(self._active)
            early, self._early = self._early, []
            ready = [(t, *self._early_requests.pop(t)) for t in list(self._early_requests) if t in self._passive]
        for record in early:
            self._on_record(record)
        for transfer_id, sender, chunks, rows, held in ready:
            try:
                self._on_pack_request(sender, transfer_id, chunks, rows, held)
            except ValueError as exc:
                log.warning("nixl backend %s: dropped a packed request from %r: %s", self.name, sender, exc)
        self._grant_credits()
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

    def _on_message(self, sender: str, message: bytes, to_land: list[tuple[str, dict[str, Any]]]) -> None:
        """Act on one notification; packed chunks are only collected (``to_land``), to land together."""
        if message == HEARTBEAT:
            return
        if message.startswith(NOTE_PREFIX):
            try:
                note = decode_note(message)
                if note["k"] == "req":
                    chunks, rows, held = ints([note.get("n"), note.get("r", -1), note.get("h", 0)], "n/r/h")
                    self._on_pack_request(sender, note["t"], chunks, rows, held)
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
            with self._lock:
                jobs = [j for j in self._active
                        if j.hint.transfer_id == record.transfer_id and j.hint.agent == record.sender]
                if not jobs:
                    # Nothing of ours touches the peer's rows; refuse to start later, and say so.
                    # Slots it granted us ahead are its own again once we answer: forget them.
                    put_bounded(self._revoked, (record.sender, record.transfer_id), None, KEPT)
                    self._early_credits.pop((record.sender, record.transfer_id), None)
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
                    put_bounded(self._stashed, record.transfer_id, record, KEPT)
                return
        if record.sender != wait.hint.agent or record.request != wait.view.request:
            return  # not from the peer this transfer was described to: ignore it
        packed = wait.inbound is not None and wait.inbound.requested  # else the rows came unpacked
        with self._lock:
            self._paths.setdefault(wait.attempt, "packed" if packed else "unpacked")
        if wait.attempt.poll() is None and packed:
            # Packed: the rows in place are those this end scattered, whatever the record says.
            scattered = wait.masks()
            if record.status is RecordStatus.DELIVERED:
                if all(bool(m.all()) for m in scattered):
                    wait.attempt.conclude(Delivered(tuple(scattered)))
                else:
                    wait.attempt.conclude(Failed("peer reported delivery but packed chunks are missing", scattered))
            elif record.status is RecordStatus.CANCELLED:
                wait.attempt.conclude(Cancelled(True, scattered))
            else:
                wait.attempt.conclude(Failed(f"peer failed: {record.reason}", scattered))
        elif wait.attempt.poll() is None:
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
        """The peer wrote its last byte into our memory: its arena slots are ours again."""
        with self._lock:
            self._passive.pop(wait.own_id, None)
            self._inbound.pop(wait.own_id, None)
        if wait.inbound is not None and self._arena is not None:
            self._arena.free_in.extend(wait.inbound.granted)
            wait.inbound.granted.clear()
        self._own.retire(wait.own_id)
        wait.attempt.mark_quiesced()

    # --- the packed path: landing chunks ------------------------------------------------
    def _on_pack_request(self, sender: str, transfer_id: str, chunks: int, rows: int, held: int) -> None:
        with self._lock:
            wait = self._passive.get(transfer_id)
            if wait is None:
                if not self._own.is_retired(transfer_id):
                    put_bounded(self._early_requests, transfer_id, (sender, chunks, rows, held), KEPT)
                return
        inbound = wait.inbound
        if wait.hint.agent != sender or (inbound is not None and inbound.requested) or self._arena is None:
            log.warning("nixl backend %s: ignored a packed request from %r for transfer %s", self.name, sender,
                        transfer_id)
            return
        if not 0 < chunks <= max(1, wait.view.rows) or not -1 <= rows <= wait.view.rows or held < 0:
            raise ValueError(f"a packed request for {chunks} chunks of {rows} rows ({held} slots held), the "
                             f"transfer has {wait.view.rows} rows")
        if inbound is None:
            wait.inbound = Inbound(sender, chunks, wait.view.row_masks(), rows)
        else:
            inbound.on_request(chunks, rows, held)  # slots were granted at fetch(); chunks may have landed
        with self._lock:
            self._inbound[transfer_id] = wait
            self._paths[wait.attempt] = "packed"
            self._counts["packed_received"] += 1
        self._finish_if_complete(wait)

    def _grant_credits(self) -> None:
        """Free arena slots to the transfers that want them, in turn (those whose sender asked
        first); then send what is owed."""
        arena = self._arena
        with self._lock:
            waits = list(self._inbound.items())
        if arena is None or not waits:
            return
        live = [w.inbound for _, w in waits if w.inbound and w.inbound.wanted > 0 and w.attempt.poll() is None
                and not w.attempt.cancel_requested]  # a cancelled wait concludes this step: no new writes
        # Unasked grants go only to senders we have heard from: one that never loaded our
        # metadata could not answer the withdrawal that frees them if the wait ends unasked.
        ahead = [i for i in live if not i.requested and i.sender in self._heard and self._agent.knows(i.sender)]
        wanting = [i for i in live if i.requested] + ahead
        # Slots held for senders that have not asked are at most half of the landing slots.
        room = arena.landing_slots // 2 - sum(len(w.inbound.granted) for _, w in waits
                                              if w.inbound is not None and not w.inbound.requested)
        granted = 0
        while arena.free_in and wanting:
            for inbound in list(wanting):
                if not arena.free_in:
                    break
                if not inbound.requested:
                    if room <= 0:
                        wanting.remove(inbound)
                        continue
                    room -= 1
                slot = arena.free_in.popleft()
                inbound.granted.add(slot)
                inbound.grant.append(slot)
                inbound.wanted -= 1
                granted += 1
                if inbound.wanted == 0:
                    wanting.remove(inbound)
        if granted:
            self._count(credits_granted=granted)
        for transfer_id, wait in waits:
            inbound = wait.inbound
            if inbound is None or not inbound.owes_note or not self._agent.knows(wait.hint.agent):
                continue  # an etcd sender not loaded yet is told once the heartbeat has loaded it
            grant, asked = list(inbound.grant), inbound.requested
            if self._notify(wait.hint.agent, inbound.note(transfer_id)):
                inbound.sent()
                if not asked:
                    self._count(credits_ahead=len(grant))
            elif not asked:
                # Unasked slots the sender never heard of: take them back (it asks if it needs them).
                inbound.granted.difference_update(grant)
                arena.free_in.extend(grant)
                inbound.wanted += len(grant)
                inbound.grant.clear()

    def _finish_if_complete(self, wait: PassiveWait) -> None:
        """Every row the sender will send is in place: conclude now rather than one
        notification later. The sender still needs the last acknowledgement."""
        inbound = wait.inbound
        if inbound is None or not inbound.complete or wait.attempt.poll() is not None:
            return
        if self._notify(inbound.sender, inbound.note(wait.own_id)):
            inbound.sent()
        wait.attempt.conclude(Delivered(tuple(wait.masks())))
        self._end_passive(wait)

    def _land_chunks(self, notes: list[tuple[str, dict[str, Any]]]) -> None:
        """Packed chunks are in our arena: scatter them into their waits' rows (all queued
        before one wait for the device), then acknowledge."""
        arena = self._arena
        landings = []
        for sender, note in notes:
            try:
                landing = self._landing(sender, note)
            except ValueError as exc:
                log.warning("nixl backend %s: dropped a packed note from %r: %s", self.name, sender, exc)
                continue
            if landing is not None:
                landings.append(landing)
        if not landings:
            return
        assert arena is not None  # a landing exists only in an arena
        # A wait that a later note of this batch failed (or that ended meanwhile) takes no
        # more rows: its outcome's masks are final.
        ended = [x for x in landings if x.wait.attempt.poll() is not None]
        for x in ended:
            arena.free_in.append(x.slot)
            x.wait.inbound.no.append(x.chunk)
        landings = [x for x in landings if x not in ended]
        if not landings:
            return
        try:
            arena.scatter([(x.slot, x.region, x.slots) for x in landings])
            failure = None
        except RowCopyError as exc:
            failure = str(exc)
        for x in landings:
            arena.free_in.append(x.slot)
            wait, inbound = x.wait, x.wait.inbound
            if failure is not None:
                inbound.no.append(x.chunk)
                wait.attempt.conclude(Failed(f"packed chunk {x.chunk} from {inbound.sender!r}: {failure}",
                                             wait.masks()))
                continue
            inbound.scattered[x.group][x.rows] = True
            inbound.ok.append(x.chunk)
            self._count(chunks_scattered=1, bytes_scattered=int(x.rows.size) * x.region.slot_bytes)
            self._finish_if_complete(wait)

    def _landing(self, sender: str, note: dict[str, Any]) -> Landing | None:
        """Where a chunk's rows go; None when it is dropped unscattered (its slot freed, the
        sender told ``no``). ValueError for a chunk that is not ours to land."""
        transfer_id = note["t"]
        chunk, slot, group = ints([note.get("c"), note.get("s"), note.get("g")], "c/s/g")
        with self._lock:
            wait = self._passive.get(transfer_id)
        inbound = wait.inbound if wait is not None else None
        arena = self._arena
        if wait is None or inbound is None or inbound.sender != sender or arena is None:
            raise ValueError(f"chunk {chunk} for transfer {transfer_id}, which is not landing here")
        if slot not in inbound.granted:
            inbound.no.append(chunk)
            raise ValueError(f"chunk {chunk} of transfer {transfer_id} is in slot {slot}, not granted to it")
        inbound.granted.discard(slot)
        if wait.attempt.poll() is not None:
            inbound.no.append(chunk)  # concluded (cancelled, timed out): its rows stay as reported
            arena.free_in.append(slot)
            return None
        try:
            if not 0 <= group < len(wait.view.groups):
                raise ValueError(f"group {group} of a view with {len(wait.view.groups)} groups")
            rows_group = wait.view.groups[group]
            rows = rows_from_runs(note.get("rs"), note.get("rl"), len(rows_group))
            region = rows_group.region
            if rows.size * region.slot_bytes > arena.slot_bytes:
                raise ValueError(f"{rows.size} rows of {region.slot_bytes} bytes exceed an arena slot")
            if (region.memory_kind, region.device_id) != (arena.memory_kind, arena.device_id):
                raise ValueError(f"region {region.name!r} is not in the arena's memory")
            slots = rows_group.slots[rows]
        except (ValueError, IndexError) as exc:
            # The slot was taken from the granted set above: it must go back, and the sender
            # must hear "no", whatever was wrong with the note.
            arena.free_in.append(slot)
            inbound.no.append(chunk)
            wait.attempt.conclude(Failed(f"packed chunk {chunk} from {sender!r}: {exc}", wait.masks()))
            return None
        return Landing(wait, chunk, slot, group, rows, region, slots)

    def _on_credit(self, sender: str, note: dict[str, Any]) -> None:
        grant, ok, no = ints(note.get("grant"), "grant"), ints(note.get("ok"), "ok"), ints(note.get("no"), "no")
        with self._lock:
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
        with self._lock:
            self._dead.add(peer)
            jobs = [j for j in self._active if j.hint.agent == peer]
        for job in jobs:
            job.failure = job.failure or f"peer {peer!r} disconnected (NIXL_ERR_REMOTE_DISCONNECT)"
            job.peer_gone = True
            if isinstance(job, PackedJob):
                job.abandoned = True  # no acknowledgement will come: its rows stay as proven

    # --- active jobs --------------------------------------------------------------------
    def _advance(self, job: ActiveJob) -> bool:
        """Step one job's chunks; conclude it once nothing can touch memory. True while busy."""
        if isinstance(job, PackedJob):
            assert self._arena is not None
            first = job.next_chunk
            lost = step_packed(job, self._agent, self._arena, pause_s=self.chunk_pause_s, deadline_s=self.deadline_s)
            if job.next_chunk > first:
                self._count(chunks_sent=job.next_chunk - first,
                            bytes_sent=sum(c.nbytes for c in job.chunks[first:job.next_chunk]))
        else:
            lost = step_chunks(job, self._agent, window=self.window, pause_s=self.chunk_pause_s,
                               deadline_s=self.deadline_s)
        if lost:
            self._peer_lost(job.hint.agent)
        if job.touching:
            if job.failure is not None and job.attempt.poll() is None:
                # Terminal now, with the rows proven so far; quiesced (and the peer told) only
                # once NIXL has ended the requests still in flight.
                job.attempt.conclude(conclusion(job)[1])
            return True
        if not job.finished:
            # Paced, or waiting for the peer's metadata from etcd; a packed job waiting for
            # credits or acknowledgements polls fast: they come in a fraction of a millisecond.
            return isinstance(job, PackedJob) and job.requested
        local_masks, peer_masks = job.masks()
        status, outcome, reason = conclusion(job, local_masks)
        # NIXL flushes the endpoint before a request is DONE, so the rows this record
        # marks are visible at the peer before the record can arrive.
        if job.hint.agent not in self._dead:
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
                wait.attempt.conclude(Cancelled(False, wait.masks()))
                reason = "cancelled"
            elif now > wait.deadline:
                wait.attempt.conclude(Failed(
                    f"timeout after {self.deadline_s:g}s waiting for peer {wait.hint.agent!r}", wait.masks()
                ))
                reason = "timeout"
            if reason:
                wait.stop_reason = reason
            if wait.attempt.poll() is not None and now >= wait.ask_again and self._agent.knows(wait.hint.agent):
                # Stays unquiesced until the peer confirms that it stopped (or is found dead).
                # An etcd peer not loaded yet is asked once it is; an unanswered request is sent
                # again every heartbeat, as a peer that had not loaded our metadata (it never
                # published to us) can answer only once it has (a later push to us loads it).
                if self._send(wait.hint.agent, CompletionRecord(
                        wait.own_id, self.name, wait.view.request, RecordStatus.CANCEL_REQUEST, [],
                        wait.stop_reason or "stopped")):
                    wait.ask_again = now + self.heartbeat_s

    def _heartbeat(self) -> None:
        """An idle peer's death is seen only when something is posted to it (docs/performance.md): so peers
        we wait on (passive waits, packed pushes waiting for credits) get an empty note."""
        now = time.monotonic()
        if now < self._next_heartbeat:
            return
        self._next_heartbeat = now + self.heartbeat_s
        with self._lock:
            peers = {w.hint.agent: w.hint.endpoint for w in self._passive.values() if w.hint.agent not in self._dead}
            # A packed push waiting for credits or acknowledgements posts nothing that would fail.
            peers.update({j.hint.agent: j.hint.endpoint for j in self._active if isinstance(j, PackedJob)
                          and j.requested and not j.touching and j.hint.agent not in self._dead})
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
            self._heard.pop(peer, None)
            with self._lock:
                self._dead.discard(peer)
        for wait in waits:
            wait.attempt.conclude(Failed(f"peer {wait.hint.agent!r} disconnected before completing", wait.masks()))
            self._end_passive(wait)
