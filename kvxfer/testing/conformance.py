"""The conformance kit: checks that a backend keeps the rules of DESIGN.md §3.

Give it a factory for a connected pair: the backend under test (``local``, driven by the
kit in this process) and the other end (``peer``, a :class:`PeerEnd`, which may live in
another process). Each check is a function ``check_x(make_pair, mode)``; ``CHECKS`` lists
them for ``pytest.mark.parametrize``::

    @pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
    @pytest.mark.parametrize("mode", list(TransferMode), ids=lambda m: m.value)
    def test_conformance(check, mode):
        check(make_my_pair, mode)

The kit runs the local backend both as publisher and as fetcher, and asserts what a lease
holder relies on: destination bytes, exact masks, named rejections that touch nothing and
tell the peer nothing, a peer's hint moving bytes once, conclusion and quiescence without
polling, honest partial delivery and shutdown sets.
"""

from __future__ import annotations

import abc
import dataclasses
import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from kvxfer.contract import (
    Attempt,
    Backend,
    CacheKind,
    Cancelled,
    Delivered,
    Failed,
    Hint,
    InvalidSubmission,
    LayerGroupRows,
    MemoryKind,
    Outcome,
    Peer,
    SlotRegion,
    SubmissionRejected,
    TokenRange,
    TransferMode,
    View,
)
from kvxfer.testing.memory import RowMemory

TIMEOUT = 15.0
REFUSAL_GRACE = 0.4  # how long a peer waits, during a refusal, for news it must not get
Index = npt.NDArray[np.int64]


class PeerEnd(abc.ABC):
    """The other end of a pair, as the kit drives it. May proxy a backend in another process."""

    regions: tuple[SlotRegion, ...]

    @abc.abstractmethod
    def describe(self, view: View, audience: Peer | None = None) -> Hint: ...

    @abc.abstractmethod
    def start(self, op: str, view: View, hint: Hint) -> int:
        """Submit ``op`` ("fetch" or "publish") and return a handle."""

    @abc.abstractmethod
    def result(self, handle: int, timeout: float) -> tuple[Outcome | None, bool]:
        """Wait up to ``timeout`` for conclusion and quiescence; return (outcome, quiesced)."""

    @abc.abstractmethod
    def cancel(self, handle: int) -> None: ...

    @abc.abstractmethod
    def write(self, region: str, slots: Index, data: bytes) -> None: ...

    @abc.abstractmethod
    def read(self, region: str, slots: Index) -> bytes: ...

    def inject_fault(self, rows: int | None) -> bool:
        """Make the peer's next transfers fail after ``rows`` rows; False when unsupported."""
        return False

    @abc.abstractmethod
    def shutdown(self) -> int:
        """Shut the peer's backend down; return how many attempts were not quiesced."""


class InProcessPeer(PeerEnd):
    """A PeerEnd over a backend in this process."""

    def __init__(self, backend: Backend, memory: RowMemory, regions: tuple[SlotRegion, ...],
                 inject: Callable[[int | None], None] | None = None) -> None:
        self.backend = backend
        self.memory = memory
        self.regions = regions
        self._inject = inject
        self._attempts: dict[int, Attempt] = {}

    def describe(self, view: View, audience: Peer | None = None) -> Hint:
        return self.backend.describe(view, audience)

    def start(self, op: str, view: View, hint: Hint) -> int:
        attempt = self.backend.fetch(view, hint) if op == "fetch" else self.backend.publish(view, hint)
        handle = len(self._attempts) + 1
        self._attempts[handle] = attempt
        return handle

    def result(self, handle: int, timeout: float) -> tuple[Outcome | None, bool]:
        attempt = self._attempts[handle]
        end = time.monotonic() + timeout
        while time.monotonic() < end and not (attempt.poll() is not None and attempt.quiesced()):
            time.sleep(0.001)
        return attempt.poll(), attempt.quiesced()

    def cancel(self, handle: int) -> None:
        self._attempts[handle].cancel()

    def write(self, region: str, slots: Index, data: bytes) -> None:
        self.memory.write(region, slots, data)

    def read(self, region: str, slots: Index) -> bytes:
        return self.memory.read(region, slots)

    def inject_fault(self, rows: int | None) -> bool:
        if self._inject is None:
            return False
        self._inject(rows)
        return True

    def shutdown(self) -> int:
        return len(self.backend.shutdown())


@dataclass
class Pair:
    """A connected pair: ``local`` is under test; ``peer`` is the other end."""

    local: Backend
    local_memory: RowMemory
    local_regions: tuple[SlotRegion, ...]
    peer: PeerEnd
    mode: TransferMode
    inject_local_fault: Callable[[int | None], None] | None = None
    close: Callable[[], None] = field(default=lambda: None)


PairFactory = Callable[[TransferMode], Pair]


