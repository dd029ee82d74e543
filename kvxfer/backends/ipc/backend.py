"""Same-node GPU-to-GPU backend: the peer's pool mapped through CUDA IPC, one kernel per group.

It keeps the loopback backend's protocol (``kvxfer.backends.loopback``): describe() mints a
transfer id; the active end (push: the publisher; pull: the fetcher) moves the bytes and
then sends a CompletionRecord; the passive end concludes from that record, and asks the
active end to stop (CANCEL_REQUEST) when it is cancelled or times out, staying unquiesced
until the active end confirms. Here:

- describe() carries, in ``Hint.extras``, a CUDA IPC handle for the allocation behind each
  region of the view (``ipc.region.<name>``) and this node's boot id (``ipc.node``); the
  ``endpoint`` is this backend's Unix socket, and the agent name is that socket's path.
- The active end opens each peer allocation once and caches the mapping (``ipc_mappings``),
  then queues one native row-copy kernel per view group on a stream it owns and records a
  CUDA event; its progress thread polls the event, and only then are rows True in masks.
  The kernels are queued inside publish()/fetch() itself: a launch is asynchronous and
  takes microseconds, and handing it to the progress thread would add a thread wake-up
  (tens of microseconds) to every small transfer's latency.
- Records travel as ``kvxfer.wire.encode_completion`` frames over Unix sockets
  (``ipc_channel``), signed when a key is set. A peer whose socket closes is gone: no new
  copy goes into its mappings, which close once the copies in flight have ended.
- The usual record, DELIVERED with every row of the passive end's hint, travels as 20 bytes
  instead: ``DONE_PREFIX`` and a token that the passive end looks up (``_done_token``). It
  saves encoding the record on the active end and decoding it on the passive end, which on
  a busy host were most of a small transfer's latency. Unsigned, the token comes in the
  passive end's hint (``EXTRA_DONE``); signed, both ends derive it from the key, so that it
  is no easier to forge than a signed record.

- A passive end that busy-polls also names a doorbell word in its hint (``ipc_bells``):
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
import hmac
import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from types import ModuleType

import numpy as np

from kvxfer import native
from kvxfer.backends.common.attempt import TrackedAttempt, cancel_and_wait_quiet
from kvxfer.backends.common.matching import GroupMatch, check_submission, match_rows
from kvxfer.backends.common.regions import RegionTable
from kvxfer.backends.common.transfers import DEFAULT_HINT_TTL_S, OwnTransfers, hint_groups, put_bounded
from kvxfer.backends.ipc.bells import (
    BELL_WORDS,
    EXTRA_BELL,
    BellOpener,
    BellRing,
    bell_export,
    bell_slot,
    bell_value,
    parse_bell,
)
from kvxfer.backends.ipc.channel import Channel, PeerBusy
from kvxfer.backends.ipc.mappings import EXTRA_PREFIX, Export, Mapping, Mappings
from kvxfer.contract import (
    Backend,
    Cancelled,
    Capabilities,
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
    SubmissionRejected,
    TransferMode,
    View,
    WakeFn,
    constant_mask,
)
from kvxfer.wire import WireError, decode_completion, encode_completion
from kvxfer.wire.auth import resolve_key

log = logging.getLogger(__name__)

BACKEND_KIND = "ipc"
EXTRA_NODE = "ipc.node"
EXTRA_DONE = "ipc.done"  # unsigned hints only: the token of this transfer's "DELIVERED, every row"
DONE_PREFIX = b"KXD1"  # + a 16-byte token: that record in 20 bytes (a msgpack map never starts so)
_TOKEN_BYTES = 16
_EARLY_KEPT = 4096  # tokens that arrived before their fetch/publish, kept for it
_KEPT = 4096  # records before their wait, and withdrawn transfers: the newest kept
SHUTDOWN_JOIN_S = 10.0  # shutdown() waits this long for the progress thread; a later call finishes the rest


IDLE_WAIT_S = 0.02  # the progress thread's longest sleep (or spin, with busy_poll) between passes
HEAD_SPIN_US = 200  # how long the progress thread spins on the oldest copy's event per pass
# publish()/fetch() of at most OWNER_SPIN_BYTES waits up to OWNER_SPIN_US for its own copy (a
# few microseconds of kernel after the launch) and sends the record itself: any hand-off to
# the progress thread costs a thread wake-up, tens of microseconds on a busy host.
OWNER_SPIN_BYTES = 8 << 20
OWNER_SPIN_US = 30


def _set_rows(mask: np.ndarray, rows: np.ndarray, n: int) -> None:
    """mask[rows[:n]] = True; rows are distinct, so all of them means every row of the mask."""
    if n == rows.size == mask.size:
        mask[:] = True
    else:
        mask[rows[:n]] = True


def _mask_of(size: int, rows: np.ndarray, n: int) -> np.ndarray:
    """Read-only mask of ``size`` rows with ``rows[:n]`` True."""
    if n == rows.size == size:
        return constant_mask(size, True)
    mask = np.zeros(size, dtype=np.bool_)
    _set_rows(mask, rows, n)
    mask.flags.writeable = False
    return mask


class IpcUnavailable(KvxferError):
    """The IPC backend cannot run in this process (no compiled CUDA module, no GPU)."""


def node_identity() -> bytes:
    """This machine's boot id: CUDA IPC handles mean nothing on another node (or boot)."""
    try:
        with open("/proc/sys/kernel/random/boot_id", "rb") as f:
            return f.read().strip()
    except OSError:
        return socket.gethostname().encode()


