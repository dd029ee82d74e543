"""SIGKILL of the NIXL peer mid-transfer: the local attempt fails within bounded time with
masks that claim exactly the chunks proven delivered (byte-exact where we can read them),
quiesces, strands nothing at shutdown, and a restarted peer of the same name works.

Why quiescing is safe: a killed peer can touch nothing any more (its process, endpoints
and queue pairs are gone). What could still touch our memory is our own side: requests we
posted towards it (released, so NIXL aborts them, before the attempt quiesces) and our UCX
worker handling traffic it already received (stopped by dropping the peer's endpoint).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest

from kvxfer.backends.nixl import NixlBackend
from kvxfer.contract import CacheKind, Delivered, Failed, LayerGroupRows, TokenRange, TransferMode, View
from kvxfer.testing.memory import HostRows
from kvxfer.testing.nixl_pairs import host_rows
from kvxfer.testing.progress_hold import hold_progress
from kvxfer.testing.subprocess_peer import SubprocessPeer, live_children
from kvxfer.testing.waiting import settle
from kvxfer.wire import decode_hint, encode_hint

ROW = 16 << 10
ROWS = 96
CHUNK_ROWS = 4
PAUSE = 0.04            # between chunk posts: about 1 s for the whole transfer
STALL = 3600.0          # a peer's pause after its first chunk: it never finishes before the kill
PROGRESS = 15.0         # seconds for a first chunk to be proven or to land (a loaded 2-core VM)
BOUND = 5.0             # seconds from the kill to a concluded, quiesced attempt
LOCAL = (("A", ROW, 128), ("B", ROW, 128))
PEER = (("PA", ROW, 128), ("PB", ROW, 128))


@pytest.fixture(autouse=True)
def no_child_left_behind() -> Iterator[None]:
    yield
    assert live_children() == [], "a test left a peer child process running"


def _child(mode: TransferMode, *, pause: float = 0.0, name: str | None = None) -> SubprocessPeer:
    kwargs = {"mode": mode.value, "buffers": [list(b) for b in PEER], "chunk_bytes": CHUNK_ROWS * ROW,
              "chunk_pause_s": pause, "deadline_s": 20.0}
    if name:
        kwargs["name"] = name
    return SubprocessPeer("kvxfer.testing.nixl_pairs:child_backend", kwargs)


def _local(mode: TransferMode, pause: float = 0.0) -> tuple[NixlBackend, HostRows]:
    memory = host_rows(LOCAL)
    backend = NixlBackend(mode=mode, chunk_bytes=CHUNK_ROWS * ROW, chunk_pause_s=pause, deadline_s=20.0)
    backend.register(memory.regions)
    return backend, memory


def _views(memory: HostRows, peer: SubprocessPeer, request: str) -> tuple[View, View]:
    rng = np.random.default_rng(len(request))
    half = ROWS // 2
    lg, pg = [], []
    for name, lr, pr in zip(("g0", "g1"), memory.regions, peer.regions):
        ordinals = np.arange(half, dtype=np.int64)
        lg.append(LayerGroupRows(name, CacheKind.PAGED, lr, rng.permutation(lr.slots)[:half], ordinals))
        pg.append(LayerGroupRows(name, CacheKind.PAGED, pr, rng.permutation(pr.slots)[:half], ordinals))
    tokens = TokenRange(0, ROWS * 16)
    return View(request, tokens, tuple(lg), b"chaos"), View(request, tokens, tuple(pg), b"chaos")


def _payload(view: View) -> dict[str, bytes]:
    rng = np.random.default_rng(7)
    return {g.layer_group: rng.integers(0, 256, len(g) * ROW, dtype=np.uint8).tobytes() for g in view.groups}


def _start(local: NixlBackend, peer: SubprocessPeer, local_view: View, peer_view: View, local_op: str):  # type: ignore[no-untyped-def]
    local_hint = encode_hint(local.describe(local_view))
    peer_hint = decode_hint(peer.describe_bytes(peer_view))
    peer.start_bytes("publish" if local_op == "fetch" else "fetch", peer_view, local_hint)
    return (local.fetch if local_op == "fetch" else local.publish)(local_view, peer_hint)


def _hold_once_proven(backend: NixlBackend) -> tuple[threading.Event, threading.Event]:
    """Hold the progress thread once a chunk of its active job is proven, until the returned
    gate is set: the kill lands after that chunk and before the last, whatever the load."""
    return hold_progress(backend, ready=lambda: any(job.done for job in list(backend._active)))


def _landed(read: Callable[[str, np.ndarray], bytes], view: View) -> bool:
    """The first chunk of a group of ``view`` (chunks go in view order) no longer holds zeros:
    rows of random bytes landed there."""
    return any(any(read(g.region.name, g.slots[:CHUNK_ROWS])) for g in view.groups)


def _chunk_prefix(mask: np.ndarray) -> int:
    """Rows proven delivered must be whole chunks from the start of the group (posting order)."""
    n = int(mask.sum())
    assert mask[:n].all() and not mask[n:].any(), "delivered rows are not a prefix in posting order"
    assert n % CHUNK_ROWS == 0 or n == mask.size, f"{n} rows is not a whole number of chunks"
    return n


@pytest.mark.parametrize("mode", list(TransferMode), ids=lambda m: m.value)
def test_kill_peer_while_we_move_rows(mode: TransferMode) -> None:
    """We are the active end (push publisher / pull fetcher); the peer dies mid-way."""
    local_op = "publish" if mode is TransferMode.PUSH else "fetch"
    local, memory = _local(mode, pause=PAUSE)
    held, gate = _hold_once_proven(local)
    peer = _child(mode)
    try:
        local_view, peer_view = _views(memory, peer, f"kill-active-{mode.value}")
        payload = _payload(local_view)
        for g, pg in zip(local_view.groups, peer_view.groups):
            if local_op == "publish":
                memory.write(g.region.name, g.slots, payload[g.layer_group])
            else:
                peer.write(pg.region.name, pg.slots, payload[g.layer_group])
                memory.write(g.region.name, g.slots, b"\x00" * len(payload[g.layer_group]))
        attempt = _start(local, peer, local_view, peer_view, local_op)
        assert held.wait(PROGRESS), "no chunk was proven"
        peer.kill()
        killed = time.monotonic()
        gate.set()
        assert attempt.wait(BOUND), f"no outcome and quiescence within {BOUND}s of the kill"
        outcome = attempt.poll()
        assert isinstance(outcome, Failed), outcome
        assert "disconnect" in outcome.reason or "unreachable" in outcome.reason, outcome.reason
        assert time.monotonic() - killed < BOUND
        delivered = [_chunk_prefix(m) for m in outcome.masks]
        total = sum(delivered)
        assert 0 < total < ROWS, f"kill did not land mid-transfer ({total} of {ROWS} rows)"
        assert delivered[1] == 0 or delivered[0] == len(local_view.groups[0]), "group 1 started before group 0 ended"
        if local_op == "fetch":  # rows claimed delivered hold exactly the peer's bytes
            for g, n in zip(local_view.groups, delivered):
                assert memory.read(g.region.name, g.slots[:n]) == payload[g.layer_group][: n * ROW]
        assert attempt.quiesced()
        assert local.shutdown() == frozenset(), "an attempt was left unquiesced"
    finally:
        gate.set()
        peer.kill()
        local.shutdown()


@pytest.mark.parametrize("mode", list(TransferMode), ids=lambda m: m.value)
def test_kill_peer_while_it_moves_rows(mode: TransferMode) -> None:
    """We wait passively (push fetcher / pull publisher); the active peer dies mid-way. No record
    ever comes, so nothing is proven: every row is False, and the heartbeat ends the wait.
    The peer posts its first chunk, then pauses for longer than the test: killed once that
    chunk landed, it dies mid-way whatever the load."""
    local_op = "fetch" if mode is TransferMode.PUSH else "publish"
    local, memory = _local(mode)
    peer = _child(mode, pause=STALL)
    try:
        local_view, peer_view = _views(memory, peer, f"kill-passive-{mode.value}")
        payload = _payload(local_view)
        source, dest = (peer, memory) if local_op == "fetch" else (memory, peer)
        for lg, pg in zip(local_view.groups, peer_view.groups):  # random bytes in, zeros where they go
            sg, dg = (pg, lg) if source is peer else (lg, pg)
            source.write(sg.region.name, sg.slots, payload[lg.layer_group])
            dest.write(dg.region.name, dg.slots, b"\x00" * len(payload[lg.layer_group]))
        attempt = _start(local, peer, local_view, peer_view, local_op)
        dest_view = local_view if dest is memory else peer_view
        assert settle(lambda: _landed(dest.read, dest_view), PROGRESS), "no row landed"
        assert attempt.poll() is None, "the transfer ended before the kill"
        peer.kill()
        assert attempt.wait(BOUND), f"no outcome and quiescence within {BOUND}s of the kill"
        outcome = attempt.poll()
        assert isinstance(outcome, Failed) and "disconnected" in outcome.reason, outcome
        assert outcome.rows_delivered == 0
        assert local.shutdown() == frozenset()
    finally:
        peer.kill()
        local.shutdown()


def test_restarted_peer_with_the_same_name_is_added_again() -> None:
    mode = TransferMode.PUSH
    local, memory = _local(mode)
    name = f"chaos-restart-{time.monotonic_ns()}"
    peer = _child(mode, pause=STALL, name=name)  # never past its first chunk: the kill lands mid-way
    try:
        local_view, peer_view = _views(memory, peer, "restart-1")
        stale_local, stale_peer = _views(memory, peer, "restart-stale")
        stale_hint = decode_hint(peer.describe_bytes(stale_peer))
        first = _payload(peer_view)
        for g, lg in zip(peer_view.groups, local_view.groups):
            peer.write(g.region.name, g.slots, first[g.layer_group])
            memory.write(lg.region.name, lg.slots, b"\x00" * len(first[g.layer_group]))
        attempt = _start(local, peer, local_view, peer_view, "fetch")
        assert settle(lambda: _landed(memory.read, local_view), PROGRESS), "no row landed"
        peer.kill()
        assert attempt.wait(BOUND) and isinstance(attempt.poll(), Failed)
        local.describe(stale_local)  # a hint of the dead process: refused at once, nothing posted
        stale = local.fetch(stale_local, stale_hint)
        assert isinstance(stale.poll(), Failed) and "unreachable" in stale.poll().reason and stale.quiesced()
        peer = _child(mode, name=name)  # same agent name, new process, new metadata
        assert peer.agent == name
        local_view, peer_view = _views(memory, peer, "restart-2")
        payload = _payload(peer_view)
        for g in peer_view.groups:
            peer.write(g.region.name, g.slots, payload[g.layer_group])
        attempt = _start(local, peer, local_view, peer_view, "fetch")
        assert attempt.wait(BOUND)
        assert isinstance(attempt.poll(), Delivered) and attempt.poll().all_delivered
        for g in local_view.groups:
            assert memory.read(g.region.name, g.slots) == payload[g.layer_group]
    finally:
        peer.close()
        assert local.shutdown() == frozenset()
