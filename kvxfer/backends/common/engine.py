"""The skeleton every backend shares, so that each backend only plans, moves and proves rows.

``BackendEngine`` holds what the contract asks of every backend the same way: registered
regions, the hint a describe() gives, the checks a submission passes before anything moves
(closed, shape, audience and expiry, described, used, withdrawn by the peer), records that
came before their wait, and the first step of shutdown. Its subclasses keep their own job
tables and progress loops; they take ``_jobs_lock`` around the shared tables here.

The protocol the three backends keep: the active end (push: the publisher; pull: the
fetcher) moves the bytes, then sends a CompletionRecord naming the passive end's transfer
id; the passive end concludes from it (``conclude_from_record``), and when it is cancelled
or times out asks the active end to stop (``stop_request``), staying unquiesced until the
active end answers (``withdrawn`` when nothing of it had started).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from kvxfer.backends.common.attempt import TrackedAttempt, cancel_and_wait_quiet
from kvxfer.backends.common.matching import check_submission
from kvxfer.backends.common.regions import RegionTable
from kvxfer.backends.common.transfers import OwnTransfers, hint_groups, put_bounded
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

KEPT = 4096
"""Records that came before their wait, and transfers a peer withdrew: the newest kept (an
aborted request leaves one of each behind; a confused peer must not grow them)."""


@dataclass(frozen=True)
class Admission:
    """A submission that passed every check that touches nothing: this end's transfer id for
    the view, whether this end moves the bytes, and the attempt's label."""

    own_id: str
    active: bool
    label: str


