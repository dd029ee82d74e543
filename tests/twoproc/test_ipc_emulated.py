"""IpcBackend's control path in CI: two processes over kvxfer.testing.host_cuda (shared host
memory standing in for CUDA IPC). The conformance kit with copies done at once and with
copies still in flight (deferred mode), byte-exact rows, dead peers, a cancel mid-launch.
The same backend over real CUDA is tests/gpu/test_ipc.py, on the GPU machine."""

from __future__ import annotations

import functools
import multiprocessing as mp
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest

from kvxfer.backends.ipc import IpcBackend
from kvxfer.backends.ipc_pair import ChildPeer, DeviceRows, PeerSpec, ipc_pair
from kvxfer.contract import CacheKind, Cancelled, Delivered, Failed, LayerGroupRows, TokenRange, TransferMode, View
from kvxfer.testing import host_cuda
from kvxfer.testing.conformance import CHECKS

DELAY = "KVXFER_HOST_CUDA_DELAY_S"  # deferred mode: copies land this long after queueing


@pytest.fixture(autouse=True)
def no_ipc_child_left() -> Iterator[None]:
    yield
    left = [p for p in mp.active_children() if p.name == "kvxfer-ipc-peer"]
    assert not left, f"IPC peer processes left running: {left}"


@pytest.mark.parametrize("delay", ["0", "0.003"], ids=["at-once", "in-flight"])
@pytest.mark.parametrize("mode", list(TransferMode), ids=lambda m: m.value)
@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
def test_ipc_conformance_emulated(check, mode, delay, monkeypatch):  # type: ignore[no-untyped-def]
    monkeypatch.setenv(DELAY, delay)  # the spawned peer inherits it
    check(functools.partial(ipc_pair, emulated=True), mode)


def _view(region, slots: np.ndarray, request: str) -> View:  # type: ignore[no-untyped-def]
    ords = np.arange(slots.size, dtype=np.int64)
    return View(request, TokenRange(0, slots.size * 16), (LayerGroupRows("g", CacheKind.PAGED, region, slots, ords),),
                b"L")


def _close(local: IpcBackend, peer: ChildPeer, memory: DeviceRows) -> None:
    """Close everything first, then assert: a failed shutdown must not leak the peer."""
    try:
        left = local.shutdown()
    finally:
        peer.close()
        memory.close()
    assert left == frozenset(), f"attempts not quiesced at shutdown: {left}"


@pytest.mark.parametrize("mode", list(TransferMode), ids=lambda m: m.value)
def test_large_scattered_rows_byte_exact_emulated(mode: TransferMode) -> None:
    rb, slots, n = 4096, 20_000, 12_000
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
        _close(local, peer, memory)


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
        _close(local, peer, memory)


def test_peer_dying_mid_copy_keeps_its_mapping_until_the_copy_ends(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(DELAY, "0.4")  # the copy is still queued when the peer dies
    peer = ChildPeer(PeerSpec(TransferMode.PUSH, emulated=True))
    memory = DeviceRows((("L0", 256, 64),), cuda=host_cuda)
    local = IpcBackend("local", TransferMode.PUSH, cuda=host_cuda)
    try:
        local.register(memory.regions)
        ls = np.arange(8, dtype=np.int64)
        lv, pv = _view(memory.regions[0], ls, "r"), _view(peer.regions[0], ls, "r")
        hint = peer.describe(pv)
        peer.start("fetch", pv, local.describe(lv))
        attempt = local.publish(lv, hint)
        peer.kill()
        time.sleep(0.15)  # the progress thread sees the peer go while the copy is in flight
        assert attempt.poll() is None and len(local._mappings) == 1, "closed under a running copy"
        assert attempt.wait(15)
        outcome = attempt.poll()
        assert isinstance(outcome, Failed) and "gone" in outcome.reason, outcome
        deadline = time.monotonic() + 5
        while len(local._mappings) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(local._mappings) == 0
    finally:
        _close(local, peer, memory)


def test_cancel_arriving_during_a_launch_is_answered_after_the_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    """The peer cancels while our kernels are being queued: its request must find the job
    (and be answered once the copy ended), not be told 'withdrawn' while rows still move."""
    entered, seen = threading.Event(), threading.Event()
    real_copy = host_cuda.cuda_copy_rows

    def held_copy(*args, **kwargs):  # type: ignore[no-untyped-def]
        entered.set()
        seen.wait(10)  # the launch goes on until the peer's request has reached our thread
        return real_copy(*args, **kwargs)

    monkeypatch.setattr(host_cuda, "cuda_copy_rows", held_copy)  # this process only: the publisher
    peer = ChildPeer(PeerSpec(TransferMode.PUSH, emulated=True))
    memory = DeviceRows((("L0", 256, 64),), cuda=host_cuda)
    local = IpcBackend("local", TransferMode.PUSH, cuda=host_cuda)
    on_cancel_request = local._on_cancel_request

    def seen_then_handle(record):  # type: ignore[no-untyped-def]
        seen.set()
        on_cancel_request(record)

    local._on_cancel_request = seen_then_handle  # type: ignore[method-assign]
    try:
        local.register(memory.regions)
        ls = np.arange(8, dtype=np.int64)
        lv, pv = _view(memory.regions[0], ls, "r"), _view(peer.regions[0], ls, "r")
        hint = peer.describe(pv)
        handle = peer.start("fetch", pv, local.describe(lv))
        attempts: list = []
        publisher = threading.Thread(target=lambda: attempts.append(local.publish(lv, hint)))
        publisher.start()
        assert entered.wait(10)
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
        seen.set()
        _close(local, peer, memory)


def test_emulated_handles_never_name_a_later_allocation() -> None:
    ptr = host_cuda.device_alloc(0, 4096)
    handle, _, _ = host_cuda.ipc_export(0, ptr)
    host_cuda.device_free(0, ptr)
    again = host_cuda.device_alloc(0, 4096)  # likely the same fd number
    try:
        assert host_cuda.ipc_export(0, again)[0] != handle
    finally:
        host_cuda.device_free(0, again)