@dataclass(eq=False, slots=True)
class _Active:
    """This end moves the bytes (push publisher, pull fetcher)."""

    attempt: TrackedAttempt
    view: View
    hint: Hint
    matches: list[GroupMatch]
    exports: dict[str, Export]  # peer region name -> its allocation
    writes_peer: bool
    bell: tuple[str, int] | None = None  # the passive end's doorbell: (ring path, slot)
    cancelled_by_peer: bool = False
    launched: bool = False
    event: int = 0
    nbytes: int = 0  # queued for copying
    mappings: list[Mapping] = field(default_factory=list)
    local_masks: list[np.ndarray] = field(default_factory=list)
    peer_masks: list[np.ndarray] = field(default_factory=list)
    failure: str | None = None
    token: bytes | None = None  # the token of "DELIVERED, every row" (b"": none); see _frame_token
    frame: bytes | None = None  # DELIVERED (a token frame, or the record), made while the kernel runs
    delivered: Delivered | None = None  # and our outcome if it ends so
    # Who sends the record: the owner thread (a copy already ended when publish() was
    # about to return) or the progress thread; whoever sets ``sent`` first, under the lock.
    sent: bool = False
    send_lock: threading.Lock = field(default_factory=threading.Lock)


@dataclass(eq=False, slots=True)
class _Passive:
    """The peer moves the bytes; this end waits for its completion record."""

    attempt: TrackedAttempt
    view: View
    hint: Hint
    own_id: str
    deadline: float
    told_peer: bool = False
    watching: bool = False  # connected to the peer, so that its death is seen
    gone_at: float | None = None
    token: bytes = b""  # the usual answer's token (see _done_token) and its outcome, made at submission
    delivered: Delivered | None = None
    bell: int = 0  # the doorbell value that stands for the token (0: no doorbell)