class BackendEngine(Backend):
    """The contract's calls, checks and shared tables; see the module docstring."""

    KIND: ClassVar[str]  # Hint.backend of this backend's hints
    TITLE: ClassVar[str]  # how errors name it: "loopback", "IPC", "nixl"
    GEOMETRY: ClassVar[bool] = False  # moves KV between engine geometries (views with a geometry)

    name: str
    mode: TransferMode

    def _start_engine(self, name: str, mode: TransferMode, kinds: frozenset[MemoryKind], hint_ttl_s: float) -> None:
        self.name = name
        self.mode = mode
        self._kinds = kinds
        self._regions = RegionTable(kinds)
        self._own = OwnTransfers(name, hint_ttl_s)
        self._closed = False
        self._jobs_lock = threading.Lock()  # guards the subclass's job tables and the two below
        self._stashed: OrderedDict[str, CompletionRecord] = OrderedDict()  # by our transfer id
        self._revoked: OrderedDict[tuple[str, str], None] = OrderedDict()  # (peer agent, its transfer id)

    # --- the contract -----------------------------------------------------------------
    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(memory_kinds=self._kinds, modes=frozenset({TransferMode.PUSH, TransferMode.PULL}))

    @property
    def peer(self) -> Peer:
        return self._own.peer

    def fetch(self, view: View, hint: Hint, wake: WakeFn | None = None) -> TrackedAttempt:
        return self._submit(view, hint, wake, fetching=True)

    def publish(self, view: View, hint: Hint, wake: WakeFn | None = None) -> TrackedAttempt:
        return self._submit(view, hint, wake, fetching=False)

    def withdraw(self, hint: Hint) -> bool:
        return self._own.withdraw(hint)

    def _submit(self, view: View, hint: Hint, wake: WakeFn | None, *, fetching: bool) -> TrackedAttempt:
        raise NotImplementedError

    # --- registration and describe() -----------------------------------------------
    def _reachable(self, regions: Iterable[SlotRegion]) -> tuple[list[SlotRegion], tuple[SlotRegion, ...]]:
        """(regions this backend can reach, not registered yet checked, the skipped ones)."""
        self._refuse_if_closed()
        batch, skipped = self._regions.reachable(regions)
        return list(batch), skipped

    def _describe_checked(self, view: View) -> str:
        """Check ``view`` as a fetch would, then mint its transfer id. A hint exposes its rows
        (in push mode to a one-sided WRITE that no later refusal can take back), so a view a
        submission would refuse is refused here."""
        self._refuse_if_closed()
        self._refuse_geometry(view)
        self._regions.check_view(view, for_fetch=True)
        return self._own.mint(view)

    def _hint(self, view: View, transfer_id: str, audience: Peer | None, *, endpoint: bytes = b"",
              extras: tuple[tuple[str, bytes], ...] = ()) -> Hint:
        return Hint(
            backend=self.KIND, mode=self.mode, agent=self.name, request=view.request,
            transfer_id=transfer_id, layout=view.layout, groups=hint_groups(view),
            endpoint=endpoint, extras=extras,
            run=self._own.peer.run, audience=audience, expires_ms=self._own.expiry(),
            geometry=view.geometry, tokens=view.tokens if view.geometry is not None else None,
        )

    # --- submission checks (the owner's thread) -----------------------------------------
    def _refuse_geometry(self, view: View) -> None:
        if view.geometry is not None and not self.GEOMETRY:
            raise InvalidSubmission(f"the {self.KIND} backend moves pool rows only, not an engine's own KV "
                                    "(a view with a geometry): use the nixl, ipc or loopback backend")

    def _refuse_if_closed(self) -> None:
        if self._closed:
            raise SubmissionRejected(f"{self.TITLE} backend {self.name!r} is shut down")

    def _check_peer_hint(self, hint: Hint) -> None:
        """What this transport needs of a peer's hint beyond the contract (raise InvalidSubmission)."""

    def _admit(self, view: View, hint: Hint, *, fetching: bool) -> Admission:
        """Every check that needs no lock and touches nothing; InvalidSubmission or
        SubmissionRejected names what is wrong."""
        self._refuse_if_closed()
        self._refuse_geometry(view)
        check_submission(view, hint, self._regions, self.KIND, self.mode, fetching=fetching)
        self._own.check_for_us(hint)
        self._check_peer_hint(hint)
        own_id = self._own.lookup(view)
        active = fetching == (self.mode is TransferMode.PULL)
        return Admission(own_id, active, f"{self.name}:{'fetch' if fetching else 'publish'}:{view.request}")

    def _claim(self, hint: Hint, attempt: TrackedAttempt) -> None:
        """With ``_jobs_lock`` held, before anything is posted: the peer's hint is unused and not
        withdrawn, and from now on counts as used by ``attempt`` (``withdraw`` trusts it)."""
        self._refuse_if_closed()
        self._own.check_usable(hint)
        if (hint.agent, hint.transfer_id) in self._revoked:
            raise InvalidSubmission(
                f"peer {hint.agent!r} withdrew transfer {hint.transfer_id} (cancelled or timed out): describe again")
        self._own.use(hint, attempt)

    # --- records ----------------------------------------------------------------------
    def _stash(self, record: CompletionRecord) -> None:
        """With ``_jobs_lock`` held: a record whose wait is not registered (yet) is kept for it,
        unless its transfer ended already (then it is stale)."""
        if not self._own.is_retired(record.transfer_id):
            put_bounded(self._stashed, record.transfer_id, record, KEPT)

    def _revoke(self, record: CompletionRecord) -> None:
        """With ``_jobs_lock`` held: the peer withdrew a transfer nothing of ours has touched;
        a later submission of its hint is refused."""
        put_bounded(self._revoked, (record.sender, record.transfer_id), None, KEPT)

    def _withdrawn(self, record: CompletionRecord) -> CompletionRecord:
        """The answer to a CANCEL_REQUEST for a transfer nothing of ours has touched."""
        return CompletionRecord(record.transfer_id, self.name, record.request, RecordStatus.CANCELLED, [],
                                "withdrawn")

    def _stop_request(self, own_id: str, request: str, reason: str) -> CompletionRecord:
        """A passive end's CANCEL_REQUEST: records always name the passive end's id (ours),
        which the active end holds as its hint's transfer_id."""
        return CompletionRecord(own_id, self.name, request, RecordStatus.CANCEL_REQUEST, [], reason)

    # --- shutdown ---------------------------------------------------------------------
    def _close_and_cancel(self, attempts: Callable[[], list[TrackedAttempt]], kick: Callable[[], None]) -> bool:
        """Shutdown's first step: refuse new work, cancel every attempt and give peers a
        moment to confirm (``cancel_and_wait_quiet``). False when an earlier call did it."""
        with self._jobs_lock:
            first = not self._closed
            self._closed = True
            pending = attempts()
        if first:
            cancel_and_wait_quiet(pending, kick)
        return first


