"""A NIXL peer whose metadata changes while our requests to it are in flight: one that
registered more memory (its newer metadata is loaded over what we hold, the requests go on),
and one that restarted under the same name (loaded again only once they ended). Two agents
in this process over UCX/TCP, where a WRITE stays in flight while its target's worker is
not progressed."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest

from kvxfer.backends.nixl import NixlBackend
from kvxfer.contract import (
    CacheKind,
    Delivered,
    Failed,
    InvalidSubmission,
    LayerGroupRows,
    TokenRange,
    TransferMode,
    View,
)
from kvxfer.testing.memory import HostRows
from kvxfer.testing.nixl_pairs import host_rows
from kvxfer.testing.progress_hold import hold_progress
from kvxfer.testing.waiting import settle

ROW = 1 << 20
ROWS = 32
_GATES: list[threading.Event] = []  # stalled progress threads, all released at a test's end


@pytest.fixture
def made(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[NixlBackend]]:
    monkeypatch.setenv("UCX_TLS", "tcp")  # before any agent starts: UCX reads it then
    backends: list[NixlBackend] = []
    yield backends
    for gate in _GATES:
        gate.set()
    _GATES.clear()
    for b in backends:
        assert b.shutdown() == frozenset(), "an attempt was left unquiesced"
    assert not [t for t in threading.enumerate() if t.name.startswith("kvxfer-nixl-")], "a progress thread lives on"


def _backend(made: list[NixlBackend], memory: HostRows, **options: object) -> NixlBackend:
    backend = NixlBackend(mode=TransferMode.PUSH, packed="never", chunk_bytes=8 * ROW, window=2,
                          deadline_s=30.0, **options)  # type: ignore[arg-type]
    backend.register(memory.regions)
    made.append(backend)
    return backend


def _view(memory: HostRows, region: str, request: str) -> View:
    target = next(r for r in memory.regions if r.name == region)
    ordinals = np.arange(ROWS, dtype=np.int64)
    return View(request, TokenRange(0, ROWS * 16),
                (LayerGroupRows("g0", CacheKind.PAGED, target, ordinals, ordinals),), b"L")


def _in_flight(pub: NixlBackend) -> bool:
    return any(j.inflight for j in pub._active)


def _push(pub: NixlBackend, target: NixlBackend, views: tuple[View, View]) -> None:
    """One push from ``pub`` into ``target`` (its view second), both ends Delivered."""
    hint = target.describe(views[1])
    waiting = target.fetch(views[1], pub.describe(views[0]))
    sending = pub.publish(views[0], hint)
    for attempt in (sending, waiting):
        assert attempt.wait(30.0) and isinstance(attempt.poll(), Delivered), attempt.poll()


def _filled(memory: HostRows, region: str, value: int) -> None:
    memory.buffers[region].array.fill(value)


def test_a_peer_that_registers_more_memory_keeps_our_requests_in_flight_to_it(made: list[NixlBackend]) -> None:
    # The fetcher registers a second region while the publisher's WRITEs to its first are in
    # flight; its next hint carries new metadata. Loading it must leave the peer's loaded state
    # alone: both pushes land (dropping the peer first failed the first one by name, "NIXL
    # reported an error", its WRITEs cut off), and a hint with the older metadata still works.
    pmem = host_rows((("P0", ROW, ROWS), ("P1", ROW, ROWS), ("P2", ROW, ROWS)))
    fmem, more = host_rows((("F0", ROW, ROWS), ("F2", ROW, ROWS))), host_rows((("F1", ROW, ROWS),))
    pub = _backend(made, pmem)
    fet = NixlBackend(mode=TransferMode.PUSH, packed="never")
    made.append(fet)
    fet.register(fmem.regions)
    for name, value in (("P0", 1), ("P1", 2), ("P2", 3)):
        _filled(pmem, name, value)
    first = _view(pmem, "P0", "first"), _view(fmem, "F0", "first")
    old_hint = fet.describe(first[1])
    _, gate = hold_progress(fet, gates=_GATES)  # its UCX worker too: a WRITE to it stays in flight
    waiting = [fet.fetch(first[1], pub.describe(first[0]))]
    sending = [pub.publish(first[0], old_hint)]
    assert settle(lambda: _in_flight(pub)), "no WRITE stayed in flight"

    fet.register(more.regions)
    second = _view(pmem, "P1", "second"), _view(more, "F1", "second")
    new_hint = fet.describe(second[1])
    assert new_hint.endpoint != old_hint.endpoint, "registering did not change the metadata"
    waiting.append(fet.fetch(second[1], pub.describe(second[0])))
    sending.append(pub.publish(second[0], new_hint))  # loads the new metadata
    time.sleep(0.2)
    assert sending[0].poll() is None, f"the push in flight ended at the reload: {sending[0].poll()}"
    gate.set()
    # A hint described before the registration (older metadata) still reaches the fetcher.
    third = _view(pmem, "P2", "third"), _view(fmem, "F2", "third")
    stale = dataclasses.replace(fet.describe(third[1]), endpoint=old_hint.endpoint)
    waiting.append(fet.fetch(third[1], pub.describe(third[0])))
    sending.append(pub.publish(third[0], stale))
    for attempt in sending + waiting:
        assert attempt.wait(30.0), "an attempt did not conclude and quiesce"
        outcome = attempt.poll()
        assert isinstance(outcome, Delivered) and outcome.all_delivered, outcome
    assert (fmem.buffers["F0"].array == 1).all() and (more.buffers["F1"].array == 2).all()
    assert (fmem.buffers["F2"].array == 3).all()


def test_a_restarted_peer_is_loaded_again_only_once_our_requests_to_its_previous_run_ended(
        made: list[NixlBackend]) -> None:
    # Another agent of the same name (a restarted peer: its connection info differs) while a
    # push to the first is in flight: the push to the new one fails by name rather than cut
    # the requests in flight; once those ended, the new one is loaded and reached.
    pmem = host_rows((("P0", ROW, ROWS), ("P1", ROW, ROWS)))
    before, after = host_rows((("A0", ROW, ROWS),)), host_rows((("B0", ROW, ROWS),))
    pub = _backend(made, pmem)
    name = f"restarted-{time.monotonic_ns()}"
    old = NixlBackend(name=name, mode=TransferMode.PUSH, packed="never")
    made.append(old)
    old.register(before.regions)
    _filled(pmem, "P0", 4)
    _filled(pmem, "P1", 5)
    first = _view(pmem, "P0", "first"), _view(before, "A0", "first")
    _, gate = hold_progress(old, gates=_GATES)
    hint = old.describe(first[1])
    waiting = old.fetch(first[1], pub.describe(first[0]))
    sending = pub.publish(first[0], hint)
    assert settle(lambda: _in_flight(pub)), "no WRITE stayed in flight"

    new = NixlBackend(name=name, mode=TransferMode.PUSH, packed="never")
    made.append(new)
    new.register(after.regions)
    second = _view(pmem, "P1", "second"), _view(after, "B0", "second")
    pub.describe(second[0])
    refused = pub.publish(second[0], new.describe(second[1]))
    assert refused.wait(5.0)
    outcome = refused.poll()
    assert isinstance(outcome, Failed) and "restarted" in outcome.reason and outcome.rows_delivered == 0, outcome
    gate.set()
    for attempt in (sending, waiting):
        assert attempt.wait(30.0) and isinstance(attempt.poll(), Delivered), attempt.poll()
    assert (before.buffers["A0"].array == 4).all()

    _push(pub, new, (_view(pmem, "P1", "third"), _view(after, "B0", "third")))
    assert (after.buffers["B0"].array == 5).all()


def test_a_hint_naming_one_peer_with_a_restarted_others_metadata_leaves_the_first_alone(
        made: list[NixlBackend]) -> None:
    # NIXL refuses a restarted agent B's metadata (B's connection changed). Under a hint that
    # says agent A, that refusal is no restart of A: the publish is refused naming both, and A,
    # whose fetch waits on our notes, stays loaded and reachable.
    pmem = host_rows((("P0", ROW, ROWS), ("P1", ROW, ROWS)))
    amem, bmem, b2mem = (host_rows(((n, ROW, ROWS),)) for n in ("A0", "B0", "C0"))
    pub = _backend(made, pmem)
    a = NixlBackend(mode=TransferMode.PUSH, packed="never")
    b_name = f"b-{time.monotonic_ns()}"
    b = NixlBackend(name=b_name, mode=TransferMode.PUSH, packed="never")
    made.extend([a, b])
    a.register(amem.regions)
    b.register(bmem.regions)
    _filled(pmem, "P0", 6)
    for target, mem, region in ((a, amem, "A0"), (b, bmem, "B0")):
        _push(pub, target, (_view(pmem, "P0", f"to-{region}"), _view(mem, region, f"to-{region}")))
    assert b.shutdown() == frozenset()
    made.remove(b)
    b2 = NixlBackend(name=b_name, mode=TransferMode.PUSH, packed="never")
    made.append(b2)
    b2.register(b2mem.regions)
    views = _view(pmem, "P1", "mislabelled"), _view(amem, "A0", "mislabelled")
    hint = a.describe(views[1])
    wrong = dataclasses.replace(hint, endpoint=b2.describe(_view(b2mem, "C0", "b2")).endpoint)
    pub.describe(views[0])
    with pytest.raises(InvalidSubmission) as refused:
        pub.publish(views[0], wrong)
    assert b_name in str(refused.value) and a.name in str(refused.value), refused.value
    assert pub._agent.knows(a.name), "the mislabelled hint dropped the peer it named"
    _filled(pmem, "P1", 7)
    _push(pub, a, (_view(pmem, "P1", "again"), _view(amem, "A0", "again")))
    assert (amem.buffers["A0"].array == 7).all()
