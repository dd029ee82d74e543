"""IpcBackend's completion events under device faults (over ``kvxfer.testing.host_cuda``, no
GPU): an event left by a device error is never handed to a later job, a clean one is reused,
and every event the backend creates is destroyed by its shutdown. The peer, a fetcher, lives
in a child process (host_cuda, as CUDA, will not map this process's own allocations)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import pytest

from kvxfer.backends.ipc import IpcBackend
from kvxfer.contract import CacheKind, Delivered, Failed, LayerGroupRows, Outcome, TokenRange, TransferMode, View
from kvxfer.testing import host_cuda
from kvxfer.testing.ipc_pairs import LOCAL_GEOMETRY, ChildPeer, DeviceRows, PeerSpec
from kvxfer.testing.ipc_scenarios import close_all

PUSH = TransferMode.PUSH
FAULT = "cudaErrorIllegalAddress: injected"
ROWS = 6  # per group


@dataclass
class Events:
    """The events this process's backends created and destroyed (the child's are its own)."""

    created: list[int] = field(default_factory=list)
    destroyed: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class Ends:
    local: IpcBackend
    peer: ChildPeer
    memory: DeviceRows
    events: Events


@dataclass(frozen=True)
class Result:
    mine: Outcome | None
    theirs: Outcome | None
    quiet: bool
    sent: tuple[bytes, ...]  # per group: the rows published
    got: tuple[bytes, ...]  # and what the peer holds in their place afterwards


@pytest.fixture
def ends(monkeypatch: pytest.MonkeyPatch) -> Iterator[Ends]:
    events = Events()
    create, destroy = host_cuda.event_create, host_cuda.event_destroy

    def counted_create(device: int) -> int:
        event = create(device)
        events.created.append(event)
        return event

    def counted_destroy(event: int) -> None:
        destroy(event)
        events.destroyed.append(event)

    monkeypatch.setattr(host_cuda, "event_create", counted_create)
    monkeypatch.setattr(host_cuda, "event_destroy", counted_destroy)
    peer = ChildPeer(PeerSpec(PUSH, emulated=True))
    memory = DeviceRows(LOCAL_GEOMETRY, cuda=host_cuda)
    local = IpcBackend("local", PUSH, cuda=host_cuda)
    try:
        local.register(memory.regions)
        yield Ends(local, peer, memory, events)
    finally:
        host_cuda.clear_faults()
        close_all(local, [peer], memory)


def _views(ends: Ends, seed: int, request: str) -> tuple[View, View, list[np.ndarray], list[np.ndarray]]:
    """Two groups (one per region, of different row sizes), ROWS scattered rows each."""
    rng = np.random.default_rng(seed)
    ords = np.arange(ROWS, dtype=np.int64)
    mine, theirs, local_slots, peer_slots = [], [], [], []
    for i, (lr, pr) in enumerate(zip(ends.memory.regions, ends.peer.regions)):
        ls = rng.permutation(lr.slots)[:ROWS].astype(np.int64)
        ps = rng.permutation(pr.slots)[:ROWS].astype(np.int64)
        mine.append(LayerGroupRows(f"g{i}", CacheKind.PAGED, lr, ls, ords))
        theirs.append(LayerGroupRows(f"g{i}", CacheKind.PAGED, pr, ps, ords))
        local_slots.append(ls)
        peer_slots.append(ps)
    tokens = TokenRange(0, ROWS * 16)
    return (View(request, tokens, tuple(mine), b"L"), View(request, tokens, tuple(theirs), b"L"),
            local_slots, peer_slots)


def _push(ends: Ends, seed: int, request: str) -> Result:
    """Publish fresh bytes into the peer's zeroed rows; both outcomes, and the peer's rows after."""
    lv, pv, local_slots, peer_slots = _views(ends, seed, request)
    rng = np.random.default_rng(seed + 1000)
    sent = []
    for lr, pr, ls, ps in zip(ends.memory.regions, ends.peer.regions, local_slots, peer_slots):
        data = rng.integers(1, 256, ROWS * lr.slot_bytes, dtype=np.uint8).tobytes()
        ends.memory.write(lr.name, ls, data)
        ends.peer.write(pr.name, ps, bytes(len(data)))
        sent.append(data)
    hint = ends.peer.describe(pv)
    handle = ends.peer.start("fetch", pv, ends.local.describe(lv))
    attempt = ends.local.publish(lv, hint)
    assert attempt.wait(15), f"{request}: the publish did not end"
    theirs, quiet = ends.peer.result(handle, 15)
    got = tuple(ends.peer.read(pr.name, ps) for pr, ps in zip(ends.peer.regions, peer_slots))
    return Result(attempt.poll(), theirs, quiet, tuple(sent), got)


def _masks(outcome: Outcome | None) -> list[list[bool]]:
    assert outcome is not None
    return [m.tolist() for m in outcome.masks]


def _assert_delivered(result: Result) -> None:
    every = [[True] * ROWS, [True] * ROWS]
    for outcome in (result.mine, result.theirs):
        assert isinstance(outcome, Delivered) and _masks(outcome) == every, outcome
    assert result.quiet
    assert result.got == result.sent, "the peer's rows differ from the rows published"


def test_an_event_left_by_a_device_error_is_destroyed_not_reused(ends: Ends) -> None:
    # The copy's event reads as a device error. The job fails naming it, with no row reported
    # on either end; the event is destroyed rather than pooled (reused, a stale event could
    # say a later copy ended before its kernel ran), so the next jobs take a fresh one and are
    # delivered byte-exact, reusing that one clean event; shutdown destroys every event made.
    host_cuda.break_next_event(FAULT)
    bad = _push(ends, 1, "bad")
    none = [[False] * ROWS, [False] * ROWS]
    assert isinstance(bad.mine, Failed) and FAULT in bad.mine.reason and _masks(bad.mine) == none, bad.mine
    assert isinstance(bad.theirs, Failed) and FAULT in bad.theirs.reason and _masks(bad.theirs) == none, bad.theirs
    assert bad.quiet
    for i in range(3):
        _assert_delivered(_push(ends, 2 + i, f"good{i}"))
    assert ends.local.shutdown() == frozenset()
    assert sorted(ends.events.destroyed) == sorted(ends.events.created), (
        f"events leaked: created {ends.events.created}, destroyed {ends.events.destroyed}")
    assert len(ends.events.created) == 2, ends.events.created  # the broken one, then one reused


def test_a_launch_failing_part_way_reuses_its_clean_event(ends: Ends, monkeypatch: pytest.MonkeyPatch) -> None:
    # The first group's kernel is queued, the second's launch fails: the job fails naming it
    # with exactly the first group's rows, on both ends (they are in place). Its event was
    # recorded after the failure and completed cleanly, so it is known good: the next job
    # reuses it and is delivered byte-exact.
    launch = host_cuda.cuda_copy_rows_then
    calls = {"n": 0}

    def fail_once(*args: object, **check: object) -> tuple[str, str]:
        calls["n"] += 1
        if calls["n"] == 1:
            raise host_cuda.CopyError("cudaErrorLaunchOutOfResources: injected")
        return launch(*args, **check)  # type: ignore[arg-type]

    monkeypatch.setattr(host_cuda, "cuda_copy_rows_then", fail_once)
    bad = _push(ends, 1, "partial")
    first = [[True] * ROWS, [False] * ROWS]
    for outcome in (bad.mine, bad.theirs):
        assert isinstance(outcome, Failed) and "LaunchOutOfResources" in outcome.reason, outcome
        assert _masks(outcome) == first, outcome
    assert bad.got[0] == bad.sent[0] and bad.got[1] == bytes(len(bad.sent[1]))
    _assert_delivered(_push(ends, 2, "after"))
    assert ends.local.shutdown() == frozenset()
    assert len(ends.events.created) == 1 and ends.events.destroyed == ends.events.created, ends.events


def test_events_of_copies_in_flight_when_the_stream_fails_at_shutdown_are_destroyed(
        ends: Ends, monkeypatch: pytest.MonkeyPatch) -> None:
    # A copy outlives shutdown's grace, and the stream reports a device error when shutdown
    # waits for it: the job fails naming it, and its event is destroyed with the rest.
    monkeypatch.setenv(host_cuda.DELAY_ENV, "2.0")  # this process only: the child started already
    lv, pv, _, _ = _views(ends, 1, "slow")
    hint = ends.peer.describe(pv)
    handle = ends.peer.start("fetch", pv, ends.local.describe(lv))
    attempt = ends.local.publish(lv, hint)
    stream = ends.local._copies.stream
    synchronize = host_cuda.stream_synchronize

    def failing(s: int, device: int = -1) -> None:
        synchronize(s, device)
        if s == stream:
            raise host_cuda.CopyError(FAULT)

    monkeypatch.setattr(host_cuda, "stream_synchronize", failing)
    try:
        assert ends.local.shutdown() == frozenset()
        outcome = attempt.poll()
        assert isinstance(outcome, Failed) and "copy stream failed" in outcome.reason, outcome
        assert _masks(outcome) == [[False] * ROWS, [False] * ROWS]
        theirs, quiet = ends.peer.result(handle, 15)
        assert isinstance(theirs, Failed) and quiet, theirs
        assert len(ends.events.created) == 1 and ends.events.destroyed == ends.events.created, ends.events
    finally:
        host_cuda.stream_destroy(stream)  # shutdown left the failed stream to us


def test_shutdown_finishing_a_copy_whose_peer_died_does_not_hang(
        ends: Ends, monkeypatch: pytest.MonkeyPatch) -> None:
    # A copy outlives shutdown's grace and its peer dies meanwhile: shutdown waits for the
    # copy, then finds the peer gone when it sends the record. That must end shutdown, with
    # the attempt concluded and quiesced, not block it (the peer-gone path takes the launch
    # lock, which shutdown must not be holding then).
    import threading

    monkeypatch.setenv(host_cuda.DELAY_ENV, "2.0")  # this process only: the child started already
    lv, pv, _, _ = _views(ends, 1, "orphan")
    hint = ends.peer.describe(pv)
    ends.peer.start("fetch", pv, ends.local.describe(lv))
    attempt = ends.local.publish(lv, hint)
    ends.peer.kill()
    left: list[frozenset[object]] = []
    closer = threading.Thread(target=lambda: left.append(ends.local.shutdown()), daemon=True)
    closer.start()
    closer.join(30)
    assert not closer.is_alive(), "shutdown hung finishing a copy whose peer had died"
    assert left == [frozenset()]
    assert attempt.poll() is not None and attempt.quiesced()