def conclude_from_record(attempt: TrackedAttempt, view: View, record: CompletionRecord,
                         check: Callable[[list, CompletionRecord], str | None] | None = None) -> None:
    """A passive wait's outcome from the active end's record (no-op once concluded). The
    record's masks say which of our rows are in place; a record of the wrong shape proves
    nothing. ``check`` (a fetcher with integrity on): given writable copies of the masks and
    the record, drops the rows whose bytes fail their digest and says why (None: all good);
    such an outcome is never Delivered."""
    if attempt.poll() is not None:
        return
    masks = record.masks
    if record.status is RecordStatus.CANCELLED and not masks:
        attempt.conclude(Cancelled(True, view.row_masks()))
        return
    if len(masks) != len(view.groups) or any(m.shape != (len(g),) for m, g in zip(masks, view.groups)):
        attempt.conclude(Failed("peer sent a completion record of the wrong shape", view.row_masks()))
        return
    bad = None
    if check is not None:
        checked = [np.array(m, dtype=np.bool_) for m in masks]
        bad = check(checked, record)
        masks = tuple(checked)
    if record.status is RecordStatus.DELIVERED:
        attempt.conclude(Delivered(masks) if bad is None else Failed(bad, masks))
    elif record.status is RecordStatus.CANCELLED:
        attempt.conclude(Cancelled(True, masks))
    else:
        attempt.conclude(Failed(f"peer failed: {record.reason}" + (f"; {bad}" if bad else ""), masks))


def stop_reason(attempt: TrackedAttempt, masks: Callable[[], list], now: float, deadline: float,
                deadline_s: float, peer: str) -> str | None:
    """Conclude a passive wait that was cancelled or ran past its deadline; the reason to send
    the active end with the stop request, or None."""
    if attempt.poll() is not None:
        return None
    if attempt.cancel_requested:
        attempt.conclude(Cancelled(False, masks()))
        return "cancelled"
    if now > deadline:
        attempt.conclude(Failed(f"timeout after {deadline_s:g}s waiting for peer {peer!r}", masks()))
        return "timeout"
    return None


class ProgressThread:
    """A backend's progress thread: calls ``step`` (True while work is pending) until asked to
    stop, then ``pause(busy)`` between steps. A step that raises is logged and the loop goes
    on: a thread that died would leave every other attempt hanging. Backends pass
    ``lambda: self._step()`` so that a test holding the thread (``kvxfer.testing.progress_hold``)
    can replace the step."""

    def __init__(self, name: str, step: Callable[[], bool], pause: Callable[[bool], None],
                 log_failure: Callable[[], None]) -> None:
        self._step = step
        self._pause = pause
        self._log_failure = log_failure
        self.stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        while not self.stopping.is_set():
            try:
                busy = self._step()
            except Exception:
                self._log_failure()
                self.stopping.wait(0.01)
                continue
            self._pause(busy)

    def stop(self, wake: Callable[[], None], timeout_s: float) -> bool:
        """Ask the loop to end, wake it, and wait up to ``timeout_s``; True once it has exited."""
        self.stopping.set()
        wake()
        self._thread.join(timeout=timeout_s)
        return not self._thread.is_alive()

    def is_alive(self) -> bool:
        return self._thread.is_alive()
