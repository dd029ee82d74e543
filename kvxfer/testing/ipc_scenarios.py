"""IpcBackend scenarios with the peer in a child process, run over real CUDA by
``tests/gpu/test_ipc.py`` and over ``kvxfer.testing.host_cuda`` by
``tests/twoproc/test_ipc_emulated.py`` (``cuda`` picks which: None is kvxfer._native).
Each raises AssertionError naming what went wrong, and closes everything it started first.
"""

from __future__ import annotations

import time
from types import ModuleType

import numpy as np

from kvxfer.backends.ipc import IpcBackend
from kvxfer.backends.ipc.bells import EXTRA_BELL
from kvxfer.contract import CacheKind, Delivered, Failed, LayerGroupRows, SlotRegion, TokenRange, TransferMode, View
from kvxfer.testing.ipc_pairs import ChildPeer, DeviceRows, PeerSpec


def views(local: SlotRegion, peer: SlotRegion, n: int, seed: int,
          request: str = "r") -> tuple[View, View, np.ndarray, np.ndarray]:
    """A view of ``n`` scattered rows on each end, ordinals 0..n-1, and the slots of each."""
    rng = np.random.default_rng(seed)
    ls = rng.permutation(local.slots)[:n].astype(np.int64)
    ps = rng.permutation(peer.slots)[:n].astype(np.int64)
    ords = np.arange(n, dtype=np.int64)
    tokens = TokenRange(0, n * 16)
    lv = View(request, tokens, (LayerGroupRows("g", CacheKind.PAGED, local, ls, ords),), b"L")
    pv = View(request, tokens, (LayerGroupRows("g", CacheKind.PAGED, peer, ps, ords),), b"L")
    return lv, pv, ls, ps


def close_all(local: IpcBackend, peers: list[ChildPeer], memory: DeviceRows) -> None:
    """Close everything, then assert that the backend's shutdown left no attempt unquiesced."""
    try:
        left = local.shutdown()
    finally:
        for peer in peers:
            peer.close()
        memory.close()
    assert left == frozenset(), f"attempts not quiesced at shutdown: {left}"


def large_rows_byte_exact(mode: TransferMode, *, cuda: ModuleType | None, row_bytes: int, slots: int,
                          rows: int, devices: tuple[int, int] = (0, 0)) -> None:
    """``rows`` scattered rows moved by this process's backend (the active end in both modes:
    push publishes, pull fetches); both outcomes Delivered for every row; bytes equal.
    ``devices``: this end's and the child's CUDA devices (two GPUs: over peer access)."""
    peer = ChildPeer(PeerSpec(mode, geometry=(("P", row_bytes, slots),), device=devices[1], emulated=cuda is not None))
    memory = DeviceRows((("L", row_bytes, slots),), devices[0], cuda=cuda)
    local = IpcBackend("local", mode, device=devices[0], cuda=cuda)
    try:
        local.register(memory.regions)
        lv, pv, ls, ps = views(memory.regions[0], peer.regions[0], rows, 5, "big")
        payload = np.random.default_rng(6).integers(0, 256, rows * row_bytes, dtype=np.uint8).tobytes()
        prefill_hint = peer.describe(pv)  # each end describes its view before the other submits
        if mode is TransferMode.PUSH:
            memory.write("L", ls, payload)
            peer.write("P", ps, b"\x5a" * (rows * row_bytes))
            handle = peer.start("fetch", pv, local.describe(lv))
            attempt = local.publish(lv, prefill_hint)
        else:
            peer.write("P", ps, payload)
            handle = peer.start("publish", pv, local.describe(lv))
            attempt = local.fetch(lv, prefill_hint)
        assert attempt.wait(30), "the local attempt did not end"
        theirs, quiet = peer.result(handle, 30)
        for outcome in (attempt.poll(), theirs):
            assert isinstance(outcome, Delivered) and outcome.all_delivered, outcome
        assert quiet, "the peer's attempt did not quiesce"
        got = peer.read("P", ps) if mode is TransferMode.PUSH else memory.read("L", ls)
        assert got == payload, "the destination rows differ from the source rows"
    finally:
        close_all(local, [peer], memory)


