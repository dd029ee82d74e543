"""IpcBackend's control path in CI: two processes over kvxfer.testing.host_cuda (shared host
memory standing in for CUDA IPC). The conformance kit, byte-exact rows, and a dead peer.
The same backend over real CUDA is tests/gpu/test_ipc.py, on the GPU machine."""

from __future__ import annotations

import functools
import time

import numpy as np
import pytest

from kvxfer.backends.ipc import IpcBackend
from kvxfer.backends.ipc_pair import ChildPeer, DeviceRows, PeerSpec, ipc_pair
from kvxfer.contract import CacheKind, Cancelled, Delivered, Failed, LayerGroupRows, TokenRange, TransferMode, View
from kvxfer.testing import host_cuda
from kvxfer.testing.conformance import CHECKS


@pytest.mark.parametrize("mode", list(TransferMode), ids=lambda m: m.value)
@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
def test_ipc_conformance_emulated(check, mode):  # type: ignore[no-untyped-def]
    check(functools.partial(ipc_pair, emulated=True), mode)


def _view(region, slots: np.ndarray, request: str) -> View:  # type: ignore[no-untyped-def]
    ords = np.arange(slots.size, dtype=np.int64)
    return View(request, TokenRange(0, slots.size * 16), (LayerGroupRows("g", CacheKind.PAGED, region, slots, ords),),
                b"L")


@pytest.mark.parametrize("mode", list(TransferMode), ids=lambda m: m.value)
def test_large_scattered_rows_byte_exact_emulated(mode: TransferMode) -> None:
    rb, slots, n = 4096, 20_000, 12_000  # past the native call's 8,192-row chunking
    peer = ChildPeer(PeerSpec(mode, geometry=(("P", rb, slots),), emulated=True))
    memory = DeviceRows((("L", rb, slots),), cuda=host_cuda)
    local = IpcBackend("local", mode, cuda=host_cuda)
    try:
        local.register(memory.regions)
        rng = np.random.default_rng(3)
        ls, ps = (rng.permutation(slots)[:n].astype(np.int64) for _ in range(2))
        lv, pv = _view(memory.regions[0], ls, "big"), _view(peer.regions[0], ps, "big")
        payload = rng.integers(0, 256, n * rb, dtype=np.uint8).tobytes()
        hint_p = peer.describe(pv)  # each end describes its view before the other submits
        if mode is TransferMode.PUSH:
            memory.write("L", ls, payload)
            handle = peer.start("fetch", pv, local.describe(lv))
            attempt = local.publish(lv, hint_p)
        else:
            peer.write("P", ps, payload)
            handle = peer.start("publish", pv, local.describe(lv))
            attempt = local.fetch(lv, hint_p)
        assert attempt.wait(30)
        theirs, quiet = peer.result(handle, 30)
        for outcome in (attempt.poll(), theirs):
            assert isinstance(outcome, Delivered) and outcome.all_delivered, outcome
        assert quiet
        got = peer.read("P", ps) if mode is TransferMode.PUSH else memory.read("L", ls)
        assert got == payload
    finally:
        assert local.shutdown() == frozenset()
        peer.close()
        memory.close()


def test_dead_fetcher_fails_the_next_publish_by_name_emulated() -> None:
    peer = ChildPeer(PeerSpec(TransferMode.PUSH, emulated=True))
    memory = DeviceRows((("L0", 256, 64),), cuda=host_cuda)
    local = IpcBackend("local", TransferMode.PUSH, dead_peer_grace_s=0.1, cuda=host_cuda)
    try:
        local.register(memory.regions)
        ls = np.arange(8, dtype=np.int64)
        lv, pv = _view(memory.regions[0], ls, "r"), _view(peer.regions[0], ls + 3, "r")
        hint = peer.describe(pv)
        handle = peer.start("fetch", pv, local.describe(lv))
        first = local.publish(lv, hint)
        assert first.wait(15) and isinstance(first.poll(), Delivered)
        assert peer.result(handle, 15)[0] is not None
        assert len(local._mappings) == 1  # cached after use
        hint = peer.describe(pv)
        peer.kill()
        deadline = time.monotonic() + 10
        while len(local._mappings) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(local._mappings) == 0, "the dead peer's mapping was not closed"
        local.describe(lv)
        second = local.publish(lv, hint)
        assert second.wait(15)
        outcome = second.poll()
        assert isinstance(outcome, Failed) and "gone" in outcome.reason and not outcome.masks[0].any()
    finally:
        assert local.shutdown() == frozenset()
        peer.close()
        memory.close()


def test_cancel_arriving_during_a_launch_is_answered_after_the_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    """The peer cancels while our kernels are being queued: its request must find the job
    (and be answered once the copy ended), not be told 'withdrawn' while rows still move."""
    import threading

    real_copy = host_cuda.cuda_copy_rows

    def slow_copy(*args, **kwargs):  # type: ignore[no-untyped-def]
        time.sleep(0.5)  # the launch is still going on when the cancel arrives
        return real_copy(*args, **kwargs)

    monkeypatch.setattr(host_cuda, "cuda_copy_rows", slow_copy)  # this process only: the publisher
    peer = ChildPeer(PeerSpec(TransferMode.PUSH, emulated=True))
    memory = DeviceRows((("L0", 256, 64),), cuda=host_cuda)
    local = IpcBackend("local", TransferMode.PUSH, cuda=host_cuda)
    try:
        local.register(memory.regions)
        ls = np.arange(8, dtype=np.int64)
        lv, pv = _view(memory.regions[0], ls, "r"), _view(peer.regions[0], ls, "r")
        hint = peer.describe(pv)
        handle = peer.start("fetch", pv, local.describe(lv))
        attempts: list = []
        publisher = threading.Thread(target=lambda: attempts.append(local.publish(lv, hint)))
        publisher.start()
        time.sleep(0.15)
        peer.cancel(handle)
        publisher.join(10)
        assert attempts and attempts[0].wait(15)
        # The request found the job: the transfer was not withdrawn under the running copy.
        assert (hint.agent, hint.transfer_id) not in local._revoked
        mine = attempts[0].poll()
        # Delivered when our record went out before the request was read, else cancelled by the peer.
        assert isinstance(mine, Delivered) or (isinstance(mine, Cancelled) and mine.by_peer), mine
        assert all(m.all() for m in mine.masks)
        theirs, quiet = peer.result(handle, 15)
        assert isinstance(theirs, Cancelled) and quiet
    finally:
        assert local.shutdown() == frozenset()
        peer.close()
        memory.close()