class _Waker:
    """A wake callback that records what was visible each time it was called."""

    def __init__(self) -> None:
        self.attempt: Attempt | None = None
        self.seen: list[tuple[bool, bool]] = []
        self.event = threading.Event()
        self.lock = threading.Lock()

    def __call__(self) -> None:
        with self.lock:
            attempt = self.attempt
        if attempt is None:  # called during submit, before the attempt was returned
            self.seen.append((False, False))
            return
        done = attempt.poll() is not None, attempt.quiesced()
        self.seen.append(done)
        if all(done):
            self.event.set()

    def bind(self, attempt: Attempt) -> None:
        with self.lock:
            self.attempt = attempt
        self()  # the change may have been reported before we could see the attempt

    def wait(self) -> bool:
        return self.event.wait(TIMEOUT)


# --- building transfers ---------------------------------------------------------------

def _rng(seed: int) -> np.random.Generator:
    return np.random.default_rng(seed)


def _groups(pair: Pair) -> list[tuple[str, SlotRegion, SlotRegion]]:
    n = min(2, len(pair.local_regions), len(pair.peer.regions))
    assert n >= 1, "a pair needs at least one region at each end"
    out = []
    for i in range(n):
        local, peer = pair.local_regions[i], pair.peer.regions[i]
        assert local.slot_bytes == peer.slot_bytes, "regions paired by position must have equal slots"
        out.append((f"g{i}", local, peer))
    return out


@dataclass
class _Plan:
    """One transfer: per group, which slots at each end hold which ordinals."""

    local_view: View
    peer_view: View
    payload: dict[str, bytes]          # group -> bytes of the source rows, in ordinal order
    local_slots: dict[str, Index]
    peer_slots: dict[str, Index]


def _scatter(rng: np.random.Generator, slots: int, n: int) -> Index:
    return np.sort(rng.choice(slots, size=n, replace=False)).astype(np.int64)[rng.permutation(n)]


def _plan(pair: Pair, request: str, rows: int, seed: int, local_missing: int = 0, peer_missing: int = 0) -> _Plan:
    """Scattered rows in each group; ``*_missing`` drops that many ordinals from one end's view."""
    rng = _rng(seed)
    local_groups, peer_groups = [], []
    payload, local_slots, peer_slots = {}, {}, {}
    for name, local_region, peer_region in _groups(pair):
        n = min(rows, local_region.slots, peer_region.slots)
        ordinals = np.arange(n, dtype=np.int64)
        ls, ps = _scatter(rng, local_region.slots, n), _scatter(rng, peer_region.slots, n)
        keep_local = slice(local_missing, n)
        keep_peer = slice(0, n - peer_missing)
        local_groups.append(LayerGroupRows(name, CacheKind.PAGED, local_region, ls[keep_local], ordinals[keep_local]))
        peer_groups.append(LayerGroupRows(name, CacheKind.PAGED, peer_region, ps[keep_peer], ordinals[keep_peer]))
        payload[name] = rng.integers(0, 256, size=n * local_region.slot_bytes, dtype=np.uint8).tobytes()
        local_slots[name], peer_slots[name] = ls, ps
    tokens = TokenRange(0, rows * 16)
    return _Plan(View(request, tokens, tuple(local_groups), b"kit-layout"),
                 View(request, tokens, tuple(peer_groups), b"kit-layout"), payload, local_slots, peer_slots)


def _fill(pair: Pair, plan: _Plan, local_is_source: bool) -> None:
    """Source rows get the payload; destination rows get a sentinel pattern."""
    for name, local_region, peer_region in _groups(pair):
        n = plan.local_slots[name].size
        sentinel = bytes([0xA5]) * (n * local_region.slot_bytes)
        if local_is_source:
            pair.local_memory.write(local_region.name, plan.local_slots[name], plan.payload[name])
            pair.peer.write(peer_region.name, plan.peer_slots[name], sentinel)
        else:
            pair.peer.write(peer_region.name, plan.peer_slots[name], plan.payload[name])
            pair.local_memory.write(local_region.name, plan.local_slots[name], sentinel)