def dead_peers_fail_by_name(*, cuda: ModuleType | None) -> None:
    """A killed fetcher: our next publish fails naming it, and its mapping closes. A fetch of
    ours waiting on a publisher that dies before publishing fails and quiesces."""
    emulated = cuda is not None
    peer = ChildPeer(PeerSpec(TransferMode.PUSH, emulated=emulated))
    peer2: ChildPeer | None = None
    memory = DeviceRows((("L0", 256, 64), ("L1", 96, 40)), cuda=cuda)
    local = IpcBackend("local", TransferMode.PUSH, dead_peer_grace_s=0.1, cuda=cuda)
    try:
        local.register(memory.regions)
        lv, pv, ls, _ = views(memory.regions[0], peer.regions[0], 8, 7)
        memory.write("L0", ls, bytes(range(256)) * 8)
        prefill_hint = peer.describe(pv)
        handle = peer.start("fetch", pv, local.describe(lv))
        first = local.publish(lv, prefill_hint)
        assert first.wait(15) and isinstance(first.poll(), Delivered), first.poll()
        assert peer.result(handle, 15)[0] is not None
        assert len(local._copies.mappings) == 1, "the mapping was not cached after use"
        prefill_hint = peer.describe(pv)
        peer.kill()
        deadline = time.monotonic() + 10
        while len(local._copies.mappings) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(local._copies.mappings) == 0, "the dead peer's mapping was not closed"
        local.describe(lv)
        second = local.publish(lv, prefill_hint)
        assert second.wait(15)
        outcome = second.poll()
        assert isinstance(outcome, Failed) and "gone" in outcome.reason and not outcome.masks[0].any(), outcome

        peer2 = ChildPeer(PeerSpec(TransferMode.PUSH, emulated=emulated))
        lv2, pv2, _, _ = views(memory.regions[0], peer2.regions[0], 8, 8, "r2")
        local.describe(lv2)
        wait = local.fetch(lv2, peer2.describe(pv2))
        time.sleep(0.1)  # the progress thread connects to the peer
        peer2.kill()
        assert wait.wait(15), "a wait on a dead publisher never ended"
        assert isinstance(wait.poll(), Failed) and wait.quiesced(), wait.poll()
    finally:
        close_all(local, [peer] + ([peer2] if peer2 is not None else []), memory)


def doorbells_conclude_waits(mode: TransferMode, *, cuda: ModuleType | None, doorbell: bool = True,
                             transfers: int = 3) -> None:
    """The child waits (push: it fetches; pull: it publishes) with busy_poll; every transfer
    moves all of its rows, so the doorbell rings before the record arrives: the child's waits
    are each concluded by it (none without doorbells), with bytes and masks exact."""
    peer = ChildPeer(PeerSpec(mode, emulated=cuda is not None, busy_poll=True, doorbell=doorbell))
    memory = DeviceRows((("L0", 256, 64),), cuda=cuda)
    local = IpcBackend("local", mode, cuda=cuda)
    try:
        local.register(memory.regions)
        for i in range(transfers):
            lv, pv, ls, ps = views(memory.regions[0], peer.regions[0], 8, i, f"r{i}")
            payload = bytes([i + 1]) * 256 * 8
            if mode is TransferMode.PUSH:
                memory.write("L0", ls, payload)
                peer_hint = peer.describe(pv)
                handle = peer.start("fetch", pv, local.describe(lv))
                attempt = local.publish(lv, peer_hint)
            else:
                peer.write("P0", ps, payload)
                peer_hint = peer.describe(pv)
                handle = peer.start("publish", pv, local.describe(lv))
                attempt = local.fetch(lv, peer_hint)
            assert (peer_hint.extra(EXTRA_BELL) is not None) == doorbell, "the hint's doorbell"
            assert attempt.wait(10) and isinstance(attempt.poll(), Delivered), f"local outcome {attempt.poll()!r}"
            theirs, quiet = peer.result(handle, 10)
            assert isinstance(theirs, Delivered) and theirs.all_delivered and quiet, f"peer outcome {theirs!r}"
            moved = peer.read("P0", ps) if mode is TransferMode.PUSH else memory.read("L0", ls)
            assert moved == payload, f"transfer {i}: rows differ"
        rung = peer.bells_rung()
        assert rung == (transfers if doorbell else 0), f"{rung} of {transfers} waits ended by their doorbell"
    finally:
        close_all(local, [peer], memory)