class IpcBackend(Backend):
    """GPU-to-GPU on one node through CUDA IPC mappings of the peer's regions."""

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
        self.mode = mode
        self.device = device
        self.deadline_s = deadline_s
        self.fail_after_rows = fail_after_rows
        # A dead peer's last kernels may still run while its process is torn down.
        self.dead_peer_grace_s = dead_peer_grace_s
        # While transfers are pending, the progress thread polls its sockets without sleeping
        # (one busy core, the GIL left free): a record is seen without a thread wake-up, which
        # costs tens of microseconds on a virtual machine. For latency-critical decode ends.
        self.busy_poll = busy_poll
        # A busy-polling passive end also offers a doorbell word (ipc_bells); False: sockets only.
        self.doorbell = doorbell and busy_poll
        self.bells_rung = 0  # waits concluded by their doorbell (the socket record came later)
        self._key = resolve_key(key) or b""  # b"": unsigned, whatever the environment says later
        self._node = node_identity()
        self._regions = RegionTable(frozenset({MemoryKind.DEVICE}))
        self._exports: dict[str, Export] = {}
        self._peer_export_cache: dict[bytes, Export] = {}  # packed export -> Export (hints repeat them)
        self._hint_ttl_s = hint_ttl_s
        self._closed = False
        self._jobs_lock = threading.Lock()
        self._launch_lock = threading.Lock()  # launches enter the stream and _in_flight in one order
        self._map_lock = threading.Lock()  # mappings: acquired at launch, released by the progress thread
        self._in_flight: collections.deque[_Active] = collections.deque()
        self._gone: set[bytes] = set()  # peer endpoints seen gone (written by the progress thread)
        self._passive: dict[str, _Passive] = {}
        self._by_token: dict[bytes, _Passive] = {}
        self._early: collections.OrderedDict[bytes, None] = collections.OrderedDict()  # tokens before their wait
        self._secret = secrets.token_bytes(32)  # derives the tokens of unsigned hints
        # Records that came before their wait, and (peer, transfer) pairs the peer withdrew:
        # bounded, oldest dropped first (an aborted request leaves one of each behind).
        self._stashed: collections.OrderedDict[str, CompletionRecord] = collections.OrderedDict()
        self._revoked: collections.OrderedDict[tuple[str, str], None] = collections.OrderedDict()
        self._unsent: collections.deque[tuple[bytes, bytes]] = collections.deque()  # peer busy: sent again
        self._events: collections.deque[int] = collections.deque()
        self._stop = threading.Event()
        self._released = False  # shutdown() gave back the stream, mappings, ring and channel
        self._stream = self._native.stream_create(device)
        self._channel = Channel(f"{name}-{os.getpid()}-{secrets.token_hex(3)}")
        self.name = self._channel.path  # the agent name is the socket path: records can be answered
        self._own = OwnTransfers(self.name, self._hint_ttl_s)
        self._mappings = Mappings(self._native, device)
        self._bell_opener = BellOpener(cuda, device)
        self._peer_bell_paths: dict[bytes, str] = {}  # EXTRA_BELL past its slot -> the ring's path, checked
        self._bad_bells: set[str] = set()  # peers' rings that could not be opened: sockets only
        self._ring: BellRing | None = None  # ours, made at the first describe() (doorbell only)
        self._by_bell: dict[int, _Passive] = {}
        self._bell_slots: np.ndarray | None = None  # the slots _by_bell's waits watch (None: stale)
        self._answered: collections.OrderedDict[bytes, None] = collections.OrderedDict()  # rung tokens
        self._thread = threading.Thread(target=self._run, name=f"kvxfer-ipc-{name}", daemon=True)
        self._thread.start()

    # --- the contract -----------------------------------------------------------------
    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(
            memory_kinds=frozenset({MemoryKind.DEVICE}),
            modes=frozenset({TransferMode.PUSH, TransferMode.PULL}),
        )

    def register(self, regions: Iterable[SlotRegion]) -> tuple[SlotRegion, ...]:
        self._refuse_if_closed()
        batch, skipped = self._regions.reachable(regions)
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

    @property
    def peer(self) -> Peer:
        return self._own.peer

    def describe(self, view: View, audience: Peer | None = None) -> Hint:
        self._refuse_if_closed()
        # As a fetch checks it: the hint exposes these rows, in push mode to a one-sided WRITE
        # that no later refusal can take back.
        self._regions.check_view(view, for_fetch=True)
        names = dict.fromkeys(g.region.name for g in view.groups)
        extras = ((EXTRA_NODE, self._node),) + tuple((EXTRA_PREFIX + n, self._exports[n].pack()) for n in names)
        transfer_id = self._own.mint(view)
        if not self._key:
            extras += ((EXTRA_DONE, self._done_token(transfer_id, "", view.request)),)
        ring = self._bell_ring()
        if ring is not None:
            extras += ((EXTRA_BELL, ring.extra(bell_slot(transfer_id))),)
        return Hint(
            backend=BACKEND_KIND, mode=self.mode, agent=self.name, request=view.request,
            transfer_id=transfer_id, layout=view.layout, groups=hint_groups(view),
            endpoint=self._channel.endpoint, extras=extras,
            run=self._own.peer.run, audience=audience, expires_ms=self._own.expiry(),
        )

    def fetch(self, view: View, hint: Hint, wake: WakeFn | None = None) -> TrackedAttempt:
        return self._submit(view, hint, wake, fetching=True)

    def publish(self, view: View, hint: Hint, wake: WakeFn | None = None) -> TrackedAttempt:
        return self._submit(view, hint, wake, fetching=False)

    def withdraw(self, hint: Hint) -> bool:
        return self._own.withdraw(hint)

    def shutdown(self) -> frozenset[TrackedAttempt]:
        with self._jobs_lock:
            first = not self._closed
            self._closed = True
            active = list(self._in_flight)
            passive = list(self._passive.values())
        if first:
            cancel_and_wait_quiet([j.attempt for j in active] + [w.attempt for w in passive], self._channel.wake)
            self._stop.set()
            self._channel.wake()
        self._thread.join(timeout=SHUTDOWN_JOIN_S)
        if not self._thread.is_alive() and not self._released:
            # A call whose join timed out (a wake callback held it up) left this to the next.
            self._release()
        with self._jobs_lock:
            left = {w.attempt for w in passive} | {w.attempt for w in self._passive.values()}
            left |= {j.attempt for j in active} | {j.attempt for j in self._in_flight}
        return frozenset(a for a in left if not a.quiesced())

    def _release(self) -> None:
        """Once our thread has exited: wait for our kernels, then nothing of ours touches any
        memory, and everything the backend holds is given back."""
        self._released = True
        # A submission that passed the closed check on another thread just before shutdown
        # finishes its launch first, so its job is in _in_flight and its event in hand here;
        # none starts after (_closed is set). Not held below: finishing a job may find its
        # peer gone, and _on_peer_gone takes this lock.
        with self._launch_lock:
            pass
        try:
            self._native.stream_synchronize(self._stream)
            stream_ok = True
        except self._native.CopyError as exc:
            log.error("IPC backend %s: stream failed at shutdown: %s", self.name, exc)
            stream_ok = False
        while self._in_flight:
            self._finish(self._in_flight.popleft(), None if stream_ok else "the copy stream failed")
        with self._map_lock:
            still_mapped = self._mappings.close_all()
        if still_mapped:
            log.error("IPC backend %s: %d mappings still in use at shutdown, left open", self.name, still_mapped)
        while self._events:
            self._drop_event(self._events.pop())
        if self._ring is not None:
            self._ring.close()  # a peer's store into it after this lands in its own mapping only
        if stream_ok:
            self._native.stream_destroy(self._stream)
        self._channel.close()

    # --- submission (the owner's thread) ----------------------------------------------
    def _refuse_if_closed(self) -> None:
        if self._closed:
            raise SubmissionRejected(f"IPC backend {self.name!r} is shut down")

    def _submit(self, view: View, hint: Hint, wake: WakeFn | None, *, fetching: bool) -> TrackedAttempt:
        self._refuse_if_closed()
        check_submission(view, hint, self._regions, BACKEND_KIND, self.mode, fetching=fetching)
        self._own.check_for_us(hint)
        if not hint.endpoint:
            raise InvalidSubmission("the peer's hint has no endpoint (socket path)")
        if hint.extra(EXTRA_NODE) != self._node:
            raise InvalidSubmission("the peer is on another node (or did not say): CUDA IPC works on one node only")
        own_id = self._own.lookup(view)
        active = fetching == (self.mode is TransferMode.PULL)
        label = f"{self.name}:{'fetch' if fetching else 'publish'}:{view.request}"
        attempt = TrackedAttempt(wake, self._on_cancel, label)
        if active:
            matches = match_rows(view, hint)
            exports = self._peer_exports(hint, matches)
            job = _Active(attempt, view, hint, matches, exports, writes_peer=not fetching, bell=self._peer_bell(hint))
            with self._launch_lock:
                with self._jobs_lock:
                    self._refuse_if_closed()
                    self._own.check_usable(hint)
                    if (hint.agent, hint.transfer_id) in self._revoked:
                        raise InvalidSubmission(
                            f"peer {hint.agent!r} withdrew transfer {hint.transfer_id} (cancelled or timed out): "
                            "describe again")
                    self._own.use(hint, attempt)
                self._launch(job)
                self._in_flight.append(job)
            if job.launched and job.failure is None:
                # Made while the kernels run; sent once the event completes cleanly.
                job.frame = self._delivered_frame(job)
                self._send_if_copied(job)
                job.delivered = Delivered(tuple(job.local_masks))
            # Woken only now: woken earlier, the progress thread takes the GIL while we encode,
            # often finds the copy done, and encodes the record a second time.
            self._channel.wake()
        else:
            wait = _Passive(attempt, view, hint, own_id, deadline=time.monotonic() + self.deadline_s)
            wait.token = self._done_token(own_id, hint.agent if self._key else "", view.request)
            wait.delivered = Delivered(tuple(constant_mask(len(g), True) for g in view.groups))
            if self._ring is not None:  # our describe() named a doorbell word for it
                wait.bell = bell_value(wait.token)
            with self._jobs_lock:
                self._refuse_if_closed()
                self._passive[own_id] = wait  # a record that came early is in _stashed: see _run
                self._by_token[wait.token] = wait
                if wait.bell:
                    self._by_bell[wait.bell] = wait
                    self._bell_slots = None
                early = wait.token in self._early
                if early:
                    del self._early[wait.token]
            if early:
                self._on_token(wait.token)
            self._channel.wake()
        self._own.consume(view, own_id)
        return attempt

    def _done_token(self, transfer_id: str, sender: str, request: str) -> bytes:
        """The token that stands for "DELIVERED, every row" of one transfer. Signed (a key is
        set): both ends derive it from the key, the transfer and the sender, so that only a
        key holder can send it, as only one can sign a record. Unsigned: the passive end puts
        it in its hint (``EXTRA_DONE``), derived from a secret of its own."""
        secret = self._key or self._secret
        text = "\0".join(("kvxfer-ipc-done", transfer_id, sender, request)).encode("utf-8", "surrogatepass")
        return hmac.new(secret, text, "sha256").digest()[:_TOKEN_BYTES]

    def _bell_ring(self) -> BellRing | None:
        """Our doorbell ring, made on first use; None without doorbells (or if no ring can be
        made here: then sockets only, said once)."""
        if self._ring is None and self.doorbell:
            try:
                self._ring = BellRing()
            except OSError as exc:
                log.warning("IPC backend %s: no doorbell ring (%s); completions come over sockets only",
                            self.name, exc)
                self.doorbell = False
        return self._ring

    def _peer_bell(self, hint: Hint) -> tuple[str, int] | None:
        data = hint.extra(EXTRA_BELL)
        if data is None:
            return None
        path = self._peer_bell_paths.get(data[4:])  # a peer's hints repeat its ring's path
        if path is not None:
            slot = int.from_bytes(data[:4], "little")
            if slot < BELL_WORDS:
                return path, slot
        try:
            path, slot = parse_bell(data)
        except ValueError as exc:
            raise InvalidSubmission(str(exc)) from exc
        if len(self._peer_bell_paths) >= 1024:
            self._peer_bell_paths.clear()
        self._peer_bell_paths[data[4:]] = path
        return path, slot

    def _bell_target(self, job: _Active, rows: int) -> tuple[int, int]:
        """(address, value) of the store into the passive end's doorbell word, queued after the
        job's kernels; (0, 0) for none. Only when every row of its hint is being copied (the
        doorbell means DELIVERED, all rows). A ring that cannot be opened costs only the
        doorbell: the record still goes."""
        if job.bell is None or job.failure is not None or rows != sum(map(len, job.hint.groups)):
            return 0, 0
        token = self._frame_token(job)
        path, slot = job.bell
        if token is None or path in self._bad_bells:
            return 0, 0
        try:
            with self._map_lock:
                ring = self._mappings.acquire(job.hint.endpoint, bell_export(path), self._bell_opener)
        except (self._native.CopyError, OSError, RuntimeError) as exc:
            log.info("IPC backend %s: peer %r's doorbell ring is unusable (%s); sockets only", self.name,
                     job.hint.agent, exc)
            if len(self._bad_bells) >= 1024:
                self._bad_bells.clear()
            self._bad_bells.add(path)
            return 0, 0
        job.mappings.append(ring)
        return ring.base + 8 * slot, bell_value(token)

    def _delivered_frame(self, job: _Active) -> bytes | None:
        """What tells the passive end that every row of its hint is in place: 20 bytes when it
        gave us a token (or we share a key), else the full record; None if it cannot be encoded."""
        if all(m is constant_mask(len(m), True) or bool(m.all()) for m in job.peer_masks):
            frame = self._token_frame(job)
            if frame is not None:
                return frame
        return self._encode(self._delivered_record(job))

    def _token_frame(self, job: _Active) -> bytes | None:
        token = self._frame_token(job)
        return None if token is None else DONE_PREFIX + token

    def _frame_token(self, job: _Active) -> bytes | None:
        """Derived once per job (the doorbell's value, then the frame): signed, it is an HMAC."""
        if job.token is None:
            if self._key:
                job.token = self._done_token(job.hint.transfer_id, self.name, job.view.request)
            else:
                token = job.hint.extra(EXTRA_DONE)
                job.token = token if token is not None and len(token) == _TOKEN_BYTES else b""
        return job.token or None

    def _spin_send(self, job: _Active, spin_us: int, fd: int, data: bytes) -> int:
        done, sent = self._native.event_spin_send(job.event, spin_us, fd, data)
        return int(sent) if done else 0

    def _send_if_copied(self, job: _Active) -> None:
        """A small copy has often ended by now, or ends within microseconds: then the record
        goes to the peer from here, saving it the progress thread's wake-up. Waits at most
        OWNER_SPIN_US for the copy, and never for the socket (send_with() gives up instead)."""
        if job.frame is None or not job.event:
            return
        with job.send_lock:
            if job.sent:
                return
            spin_us = OWNER_SPIN_US if job.nbytes <= OWNER_SPIN_BYTES else 0
            try:
                # The wait and the socket write are one native call (no Python between them).
                job.sent = self._channel.send_with(job.hint.endpoint, job.frame,
                                                   functools.partial(self._spin_send, job, spin_us))
            except self._native.CopyError:
                return  # the progress thread reports it

    def _peer_exports(self, hint: Hint, matches: list[GroupMatch]) -> dict[str, Export]:
        exports: dict[str, Export] = {}
        for match in matches:
            peer = match.peer
            if peer is None or match.local_rows.size == 0:
                continue
            if peer.memory_kind is not MemoryKind.DEVICE:
                raise InvalidSubmission(f"peer group {peer.layer_group!r} is {peer.memory_kind.name} memory")
            data = hint.extra(EXTRA_PREFIX + peer.region)
            if data is None:
                raise InvalidSubmission(f"the peer's hint has no IPC handle for region {peer.region!r}")
            export = self._peer_export_cache.get(data)
            if export is None:
                try:
                    export = Export.unpack(data, peer.region)
                except ValueError as exc:
                    raise InvalidSubmission(str(exc)) from exc
                if len(self._peer_export_cache) >= 4096:
                    self._peer_export_cache.clear()
                self._peer_export_cache[data] = export
            offset = peer.address - export.alloc_base
            if offset < 0 or offset + peer.slot_bytes * peer.region_slots > export.alloc_size:
                raise InvalidSubmission(f"peer region {peer.region!r} lies outside the allocation it exported")
            exports[peer.region] = export
        return exports

    def _on_cancel(self, attempt: TrackedAttempt) -> None:
        self._channel.wake()

    # --- the progress thread ----------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._step()
            except Exception:  # keep serving the other attempts: a thread that died would hang them all
                log.exception("IPC backend %s: progress step failed", self.name)
                self._stop.wait(0.01)

    def _step(self) -> None:
        if self._in_flight:
            self._watch_head()
        busy = bool(self._in_flight)
        spun = not busy and self.busy_poll and bool(self._passive)
        if spun:
            # Returns as soon as a socket has input or a watched doorbell word is set.
            self._channel.spin(IDLE_WAIT_S, *self._bell_watch())
        if self._by_bell:
            self._check_bells()
        # While copies are in flight, look without sleeping: their events are polled, and
        # a sleep's granularity (or a driver callback's wake-up, measured slower on an
        # H200 host) would dominate a small transfer's latency.
        frames, gone = self._channel.wait(0.0 if busy or spun else IDLE_WAIT_S)
        if frames and self._by_bell:
            # A wait registered while we slept in wait() may have its doorbell and its
            # record both here now: the doorbell is stored before the record is sent, so
            # looking again first means it, not the record, ends the wait.
            self._check_bells()
        for frame in frames:  # first: a peer's record is what a waiting owner needs soonest
            self._on_frame(frame)
        gone += self._channel.flush()  # the rest of a record the owner thread began
        for peer in gone:
            self._on_peer_gone(peer)
        if self._unsent:
            self._send_unsent()
        with self._jobs_lock:
            stashed = [w for w in self._passive if w in self._stashed]
        for own_id in stashed:
            with self._jobs_lock:
                record = self._stashed.pop(own_id, None)
            if record is not None:
                self._on_record(record)
        self._poll_in_flight()
        self._check_passive()
        if busy:
            os.sched_yield()

    def _watch_head(self) -> None:
        """Wait up to HEAD_SPIN_US for the oldest copy's event, spinning natively with the GIL
        released: a full pass of the loop (socket poll, waits, deadlines) costs tens of
        microseconds of Python on a busy host, which would add as much to every small
        transfer, and a Python spin would take the GIL from an owner thread that is
        submitting the next request meanwhile."""
        job = self._in_flight[0]
        if not job.event:
            return
        try:
            self._native.event_spin_send(job.event, HEAD_SPIN_US, -1, b"")
        except self._native.CopyError:
            pass  # _poll_in_flight queries again and reports it

    def _bell_watch(self) -> tuple[np.ndarray | None, np.ndarray | None]:
        """(ring words, slots of the waits holding a doorbell) for the spin."""
        if self._ring is None or not self._by_bell:
            return None, None
        slots = self._bell_slots
        if slots is None:
            with self._jobs_lock:  # with the invalidation in _submit/_end_passive: none is lost
                slots = np.unique(np.fromiter((bell_slot(w.own_id) for w in self._by_bell.values()), np.int64))
                self._bell_slots = slots
        return self._ring.words, slots

    def _check_bells(self) -> None:
        """Conclude the waits whose doorbell rang (first: the bookkeeping after). A word holding
        no wait's value (a store of an earlier transfer of that slot, or anything else) is
        cleared and ignored: the socket record still ends its wait."""
        ring, slots = self._ring, self._bell_slots
        if ring is None:
            return
        if slots is None:
            slots = self._bell_watch()[1]
            if slots is None:
                return
        for _slot, value in ring.take(slots):
            wait = self._by_bell.get(value)
            if wait is None:
                continue
            self.bells_rung += 1  # before the outcome: whoever sees it concluded sees it counted
            if wait.attempt.poll() is None:
                # Concluded here, first: the owner waits for nothing of the bookkeeping below
                # (_on_token finds it concluded and only retires the wait).
                assert wait.delivered is not None
                wait.attempt.conclude(wait.delivered)
            self._on_token(wait.token)
            with self._jobs_lock:
                put_bounded(self._answered, wait.token, None, _EARLY_KEPT)  # its record will follow: dropped then

    def _on_frame(self, frame: bytes) -> None:
        if len(frame) == len(DONE_PREFIX) + _TOKEN_BYTES and frame.startswith(DONE_PREFIX):
            self._on_token(frame[len(DONE_PREFIX):])
            return
        try:
            record = decode_completion(frame, self._key)
        except WireError as exc:
            log.warning("IPC backend %s: dropped a completion record: %s", self.name, exc)
            return
        self._on_record(record)

    def _encode(self, record: CompletionRecord) -> bytes | None:
        try:
            return encode_completion(record, self._key)
        except WireError as exc:
            log.error("IPC backend %s: cannot encode a completion record: %s", self.name, exc)
            return None

    def _send(self, peer: bytes, record: CompletionRecord | None, frame: bytes | None = None) -> bool:
        """Send ``frame``, or ``record`` encoded when no frame is given. A peer that cannot be
        sent to is gone (the channel's rule): its mappings close and its waits fail, also when
        this is the first we hear of it (we had never connected to it before)."""
        if frame is None and record is not None:
            frame = self._encode(record)
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
            if peer in self._gone:
                continue
            try:
                if not self._channel.send(peer, frame):
                    self._on_peer_gone(peer)
            except PeerBusy:
                self._unsent.append((peer, frame))

    def _on_peer_gone(self, peer: bytes) -> None:
        with self._launch_lock:  # no launch into its mappings from here on
            self._gone.add(peer)
        with self._map_lock:
            self._mappings.peer_gone(peer)
        now = time.monotonic()
        with self._jobs_lock:
            waits = [w for w in self._passive.values() if w.hint.endpoint == peer]
        for wait in waits:
            wait.attempt.conclude(Failed(f"peer {wait.hint.agent!r} is gone", wait.view.row_masks()))
            wait.gone_at = now  # quiesced after the grace period (_check_passive)

    def _on_token(self, token: bytes) -> None:
        """A peer's "DELIVERED, every row" for the wait of this token (one dict lookup, no
        decoding); a token whose wait is not registered yet is kept for it."""
        with self._jobs_lock:
            wait = self._by_token.get(token)
            if wait is None:
                if token in self._answered:
                    del self._answered[token]  # its doorbell concluded it already
                    return
                put_bounded(self._early, token, None, _EARLY_KEPT)
                return
        if wait.attempt.poll() is None:
            assert wait.delivered is not None
            wait.attempt.conclude(wait.delivered)
        self._end_passive(wait)  # also when we gave up earlier: the peer has stopped

    def _on_record(self, record: CompletionRecord) -> None:
        if record.status is RecordStatus.CANCEL_REQUEST:
            self._on_cancel_request(record)
            return
        with self._jobs_lock:
            wait = self._passive.get(record.transfer_id)
            if wait is None:
                if not self._own.is_retired(record.transfer_id):
                    put_bounded(self._stashed, record.transfer_id, record, _KEPT)
                return
        if record.sender != wait.hint.agent or record.request != wait.view.request:
            return  # not from the peer this transfer was described to: ignore it
        if wait.attempt.poll() is not None:
            self._end_passive(wait)  # we gave up earlier; the peer now confirms it stopped
            return
        masks = record.masks
        if len(masks) != len(wait.view.groups) or any(m.shape != (len(g),) for m, g in zip(masks, wait.view.groups)):
            wait.attempt.conclude(Failed("peer sent a completion record of the wrong shape", wait.view.row_masks()))
        elif record.status is RecordStatus.DELIVERED:
            wait.attempt.conclude(Delivered(masks))
        elif record.status is RecordStatus.CANCELLED:
            wait.attempt.conclude(Cancelled(True, masks))
        else:
            wait.attempt.conclude(Failed(f"peer failed: {record.reason}", masks))
        self._end_passive(wait)

    def _on_cancel_request(self, record: CompletionRecord) -> None:
        # _launch_lock first (the order _submit takes them): a launch in progress finishes and
        # its job is in _in_flight before we look, so a job being launched is never missed
        # (which would tell the peer "withdrawn" while our kernels still touch its rows).
        with self._launch_lock, self._jobs_lock:
            jobs = [j for j in list(self._in_flight)
                    if j.hint.transfer_id == record.transfer_id and j.hint.agent == record.sender]
            if not jobs:
                # Nothing of ours touches the peer's rows; refuse to start later, and say so.
                put_bounded(self._revoked, (record.sender, record.transfer_id), None, _KEPT)
        for job in jobs:
            job.cancelled_by_peer = True
            job.attempt.cancel()
        if not jobs:
            self._send(record.sender.encode(), CompletionRecord(
                record.transfer_id, self.name, record.request, RecordStatus.CANCELLED, [], "withdrawn"))

    def _end_passive(self, wait: _Passive) -> None:
        with self._jobs_lock:
            self._passive.pop(wait.own_id, None)
            self._by_token.pop(wait.token, None)
            if wait.bell and self._by_bell.pop(wait.bell, None) is not None:
                self._bell_slots = None
        self._own.retire(wait.own_id)
        wait.attempt.mark_quiesced()

    def _check_passive(self) -> None:
        now = time.monotonic()
        with self._jobs_lock:
            waits = list(self._passive.values())
        for wait in waits:
            if wait.gone_at is not None:
                if now >= wait.gone_at + self.dead_peer_grace_s:
                    self._end_passive(wait)
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
            reason = None
            if wait.attempt.cancel_requested:
                wait.attempt.conclude(Cancelled(False, wait.view.row_masks()))
                reason = "cancelled"
            elif now > wait.deadline:
                wait.attempt.conclude(Failed(
                    f"timeout after {self.deadline_s:g}s waiting for peer {wait.hint.agent!r}", wait.view.row_masks()))
                reason = "timeout"
            if reason and not wait.told_peer:
                wait.told_peer = True
                # Stays unquiesced until the peer confirms that it stopped writing.
                # Records always name the passive end's id (ours); the active end holds it as hint.transfer_id.
                stop = CompletionRecord(wait.own_id, self.name, wait.view.request,
                                        RecordStatus.CANCEL_REQUEST, [], reason)
                if not self._send(wait.hint.endpoint, stop):
                    wait.gone_at = now

    # --- copies -------------------------------------------------------------------------
    def _launch(self, job: _Active) -> None:
        """Queue the job's kernels and its event (caller's thread, under _launch_lock). Every
        outcome is left to the progress thread, which finishes jobs in launch order. The last
        kernel, the doorbell store and the event go in one native call (cuda_copy_rows_then):
        on a small transfer each call through the binding, and the Python between two calls,
        costs microseconds."""
        copied: list[tuple[int, GroupMatch, int]] = []  # (group, match, rows) whose kernel is queued
        plan, rows = self._plan_launches(job)
        if not plan:
            self._set_masks(job, copied)
            return
        event, event_error = self._take_event()
        bell_ptr, bell_value = self._bell_target(job, rows)
        recorded = False
        for k, (gi, match, n, src, dst) in enumerate(plan):
            row = match.local.region.slot_bytes
            try:
                # Slot bounds were checked already: ours by check_view, the peer's by HintGroup
                # (and its region against the exported allocation), so the kernel is told -1.
                if k == len(plan) - 1 and event:
                    bell_error, error = self._native.cuda_copy_rows_then(
                        src[0], row, src[1], dst[0], row, dst[1], n, row, self._stream, self.device,
                        bell_ptr, bell_value, event)
                    if bell_error:
                        log.info("IPC backend %s: doorbell store failed (%s); the record still goes", self.name,
                                 bell_error)
                    recorded, event_error = not error, error or None
                else:
                    self._native.cuda_copy_rows(src[0], row, src[1], dst[0], row, dst[1], n, row, self._stream,
                                                self.device, -1, -1)
            except (self._native.CopyError, MemoryError, RuntimeError) as exc:
                # A large copy goes in chunks: some may be queued already. The job waits for
                # an event like any other before anything is reported (their rows stay False).
                job.failure = f"row copy launch failed: {exc}"
                job.launched = True
                break
            job.nbytes += n * row
            job.launched = True
            copied.append((gi, match, n))
        if event and not recorded and event_error is None:
            try:
                self._native.event_record(event, self._stream)
                recorded = True
            except self._native.CopyError as exc:
                event_error = str(exc)
        if recorded:
            job.event = event
        else:
            # Without an event we cannot tell when the kernels end: wait for the whole stream.
            if event:
                self._drop_event(event)
            job.failure = f"cannot record a completion event: {event_error}"
            try:
                self._native.stream_synchronize(self._stream)
            except self._native.CopyError as sync_exc:
                job.failure = f"the copy stream failed: {sync_exc}"
                copied = []
        self._set_masks(job, copied)

    def _plan_launches(self, job: _Active) -> tuple[list[tuple[int, GroupMatch, int, tuple, tuple]], int]:
        """(group, match, rows, src, dst) of each kernel to queue, with the peer's mappings
        acquired (held by the job), and the rows they copy; job.failure says why fewer rows
        than asked will move."""
        plan: list[tuple[int, GroupMatch, int, tuple, tuple]] = []
        if job.hint.endpoint in self._gone:
            job.failure = f"peer {job.hint.agent!r} is gone"
            return plan, 0
        total = sum(m.local_rows.size for m in job.matches if m.peer is not None)
        budget = total if self.fail_after_rows is None else min(total, self.fail_after_rows)
        if budget < total:
            job.failure = f"injected fault after {budget} rows"
        planned = 0
        for gi, match in enumerate(job.matches):
            peer = match.peer
            if budget <= 0 or peer is None or match.local_rows.size == 0:
                continue
            n = min(budget, match.local_rows.size)
            try:
                with self._map_lock:
                    mapping = self._mappings.acquire(job.hint.endpoint, job.exports[peer.region])
            except (self._native.CopyError, RuntimeError) as exc:
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

    def _take_event(self) -> tuple[int, str | None]:
        """A completion event (recycled, or new) and None; or 0 and why none could be made."""
        try:
            return (self._events.pop() if self._events else self._native.event_create(self.device)), None
        except self._native.CopyError as exc:
            return 0, str(exc)

    def _drop_event(self, event: int) -> None:
        """Destroy an event that must not be reused. One the driver refuses to destroy (its
        context is broken) is lost either way: logged, and shutdown goes on giving back the rest."""
        try:
            self._native.event_destroy(event)
        except self._native.CopyError as exc:
            log.warning("IPC backend %s: cannot destroy a completion event: %s", self.name, exc)

    @staticmethod
    def _set_masks(job: _Active, copied: list[tuple[int, GroupMatch, int]]) -> None:
        """The rows whose kernels are queued, set after queueing them so that this overlaps
        the copy; reported only after the event says the kernels finished. Read-only, so that
        outcomes and records take them without copying."""
        local: list[np.ndarray | None] = [None] * len(job.view.groups)
        peer: list[np.ndarray | None] = [None] * len(job.hint.groups)
        if copied:
            peer_index = {g.layer_group: i for i, g in enumerate(job.hint.groups)}
            for gi, match, n in copied:
                assert match.peer is not None
                local[gi] = _mask_of(len(match.local), match.local_rows, n)
                pi = peer_index[match.peer.layer_group]
                peer[pi] = _mask_of(len(job.hint.groups[pi]), match.peer_rows, n)
        job.local_masks = [m if m is not None else constant_mask(len(g), False) for m, g in zip(local, job.view.groups)]
        job.peer_masks = [m if m is not None else constant_mask(len(g), False) for m, g in zip(peer, job.hint.groups)]

    def _poll_in_flight(self) -> None:
        # One stream: events complete in queue order, so stop at the first pending one.
        while self._in_flight:
            job = self._in_flight[0]
            error = None
            if job.event:
                try:
                    if not self._native.event_query(job.event):
                        return
                except self._native.CopyError as exc:
                    error = f"the row copy failed on the device: {exc}"
            self._in_flight.popleft()
            self._finish(job, error)

    def _finish(self, job: _Active, device_error: str | None) -> None:
        with job.send_lock:
            owner_sent = job.sent
            job.sent = True  # from here on the owner thread sends nothing and leaves the event alone
        with self._map_lock:
            for mapping in job.mappings:
                self._mappings.release(mapping)
        job.mappings.clear()
        if job.event:
            if device_error is None:
                self._events.append(job.event)
            else:
                # Nothing says what state a device error left it in: reused, an event that still
                # reads complete would report the next job's rows delivered before its kernel ran.
                self._drop_event(job.event)
            job.event = 0
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

    def _delivered_record(self, job: _Active) -> CompletionRecord:
        return CompletionRecord(job.hint.transfer_id, self.name, job.view.request, RecordStatus.DELIVERED,
                                job.peer_masks, "")

    def _complete(self, job: _Active, status: RecordStatus, outcome: Delivered | Failed | Cancelled,
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