def _dest_rows(pair: Pair, plan: _Plan, local_is_source: bool, name: str) -> list[bytes]:
    local_region, peer_region = next((lr, pr) for g, lr, pr in _groups(pair) if g == name)
    size = local_region.slot_bytes
    if local_is_source:
        data = pair.peer.read(peer_region.name, plan.peer_slots[name])
    else:
        data = pair.local_memory.read(local_region.name, plan.local_slots[name])
    return [data[i * size:(i + 1) * size] for i in range(len(data) // size)]


def _source_rows(plan: _Plan, name: str, size: int) -> list[bytes]:
    data = plan.payload[name]
    return [data[i * size:(i + 1) * size] for i in range(len(data) // size)]


@dataclass
class _Run:
    local_attempt: Attempt
    waker: _Waker
    peer_handle: int
    peer_hint: Hint


def _start(pair: Pair, plan: _Plan, local_op: str) -> _Run:
    local_hint = pair.local.describe(plan.local_view)
    peer_hint = pair.peer.describe(plan.peer_view)
    peer_op = "publish" if local_op == "fetch" else "fetch"
    waker = _Waker()
    handle = pair.peer.start(peer_op, plan.peer_view, local_hint)
    submit = pair.local.fetch if local_op == "fetch" else pair.local.publish
    attempt = submit(plan.local_view, peer_hint, waker)
    waker.bind(attempt)
    return _Run(attempt, waker, handle, peer_hint)


def _finish(pair: Pair, run: _Run) -> tuple[Outcome, Outcome | None]:
    assert run.waker.wait(), "local attempt did not conclude and quiesce by itself (nobody polled)"
    outcome = run.local_attempt.poll()
    assert outcome is not None and run.local_attempt.quiesced()
    peer_outcome, peer_quiet = pair.peer.result(run.peer_handle, TIMEOUT)
    assert peer_outcome is not None and peer_quiet, "peer attempt did not conclude and quiesce"
    return outcome, peer_outcome


def _check_masks_honest(pair: Pair, plan: _Plan, local_is_source: bool, outcome: Outcome, view: View) -> None:
    """Every row a mask says arrived has exactly the source bytes at the destination. (A row
    it says did not may still have been written: an end that stops before its peer's record
    comes, as a cancelled wait does, cannot know and reports it not proven.)"""
    for gi, group in enumerate(view.groups):
        name = group.layer_group
        region = group.region
        src = _source_rows(plan, name, region.slot_bytes)
        dst = _dest_rows(pair, plan, local_is_source, name)
        ordinals = group.ordinals
        for row in np.flatnonzero(outcome.masks[gi]).tolist():
            o = int(ordinals[row])
            assert dst[o] == src[o], f"group {name} ordinal {o} marked delivered but bytes differ"


def _roles() -> tuple[tuple[str, bool], ...]:
    return (("fetch", False), ("publish", True))


# --- the checks -----------------------------------------------------------------------

def check_round_trip_exact(make_pair: PairFactory, mode: TransferMode) -> None:
    """Scattered rows in two groups arrive byte for byte; masks are all True at both ends."""
    for local_op, local_is_source in _roles():
        pair = make_pair(mode)
        try:
            plan = _plan(pair, f"rt-{local_op}", rows=24, seed=1)
            _fill(pair, plan, local_is_source)
            outcome, peer_outcome = _finish(pair, _start(pair, plan, local_op))
            assert isinstance(outcome, Delivered), outcome
            assert isinstance(peer_outcome, Delivered), peer_outcome
            assert all(m.dtype == np.bool_ and m.all() for m in outcome.masks)
            assert [m.size for m in outcome.masks] == [len(g) for g in plan.local_view.groups]
            for name, region, _ in _groups(pair):
                assert _dest_rows(pair, plan, local_is_source, name) == _source_rows(plan, name, region.slot_bytes)
        finally:
            pair.close()


def check_wake_after_visible(make_pair: PairFactory, mode: TransferMode) -> None:
    """wake runs only once a change is visible; the last wake sees outcome and quiescence."""
    for local_op, local_is_source in _roles():
        pair = make_pair(mode)
        try:
            plan = _plan(pair, f"wake-{local_op}", rows=8, seed=2)
            _fill(pair, plan, local_is_source)
            run = _start(pair, plan, local_op)
            _finish(pair, run)
            seen = [s for s in run.waker.seen]
            assert seen and seen[-1] == (True, True), seen
            # Visible state only moves forward between wakes.
            for before, after in zip(seen, seen[1:]):
                assert after[0] >= before[0] and after[1] >= before[1], seen
        finally:
            pair.close()


def check_outcome_is_final(make_pair: PairFactory, mode: TransferMode) -> None:
    """Once set, poll() returns the same outcome object forever."""
    pair = make_pair(mode)
    try:
        plan = _plan(pair, "final", rows=4, seed=3)
        _fill(pair, plan, False)
        run = _start(pair, plan, "fetch")
        outcome, _ = _finish(pair, run)
        run.local_attempt.cancel()  # cancelling a concluded attempt changes nothing
        for _ in range(50):
            assert run.local_attempt.poll() is outcome
        assert run.local_attempt.quiesced()
    finally:
        pair.close()


def check_unregistered_region_refused(make_pair: PairFactory, mode: TransferMode) -> None:
    """Rows in a region the backend never registered: InvalidSubmission, nothing touched."""
    for local_op, local_is_source in _roles():
        pair = make_pair(mode)
        try:
            plan = _plan(pair, f"unreg-{local_op}", rows=4, seed=4)
            _fill(pair, plan, local_is_source)
            peer_hint = pair.peer.describe(plan.peer_view)
            g = plan.local_view.groups[0]
            stranger = SlotRegion("not-registered", g.region.address, g.region.slot_bytes, g.region.slots,
                                  MemoryKind.HOST if g.region.memory_kind is MemoryKind.DEVICE else MemoryKind.DEVICE)
            bad = View(plan.local_view.request, plan.local_view.tokens,
                       (LayerGroupRows(g.layer_group, g.kind, stranger, g.slots, g.ordinals),) + plan.local_view.groups[1:],
                       plan.local_view.layout)
            _expect_refusal(pair, plan, local_op, local_is_source, bad, peer_hint)
        finally:
            pair.close()


def check_unknown_slot_refused(make_pair: PairFactory, mode: TransferMode) -> None:
    """A slot beyond the registered region is not skipped: InvalidSubmission, nothing touched."""
    # One past the end, and negative (numpy would wrap it around to the last slot).
    for (local_op, local_is_source), past_end in itertools.product(_roles(), (True, False)):
        pair = make_pair(mode)
        try:
            plan = _plan(pair, f"oob-{local_op}", rows=4, seed=5)
            _fill(pair, plan, local_is_source)
            peer_hint = pair.peer.describe(plan.peer_view)
            g = plan.local_view.groups[0]
            slots = g.slots.copy()
            slots[-1] = g.region.slots if past_end else -1
            bad = View(plan.local_view.request, plan.local_view.tokens,
                       (LayerGroupRows(g.layer_group, g.kind, g.region, slots, g.ordinals),) + plan.local_view.groups[1:],
                       plan.local_view.layout)
            _expect_refusal(pair, plan, local_op, local_is_source, bad, peer_hint)
        finally:
            pair.close()


def check_overlapping_fetch_refused(make_pair: PairFactory, mode: TransferMode) -> None:
    """Two rows of one fetch in the same slot: InvalidSubmission, nothing touched."""
    pair = make_pair(mode)
    try:
        plan = _plan(pair, "overlap", rows=4, seed=6)
        _fill(pair, plan, False)
        peer_hint = pair.peer.describe(plan.peer_view)
        g = plan.local_view.groups[0]
        slots = g.slots.copy()
        slots[1] = slots[0]
        bad = View(plan.local_view.request, plan.local_view.tokens,
                   (LayerGroupRows(g.layer_group, g.kind, g.region, slots, g.ordinals),) + plan.local_view.groups[1:],
                   plan.local_view.layout)
        _expect_refusal(pair, plan, "fetch", False, bad, peer_hint)
    finally:
        pair.close()


def check_describe_refuses_what_a_submission_would(make_pair: PairFactory, mode: TransferMode) -> None:
    """describe() refuses every view that fetch() or publish() would refuse (overlapping rows,
    an unregistered region, a slot out of bounds), so that no hint ever exposes such rows: in
    push mode the fetcher's hint lets the peer WRITE before the fetch itself is checked."""
    pair = make_pair(mode)
    try:
        plan = _plan(pair, "describe-bad", rows=4, seed=23)
        g = plan.local_view.groups[0]
        overlapping = g.slots.copy()
        overlapping[1] = overlapping[0]
        stranger = SlotRegion("not-registered", g.region.address + g.region.nbytes * 64, g.region.slot_bytes,
                              g.region.slots, g.region.memory_kind, g.region.device_id)
        bad_groups = {
            "overlapping rows": LayerGroupRows(g.layer_group, g.kind, g.region, overlapping, g.ordinals),
            "an unregistered region": LayerGroupRows(g.layer_group, g.kind, stranger, g.slots, g.ordinals),
            "a slot out of bounds": LayerGroupRows(g.layer_group, g.kind, g.region,
                                                   g.slots + g.region.slots, g.ordinals),
        }
        for what, group in bad_groups.items():
            bad = View(plan.local_view.request, plan.local_view.tokens, (group,) + plan.local_view.groups[1:],
                       plan.local_view.layout)
            try:
                hint = pair.local.describe(bad)
            except InvalidSubmission:
                continue
            raise AssertionError(f"describe() of a view with {what} returned a hint for transfer {hint.transfer_id}")
    finally:
        pair.close()


def check_register_skips_unreachable_kinds(make_pair: PairFactory, mode: TransferMode) -> None:
    """register() given a batch of mixed memory kinds registers those it reaches and returns
    the others (by the seed's contract), and moving rows of the reachable ones still works."""
    pair = make_pair(mode)
    try:
        reached = pair.local.capabilities.memory_kinds
        far = 1 << 56  # far from any real allocation, so only its kind can decide
        others = tuple(SlotRegion(f"unreachable-{kind.value}", far + i * (1 << 40), 4096, 4, kind)
                       for i, kind in enumerate(MemoryKind) if kind not in reached)
        skipped = pair.local.register(list(pair.local_regions) + list(others))
        assert tuple(skipped) == others, f"register() of a mixed batch returned {skipped!r}, expected {others!r}"
    finally:
        pair.close()
    check_round_trip_exact(lambda m: _registered_again(make_pair(m)), mode)


def _registered_again(pair: Pair) -> Pair:
    """``pair`` after its local end registered its own regions once more (taken as they are)."""
    skipped = pair.local.register(pair.local_regions)
    assert not skipped, f"register() skipped regions it had taken: {skipped!r}"
    return pair


def check_layout_mismatch_refused(make_pair: PairFactory, mode: TransferMode) -> None:
    """A peer of another layout identity is refused before any byte moves."""
    for local_op, local_is_source in _roles():
        pair = make_pair(mode)
        try:
            plan = _plan(pair, f"layout-{local_op}", rows=4, seed=7)
            _fill(pair, plan, local_is_source)
            other = View(plan.peer_view.request, plan.peer_view.tokens, plan.peer_view.groups, b"another-layout")
            peer_hint = pair.peer.describe(other)
            _expect_refusal(pair, plan, local_op, local_is_source, plan.local_view, peer_hint)
        finally:
            pair.close()


def _expect_refusal(pair: Pair, plan: _Plan, local_op: str, local_is_source: bool, view: View, hint: Hint,
                    what: str = "a bad submission", warm: bool = True) -> None:
    """``local_op`` of ``view`` with ``hint`` raises InvalidSubmission and lets nothing escape:
    no row at either end changes, wake never runs, no attempt is left behind, and the peer is
    told nothing. The last is only observable while the peer has an attempt for this
    transfer running, so when the local end is the active one the peer's passive attempt (its
    fetch in push, its publish in pull) waits during the refusal and must not conclude. (When
    the local end is passive the peer would be the active end, which moves bytes whatever
    this end does; it is not started.) ``warm=False``: the ends have moved rows together
    already, and the caller's rows are kept as they are."""
    local_active = (local_op == "publish") == (pair.mode is TransferMode.PUSH)
    peer_op = "fetch" if local_op == "publish" else "publish"
    if local_active and warm:
        # A transfer first, so that the two ends know each other: an end that has never
        # reached its peer could not tell it anything, nor answer its withdrawal below (a
        # NIXL end answers only peers whose metadata it loaded).
        earlier = _plan(pair, f"{plan.local_view.request}-warm", rows=4, seed=99)
        _fill(pair, earlier, local_is_source)
        _finish(pair, _start(pair, earlier, local_op))
        _fill(pair, plan, local_is_source)
    before_local = {n: pair.local_memory.read(lr.name, plan.local_slots[n]) for n, lr, _ in _groups(pair)}
    before_peer = {n: pair.peer.read(pr.name, plan.peer_slots[n]) for n, _, pr in _groups(pair)}
    handle = pair.peer.start(peer_op, plan.peer_view, pair.local.describe(plan.local_view)) if local_active else None
    try:
        pair.local.describe(view)
    except InvalidSubmission:
        pass  # a backend may refuse to describe rows it does not recognize, too
    submit = pair.local.fetch if local_op == "fetch" else pair.local.publish
    waker = _Waker()
    try:
        attempt = submit(view, hint, waker)
    except InvalidSubmission:
        pass
    else:
        raise AssertionError(f"{local_op} of {what} returned {attempt!r} instead of raising InvalidSubmission")
    if handle is None:
        time.sleep(0.05)
    else:
        # Anything the refusing end sent about this transfer would reach the waiting peer well
        # within the grace (the other checks see whole transfers conclude in less).
        told, _ = pair.peer.result(handle, REFUSAL_GRACE)
        assert told is None, f"refusing {what} told the peer: its waiting {peer_op} concluded {told!r}"
    assert not waker.seen, "a refused submission called wake"
    for when in ("just after the refusal", "once this end shut down"):
        for n, lr, pr in _groups(pair):
            assert pair.local_memory.read(lr.name, plan.local_slots[n]) == before_local[n], \
                f"refusal of {what} touched local rows ({when})"
            assert pair.peer.read(pr.name, plan.peer_slots[n]) == before_peer[n], \
                f"refusal of {what} touched peer rows ({when})"
        if when == "just after the refusal":
            if handle is not None:
                # Withdrawn while this end is up to answer, so that the check ends quiesced;
                # withdrawn by the peer itself, so any other ending came from the refusing end.
                pair.peer.cancel(handle)
                outcome, quiet = pair.peer.result(handle, TIMEOUT)
                assert outcome is not None and quiet, "the peer's withdrawn wait did not conclude and quiesce"
                assert isinstance(outcome, Cancelled) and not outcome.by_peer, \
                    f"the peer's withdrawn {peer_op} ended {outcome!r}: the refusing end told it something"
            # Whatever a backend might still do later, it has done once it has shut down.
            assert pair.local.shutdown() == frozenset(), "a refused submission left an attempt behind"
    assert not waker.seen, "a refused submission called wake"


def check_hint_used_once(make_pair: PairFactory, mode: TransferMode) -> None:
    """A peer's hint moves bytes once: after a transfer, the active end's second submission
    with the same hint (a replay, or a retry after the peer reused its rows) is refused with
    InvalidSubmission and the destination keeps the first transfer's bytes."""
    local_op = "publish" if mode is TransferMode.PUSH else "fetch"  # the end that moves bytes
    local_is_source = local_op == "publish"
    pair = make_pair(mode)
    try:
        plan = _plan(pair, f"once-{local_op}", rows=8, seed=15)
        _fill(pair, plan, local_is_source)
        run = _start(pair, plan, local_op)
        outcome, peer_outcome = _finish(pair, run)
        assert isinstance(outcome, Delivered) and isinstance(peer_outcome, Delivered), (outcome, peer_outcome)
        first = {name: _dest_rows(pair, plan, local_is_source, name) for name, _, _ in _groups(pair)}
        for name, region, _ in _groups(pair):
            assert first[name] == _source_rows(plan, name, region.slot_bytes), f"first transfer: group {name} differs"
        # New source bytes, so that a replay that moved rows would show at the destination.
        for name, local_region, peer_region in _groups(pair):
            fresh = bytes(b ^ 0xFF for b in plan.payload[name])
            if local_is_source:
                pair.local_memory.write(local_region.name, plan.local_slots[name], fresh)
            else:
                pair.peer.write(peer_region.name, plan.peer_slots[name], fresh)
        # The peer has described its rows again (as it would to reuse them): its new
        # transfer, not the replayed one, is what may write or read them now.
        pair.peer.describe(plan.peer_view)
        _expect_refusal(pair, plan, local_op, local_is_source, plan.local_view, run.peer_hint,
                        what="a replayed hint", warm=False)
        for name, _, _ in _groups(pair):
            assert _dest_rows(pair, plan, local_is_source, name) == first[name], \
                f"a replayed hint overwrote group {name} at the destination"
    finally:
        pair.close()


def check_hint_only_for_its_audience(make_pair: PairFactory, mode: TransferMode) -> None:
    """A hint moves bytes only at the peer it is bound to, and only before it expires: the
    active end takes a hint bound to itself, and refuses one bound to another peer, to an
    earlier run of its own agent (a restart), or past its expiry, letting nothing escape."""
    local_op = "publish" if mode is TransferMode.PUSH else "fetch"  # the end that moves bytes
    local_is_source = local_op == "publish"
    pair = make_pair(mode)
    try:
        plan = _plan(pair, f"bound-{local_op}", rows=6, seed=21)
        _fill(pair, plan, local_is_source)
        peer_op = "publish" if local_op == "fetch" else "fetch"
        local_hint = pair.local.describe(plan.local_view)
        bound = pair.peer.describe(plan.peer_view, pair.local.peer)
        handle = pair.peer.start(peer_op, plan.peer_view, local_hint)
        waker = _Waker()
        attempt = (pair.local.fetch if local_op == "fetch" else pair.local.publish)(plan.local_view, bound, waker)
        waker.bind(attempt)
        _finish(pair, _Run(attempt, waker, handle, bound))
        assert isinstance(attempt.poll(), Delivered), f"a hint bound to this end was not taken: {attempt.poll()!r}"
    finally:
        pair.close()
    for what in ("a hint bound to another peer", "a hint bound to an earlier run of this agent", "an expired hint"):
        pair = make_pair(mode)
        try:
            me = pair.local.peer
            plan = _plan(pair, f"unbound-{local_op}", rows=6, seed=22)
            _fill(pair, plan, local_is_source)
            if what == "an expired hint":
                hint = dataclasses.replace(pair.peer.describe(plan.peer_view, me),
                                           expires_ms=time.time_ns() // 1_000_000 - 1000)
            else:
                stranger = Peer("a-stranger", "0" * 16) if "another" in what else Peer(me.agent, "an-earlier-run")
                hint = pair.peer.describe(plan.peer_view, stranger)
            _expect_refusal(pair, plan, local_op, local_is_source, plan.local_view, hint, what=what)
        finally:
            pair.close()


def check_withdraw(make_pair: PairFactory, mode: TransferMode) -> None:
    """withdraw() of a peer's hint: True once the attempt that used it has quiesced; True for
    a hint never used, which is then refused as used, letting nothing escape."""
    local_op = "publish" if mode is TransferMode.PUSH else "fetch"  # the end that moves bytes
    local_is_source = local_op == "publish"
    pair = make_pair(mode)
    try:
        plan = _plan(pair, f"withdraw-used-{local_op}", rows=6, seed=24)
        _fill(pair, plan, local_is_source)
        run = _start(pair, plan, local_op)
        _finish(pair, run)
        assert pair.local.withdraw(run.peer_hint), "withdraw() of a hint whose attempt quiesced returned False"
    finally:
        pair.close()
    pair = make_pair(mode)
    try:
        plan = _plan(pair, f"withdraw-unused-{local_op}", rows=6, seed=25)
        _fill(pair, plan, local_is_source)
        hint = pair.peer.describe(plan.peer_view)
        assert pair.local.withdraw(hint), "withdraw() of a hint never used returned False"
        _expect_refusal(pair, plan, local_op, local_is_source, plan.local_view, hint, what="a withdrawn hint")
    finally:
        pair.close()


def check_missing_counterpart_false(make_pair: PairFactory, mode: TransferMode) -> None:
    """Rows the peer does not have are False in the fetcher's masks, never guessed."""
    pair = make_pair(mode)
    try:
        plan = _plan(pair, "prefix", rows=12, seed=8, peer_missing=3)
        _fill(pair, plan, False)
        outcome, _ = _finish(pair, _start(pair, plan, "fetch"))
        assert not isinstance(outcome, Cancelled), outcome
        for gi, group in enumerate(plan.local_view.groups):
            peer_ordinals = set(plan.peer_view.groups[gi].ordinals.tolist())
            expected = np.array([o in peer_ordinals for o in group.ordinals.tolist()], dtype=np.bool_)
            assert np.array_equal(outcome.masks[gi], expected), (outcome.masks[gi], expected)
        _check_masks_honest(pair, plan, False, outcome, plan.local_view)
    finally:
        pair.close()


def check_only_requested_rows_move(make_pair: PairFactory, mode: TransferMode) -> None:
    """A fetcher that already holds a prefix asks for the rest; its prefix rows stay untouched."""
    pair = make_pair(mode)
    try:
        plan = _plan(pair, "rest", rows=12, seed=9, local_missing=5)
        _fill(pair, plan, False)
        outcome, peer_outcome = _finish(pair, _start(pair, plan, "fetch"))
        assert all(m.all() for m in outcome.masks), outcome
        for name, region, _ in _groups(pair):
            dst = _dest_rows(pair, plan, False, name)
            src = _source_rows(plan, name, region.slot_bytes)
            assert dst[5:] == src[5:]
            assert all(row == bytes([0xA5]) * region.slot_bytes for row in dst[:5]), "held prefix rows were written"
        assert peer_outcome is not None
        for gi in range(len(plan.peer_view.groups)):
            assert peer_outcome.masks[gi][:5].sum() == 0 and peer_outcome.masks[gi][5:].all()
    finally:
        pair.close()


def check_partial_failure_exact(make_pair: PairFactory, mode: TransferMode) -> None:
    """A fault after k rows: Failed, exactly k rows True, each of them byte-exact."""
    k = 7
    for local_op, local_is_source in _roles():
        pair = make_pair(mode)
        try:
            # The active end (the one that moves bytes) is the one whose fault matters.
            local_active = (local_op == "publish") == (mode is TransferMode.PUSH)
            if local_active:
                if pair.inject_local_fault is None:
                    continue
                pair.inject_local_fault(k)
            elif not pair.peer.inject_fault(k):
                continue
            plan = _plan(pair, f"fault-{local_op}", rows=10, seed=10)
            _fill(pair, plan, local_is_source)
            outcome, peer_outcome = _finish(pair, _start(pair, plan, local_op))
            assert isinstance(outcome, Failed), outcome
            assert outcome.rows_delivered == k, f"{outcome.rows_delivered} rows delivered, expected {k}"
            assert isinstance(peer_outcome, Failed) and peer_outcome.rows_delivered == k, peer_outcome
            _check_masks_honest(pair, plan, local_is_source, outcome, plan.local_view)
            _check_masks_honest(pair, plan, local_is_source, peer_outcome, plan.peer_view)
        finally:
            pair.close()


def check_cancel(make_pair: PairFactory, mode: TransferMode) -> None:
    """cancel() ends in Cancelled (or an outcome already set), honest masks, then quiescence."""
    for local_op, local_is_source in _roles():
        pair = make_pair(mode)
        try:
            plan = _plan(pair, f"cancel-{local_op}", rows=16, seed=11)
            _fill(pair, plan, local_is_source)
            run = _start(pair, plan, local_op)
            before = run.local_attempt.poll()
            run.local_attempt.cancel()
            outcome, _ = _finish(pair, run)
            if before is None:
                assert isinstance(outcome, (Cancelled, Delivered)), outcome
            else:
                assert outcome is before
            _check_masks_honest(pair, plan, local_is_source, outcome, plan.local_view)
        finally:
            pair.close()


def check_cancel_before_peer_starts(make_pair: PairFactory, mode: TransferMode) -> None:
    """Cancelling a wait whose peer never submitted concludes Cancelled, and the peer's later
    submission of that transfer is refused or ends without writing the cancelled rows."""
    pair = make_pair(mode)
    try:
        plan = _plan(pair, "early-cancel", rows=6, seed=12)
        _fill(pair, plan, False)
        local_hint = pair.local.describe(plan.local_view)
        peer_hint = pair.peer.describe(plan.peer_view)
        waker = _Waker()
        attempt = pair.local.fetch(plan.local_view, peer_hint, waker)
        waker.bind(attempt)
        attempt.cancel()
        end = time.monotonic() + TIMEOUT
        while attempt.poll() is None and time.monotonic() < end:
            time.sleep(0.001)
        outcome = attempt.poll()
        assert isinstance(outcome, (Cancelled, Delivered, Failed)), outcome
        if mode is TransferMode.PUSH:
            # Passive, and its peer never published: nothing can have arrived, so the only
            # honest end is Cancelled (a deadline's Failed would mean cancel did nothing).
            assert isinstance(outcome, Cancelled), f"a cancelled wait whose peer never published ended {outcome!r}"
        if isinstance(outcome, Cancelled):
            assert outcome.rows_delivered == 0 or mode is TransferMode.PULL
        if mode is TransferMode.PUSH and isinstance(outcome, Cancelled):
            time.sleep(0.2)  # let the withdrawal reach the peer before it tries to publish
            before = {n: pair.local_memory.read(lr.name, plan.local_slots[n]) for n, lr, _ in _groups(pair)}
            try:
                handle = pair.peer.start("publish", plan.peer_view, local_hint)
            except InvalidSubmission:
                pass
            else:
                pair.peer.result(handle, TIMEOUT)
                after = {n: pair.local_memory.read(lr.name, plan.local_slots[n]) for n, lr, _ in _groups(pair)}
                assert after == before, "peer wrote rows of a transfer the fetcher had cancelled"
        end = time.monotonic() + TIMEOUT
        while not attempt.quiesced() and time.monotonic() < end:
            time.sleep(0.001)
        assert attempt.quiesced(), "cancelled wait never quiesced"
    finally:
        pair.close()


def check_shutdown(make_pair: PairFactory, mode: TransferMode) -> None:
    """shutdown() returns exactly the attempts not proven quiesced; later submissions are rejected."""
    pair = make_pair(mode)
    try:
        plan = _plan(pair, "shutdown-done", rows=4, seed=13)
        _fill(pair, plan, False)
        done_run = _start(pair, plan, "fetch")
        _finish(pair, done_run)
        waiting_plan = _plan(pair, "shutdown-waiting", rows=4, seed=14)
        pair.local.describe(waiting_plan.local_view)
        peer_hint = pair.peer.describe(waiting_plan.peer_view)
        waiting = pair.local.fetch(waiting_plan.local_view, peer_hint)  # the peer never publishes
        unquiesced = pair.local.shutdown()
        attempts = {done_run.local_attempt, waiting}
        assert unquiesced <= attempts
        assert done_run.local_attempt not in unquiesced
        assert unquiesced == {a for a in attempts if not a.quiesced()}, (unquiesced, attempts)
        assert waiting.poll() is not None, "shutdown left an attempt without an outcome"
        for call in (lambda: pair.local.describe(plan.local_view),
                     lambda: pair.local.fetch(plan.local_view, peer_hint),
                     lambda: pair.local.publish(plan.local_view, peer_hint)):
            try:
                call()
            except SubmissionRejected:
                continue
            raise AssertionError("a call after shutdown() did not raise SubmissionRejected")
    finally:
        pair.close()


CHECKS: tuple[Callable[[PairFactory, TransferMode], None], ...] = (
    check_round_trip_exact,
    check_wake_after_visible,
    check_outcome_is_final,
    check_unregistered_region_refused,
    check_unknown_slot_refused,
    check_overlapping_fetch_refused,
    check_describe_refuses_what_a_submission_would,
    check_register_skips_unreachable_kinds,
    check_layout_mismatch_refused,
    check_hint_used_once,
    check_hint_only_for_its_audience,
    check_withdraw,
    check_missing_counterpart_false,
    check_only_requested_rows_move,
    check_partial_failure_exact,
    check_cancel,
    check_cancel_before_peer_starts,
    check_shutdown,
)
