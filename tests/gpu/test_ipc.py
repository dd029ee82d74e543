"""IpcBackend on one GPU, two processes: the conformance kit, byte-exact rows, dead peers.

Run on the GPU machine: ``python -m pytest -q -m gpu tests/gpu/test_ipc.py``.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from kvxfer import native
from kvxfer.contract import CacheKind, Delivered, Failed, LayerGroupRows, TokenRange, TransferMode, View
from kvxfer.testing.conformance import CHECKS

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not native.info().cuda_usable, reason=f"kvxfer._native CUDA: {native.info().reason}"),
]

from kvxfer.backends.ipc import IpcBackend  # noqa: E402
from kvxfer.backends.ipc_pair import ChildPeer, DeviceRows, PeerSpec, ipc_pair  # noqa: E402


@pytest.mark.parametrize("mode", list(TransferMode), ids=lambda m: m.value)
@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
def test_ipc_conformance(check, mode):  # type: ignore[no-untyped-def]
    check(ipc_pair, mode)


def _views(local_region, peer_region, n: int, seed: int) -> tuple[View, View, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    ls = rng.permutation(local_region.slots)[:n].astype(np.int64)
    ps = rng.permutation(peer_region.slots)[:n].astype(np.int64)
    ords = np.arange(n, dtype=np.int64)
    tokens = TokenRange(0, n * 16)
    lv = View("big", tokens, (LayerGroupRows("g", CacheKind.PAGED, local_region, ls, ords),), b"L")
    pv = View("big", tokens, (LayerGroupRows("g", CacheKind.PAGED, peer_region, ps, ords),), b"L")
    return lv, pv, ls, ps


@pytest.mark.parametrize("mode", list(TransferMode), ids=lambda m: m.value)
def test_large_scattered_push_and_pull_byte_exact(mode: TransferMode) -> None:
    rb, slots, n = 64 * 1024, 600, 512  # 32 MiB of scattered 64 KiB rows
    peer = ChildPeer(PeerSpec(mode, geometry=(("P", rb, slots),)))
    memory = DeviceRows((("L", rb, slots),))
    local = IpcBackend("local", mode)
    try:
        local.register(memory.regions)
        lv, pv, ls, ps = _views(memory.regions[0], peer.regions[0], n, 5)
        payload = np.random.default_rng(6).integers(0, 256, n * rb, dtype=np.uint8).tobytes()
        memory.write("L", ls, payload)
        peer.write("P", ps, b"\x5a" * (n * rb))
        hint_l = local.describe(lv)
        hint_p = peer.describe(pv)
        handle = peer.start("fetch", pv, hint_l)
        attempt = local.publish(lv, hint_p)
        assert attempt.wait(30)
        outcome = attempt.poll()
        peer_outcome, quiet = peer.result(handle, 30)
        assert isinstance(outcome, Delivered) and outcome.masks[0].all(), outcome
        assert isinstance(peer_outcome, Delivered) and peer_outcome.masks[0].all() and quiet, peer_outcome
        assert peer.read("P", ps) == payload
    finally:
        assert local.shutdown() == frozenset()
        peer.close()
        memory.close()


def test_dead_peer_mapping_dropped_and_waits_fail() -> None:
    """A killed fetcher: the publisher's next submission fails by name and its mapping closes;
    a fetch waiting on a killed publisher fails and quiesces."""
    mode = TransferMode.PUSH
    peer = ChildPeer(PeerSpec(mode))
    memory = DeviceRows((("L0", 256, 64), ("L1", 96, 40)))
    local = IpcBackend("local", mode, dead_peer_grace_s=0.1)
    try:
        local.register(memory.regions)
        lv, pv, ls, ps = _views(memory.regions[0], peer.regions[0], 8, 7)
        memory.write("L0", ls, bytes(range(256)) * 8)
        hint_p = peer.describe(pv)
        handle = peer.start("fetch", pv, local.describe(lv))
        first = local.publish(lv, hint_p)
        assert first.wait(15) and isinstance(first.poll(), Delivered)
        assert peer.result(handle, 15)[0] is not None
        assert len(local._mappings) == 1  # cached after use
        hint_p = peer.describe(pv)
        peer.kill()
        deadline = time.monotonic() + 10
        while len(local._mappings) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(local._mappings) == 0, "the dead peer's mapping was not closed"
        local.describe(lv)
        second = local.publish(lv, hint_p)
        assert second.wait(15)
        assert isinstance(second.poll(), Failed) and "gone" in second.poll().reason  # type: ignore[union-attr]
        assert not second.poll().masks[0].any()  # type: ignore[union-attr]

        # Now the other role: we wait for a publisher that dies before publishing.
        peer2 = ChildPeer(PeerSpec(mode))
        try:
            lv2, pv2, _, _ = _views(memory.regions[0], peer2.regions[0], 8, 8)
            local.describe(lv2)
            wait = local.fetch(lv2, peer2.describe(pv2))
            time.sleep(0.1)  # the progress thread connects to the peer
            peer2.kill()
            assert wait.wait(15), "a wait on a dead publisher never ended"
            assert isinstance(wait.poll(), Failed) and wait.quiesced()
        finally:
            peer2.close()
    finally:
        local.shutdown()
        peer.close()
        memory.close()


def test_shutdown_leaves_nothing_running() -> None:
    before = {t.ident for t in threading.enumerate()}
    pair = ipc_pair(TransferMode.PUSH)
    pair.close()
    time.sleep(0.05)
    left = [t for t in threading.enumerate() if t.ident not in before and t.is_alive()]
    assert not left, left
    assert pair.peer._proc.exitcode is not None  # type: ignore[attr-defined]
