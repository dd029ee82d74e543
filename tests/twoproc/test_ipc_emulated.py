"""IpcBackend's control path in CI: two processes over kvxfer.testing.host_cuda (shared host
memory standing in for CUDA IPC). The conformance kit with copies done at once and with
copies still in flight (deferred mode), byte-exact rows, dead peers, a cancel mid-launch.
The same backend over real CUDA is tests/gpu/test_ipc.py, on the GPU machine."""

from __future__ import annotations

import functools
import threading

import pytest

from kvxfer.backends.ipc import IpcBackend
from kvxfer.contract import Cancelled, Delivered, Failed, TransferMode
from kvxfer.testing import host_cuda
from kvxfer.testing.conformance import CHECKS
from kvxfer.testing.ipc_pairs import ChildPeer, DeviceRows, PeerSpec, ipc_pair
from kvxfer.testing.ipc_scenarios import close_all, dead_peers_fail_by_name, large_rows_byte_exact, views
from kvxfer.testing.waiting import settle

DELAY = host_cuda.DELAY_ENV  # deferred mode: copies land this long after queueing



@pytest.mark.parametrize("delay", ["0", "0.003"], ids=["at-once", "in-flight"])
@pytest.mark.parametrize("mode", list(TransferMode), ids=lambda m: m.value)
@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
def test_ipc_conformance_emulated(check, mode, delay, monkeypatch):  # type: ignore[no-untyped-def]
    monkeypatch.setenv(DELAY, delay)  # the spawned peer inherits it
    check(functools.partial(ipc_pair, emulated=True), mode)


@pytest.mark.parametrize("mode", list(TransferMode), ids=lambda m: m.value)
def test_large_scattered_rows_byte_exact_emulated(mode: TransferMode) -> None:
    large_rows_byte_exact(mode, cuda=host_cuda, row_bytes=4096, slots=20_000, rows=12_000)


def test_dead_peers_fail_by_name_emulated() -> None:
    dead_peers_fail_by_name(cuda=host_cuda)


def test_peer_dying_mid_copy_keeps_its_mapping_until_the_copy_ends(monkeypatch: pytest.MonkeyPatch) -> None:
    # Deferred mode, and once ``holding`` is set every copy queued on a stream (not stream 0:
    # DeviceRows' own) waits for ``copy_may_run``: the copy is still in flight when the peer
    # dies, however slow we are.
    monkeypatch.setenv(DELAY, "0.001")
    holding, copying, copy_may_run = threading.Event(), threading.Event(), threading.Event()
    real_enqueue = host_cuda._enqueue

    def held_enqueue(stream, fn):  # type: ignore[no-untyped-def]
        if stream == 0 or not holding.is_set():
            return real_enqueue(stream, fn)

        def held() -> None:
            copying.set()
            copy_may_run.wait(15)
            fn()

        return real_enqueue(stream, held)

    monkeypatch.setattr(host_cuda, "_enqueue", held_enqueue)  # this process only: the publisher
    peer = ChildPeer(PeerSpec(TransferMode.PUSH, emulated=True))
    memory = DeviceRows((("L0", 256, 64),), cuda=host_cuda)
    local = IpcBackend("local", TransferMode.PUSH, cuda=host_cuda)
    try:
        local.register(memory.regions)
        # A first push connects us to the peer: its socket is watched from then on, so its
        # death is seen at once, not only when a record to it cannot be sent.
        lv, pv, _, _ = views(memory.regions[0], peer.regions[0], 8, 0, "first")
        hint = peer.describe(pv)
        handle = peer.start("fetch", pv, local.describe(lv))
        first = local.publish(lv, hint)
        assert first.wait(10) and isinstance(first.poll(), Delivered), first.poll()
        assert isinstance(peer.result(handle, 10)[0], Delivered)
        assert settle(lambda: hint.endpoint in local._channel._outbound), "not connected to the peer"
        holding.set()
        lv, pv, _, _ = views(memory.regions[0], peer.regions[0], 8, 1)
        hint = peer.describe(pv)
        peer.start("fetch", pv, local.describe(lv))
        attempt = local.publish(lv, hint)
        assert copying.wait(10), "the copy never reached its stream"
        peer.kill()
        # The progress thread sees the peer go while the copy is in flight.
        assert settle(lambda: local._copies.gone, 10.0), "the peer's death was not seen"
        assert attempt.poll() is None and len(local._copies.mappings) == 1, "closed under a running copy"
        copy_may_run.set()
        assert attempt.wait(15)
        outcome = attempt.poll()
        assert isinstance(outcome, Failed) and "gone" in outcome.reason, outcome
        assert settle(lambda: len(local._copies.mappings) == 0)
    finally:
        copy_may_run.set()
        close_all(local, [peer], memory)


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
        lv, pv, _, _ = views(memory.regions[0], peer.regions[0], 8, 2)
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
        close_all(local, [peer], memory)


def test_emulated_handles_never_name_a_later_allocation() -> None:
    ptr = host_cuda.device_alloc(0, 4096)
    handle, _, _ = host_cuda.ipc_export(0, ptr)
    host_cuda.device_free(0, ptr)
    again = host_cuda.device_alloc(0, 4096)  # likely the same fd number
    try:
        assert host_cuda.ipc_export(0, again)[0] != handle
    finally:
        host_cuda.device_free(0, again)


@pytest.mark.parametrize("mode", list(TransferMode), ids=lambda m: m.value)
def test_signed_pair_moves_rows_with_exact_masks(mode: TransferMode, monkeypatch: pytest.MonkeyPatch) -> None:
    # With KVXFER_HINT_KEY set on both ends (the child inherits it), "every row delivered"
    # travels as a key-derived token and everything else as signed records.
    monkeypatch.setenv("KVXFER_HINT_KEY", "ab" * 32)
    large_rows_byte_exact(mode, cuda=host_cuda, row_bytes=256, slots=400, rows=300)
    wanted = {"check_round_trip_exact", "check_missing_counterpart_false", "check_partial_failure_exact",
              "check_cancel_before_peer_starts"}
    assert len([c for c in CHECKS if c.__name__ in wanted]) == len(wanted)
    for check in CHECKS:
        if check.__name__ in wanted:
            check(functools.partial(ipc_pair, emulated=True), mode)


@pytest.mark.parametrize("mode", list(TransferMode), ids=lambda m: m.value)
def test_busy_poll_pair_keeps_the_contract(mode: TransferMode, monkeypatch: pytest.MonkeyPatch) -> None:
    # busy_poll changes how the progress threads wait, nothing else: rows, masks, cancels and
    # shutdown as without it (copies in flight, so that both waiting paths run).
    monkeypatch.setenv(DELAY, "0.003")
    wanted = {"check_round_trip_exact", "check_partial_failure_exact", "check_cancel", "check_shutdown"}
    assert len([c for c in CHECKS if c.__name__ in wanted]) == len(wanted)
    for check in CHECKS:
        if check.__name__ in wanted:
            check(functools.partial(ipc_pair, emulated=True, busy_poll=True), mode)


def test_small_copy_tells_the_peer_in_the_call_that_waits_for_its_event(monkeypatch: pytest.MonkeyPatch) -> None:
    # Once connected to the peer, a small publish that moves every row waits for its event and
    # writes the 20-byte token frame in one call (event_spin_send), from the owner's thread.
    calls: list[tuple[int, int]] = []
    real = host_cuda.event_spin_send

    def counted(event: int, spin_us: int, fd: int, frame: bytes, *check: int) -> tuple[bool, int]:
        done, sent = real(event, spin_us, fd, frame, *check)  # check: the row check's verdict bytes
        calls.append((fd, sent))
        return done, sent

    monkeypatch.setattr(host_cuda, "event_spin_send", counted)
    peer = ChildPeer(PeerSpec(TransferMode.PUSH, emulated=True))
    memory = DeviceRows((("L0", 256, 64),), cuda=host_cuda)
    local = IpcBackend("local", TransferMode.PUSH, cuda=host_cuda)
    try:
        local.register(memory.regions)
        for i in range(3):
            lv, pv, ls, ps = views(memory.regions[0], peer.regions[0], 8, i, f"r{i}")
            memory.write("L0", ls, bytes([i]) * 256 * 8)
            hint = peer.describe(pv)
            handle = peer.start("fetch", pv, local.describe(lv))
            attempt = local.publish(lv, hint)
            assert attempt.wait(10) and isinstance(attempt.poll(), Delivered)
            theirs, quiet = peer.result(handle, 10)
            assert isinstance(theirs, Delivered) and theirs.all_delivered and quiet
            assert peer.read("P0", ps) == bytes([i]) * 256 * 8
        assert len(calls) == 3 and calls[0] == (-1, 0)  # the first: not connected yet, sent after
        assert all(fd >= 0 and sent == 24 for fd, sent in calls[1:])  # 4-byte length + 20-byte frame
    finally:
        close_all(local, [peer], memory)
