"""The IPC backend's CPU-side parts: clean import and refusal without CUDA, the record
channel between processes' sockets, and the mapping cache's close-after-quiescence rule."""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest

from kvxfer import native
from kvxfer.backends.ipc.channel import Channel
from kvxfer.backends.ipc.mappings import Export, Mappings
from kvxfer.contract import CompletionRecord, RecordStatus
from kvxfer.testing.waiting import settle
from kvxfer.wire import decode_completion, encode_completion


def test_backend_imports_and_refuses_without_cuda() -> None:
    from kvxfer.backends.ipc import IpcBackend, IpcUnavailable

    if native.info().cuda_usable:
        pytest.skip("CUDA is usable here: tests/gpu/test_ipc.py covers the backend")
    with pytest.raises(IpcUnavailable, match="needs kvxfer._native with CUDA") as err:
        IpcBackend()
    assert native.info().reason in str(err.value)


def test_channel_delivers_frames_and_sees_peer_go() -> None:
    a, b = Channel("a"), Channel("b")
    try:
        record = CompletionRecord("t1", a.path, "req", RecordStatus.DELIVERED, [np.array([True, False, True])])
        big = b"x" * (3 << 20)  # several socket buffers' worth: framing must reassemble it
        assert a.send(b.endpoint, encode_completion(record, b""))
        sent: list[bool] = []
        sender = threading.Thread(target=lambda: sent.append(a.send(b.endpoint, big)))
        sender.start()  # it blocks until b reads: the peer's progress thread always does
        got: list[bytes] = []
        end = time.monotonic() + 10
        while len(got) < 2 and time.monotonic() < end:
            frames, gone = b.wait(0.01)
            got += frames
            assert not gone
        sender.join(10)
        assert sent == [True]
        assert len(got) == 2 and got[1] == big
        back = decode_completion(got[0], b"")
        assert back.transfer_id == "t1" and back.masks[0].tolist() == [True, False, True]
        assert a.reachable(b.endpoint)
        b.close()
        assert not os.path.exists(b.path)
        seen_gone: list[bytes] = []
        end = time.monotonic() + 10
        while not seen_gone and time.monotonic() < end:
            seen_gone += a.wait(0.01)[1]
        assert seen_gone == [b.endpoint]
        assert not a.send(b.endpoint, b"late")  # nobody listens any more
        assert not a.reachable(b.endpoint)
    finally:
        a.close()
        b.close()


def test_wake_interrupts_a_wait() -> None:
    a = Channel("w")
    try:
        a.wake()
        t0 = time.monotonic()
        a.wait(60.0)
        assert time.monotonic() - t0 < 30.0  # not the full wait: generous, for a loaded machine
    finally:
        a.close()


class FakeCuda:
    """Stands in for the CUDA IPC calls (this machine has no GPU): records opens and closes."""

    class CopyError(RuntimeError):
        pass

    def __init__(self) -> None:
        self.opened: list[bytes] = []
        self.closed: list[int] = []

    def ipc_open(self, device: int, handle: bytes) -> int:
        self.opened.append(handle)
        return 0x1000 * len(self.opened)

    def ipc_close(self, device: int, base: int) -> None:
        self.closed.append(base)


def test_mappings_open_once_and_close_only_when_unused() -> None:
    cuda = FakeCuda()
    maps = Mappings(cuda, 0)  # type: ignore[arg-type]
    exp = Export(b"h" * 64, alloc_base=1 << 40, alloc_size=1 << 20)
    m1 = maps.acquire(b"peer", exp)
    m2 = maps.acquire(b"peer", exp)
    assert m1 is m2 and cuda.opened == [exp.handle]
    assert m1.translate((1 << 40) + 4096, 4096) == m1.base + 4096
    assert m1.translate((1 << 40) + (1 << 20) - 10, 4096) is None  # past the allocation
    maps.release(m1)
    maps.peer_gone(b"peer")
    assert cuda.closed == []  # one copy is still in flight on it
    with pytest.raises(RuntimeError, match="gone"):
        maps.acquire(b"peer", exp)
    maps.release(m2)
    assert cuda.closed == [m1.base] and len(maps) == 0
    assert Export.unpack(exp.pack(), "r") == exp


@pytest.mark.parametrize("n", [3, 128, 129, 5000])
def test_ordinal_comparison_small_and_large(n: int) -> None:
    from kvxfer.backends.common.matching import _same

    a = np.arange(n, dtype=np.int64)
    b = a.copy()
    assert _same(a, b)
    b[-1] += 1
    assert not _same(a, b)
    assert not _same(a, a[:-1])


def test_try_send_never_waits_and_flush_finishes_a_partial_frame() -> None:
    a, b = Channel("a"), Channel("b")
    try:
        assert not a.try_send(b.endpoint, b"early")  # not connected yet: left to send()
        assert a.send(b.endpoint, b"first")
        big = bytes(range(256)) * (16 << 10)  # 4 MiB: far more than a socket buffer holds
        assert a.try_send(b.endpoint, big)  # took part of it; the rest is pending
        assert not a.try_send(b.endpoint, b"x")  # behind a pending tail: refused, not interleaved
        got: list[bytes] = []
        for _ in range(500):
            assert a.flush() == []
            got += b.wait(0.01)[0]
            if len(got) == 2:
                break
        assert got == [b"first", big]
        assert a.try_send(b.endpoint, b"after")  # the connection is clear again
        assert a.send(b.endpoint, b"last")
        for _ in range(200):
            got += b.wait(0.01)[0]
            if len(got) == 4:
                break
        assert got[2:] == [b"after", b"last"]  # in order, whole
    finally:
        a.close()
        b.close()


def test_emulated_event_spin_send_waits_up_to_its_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    # The owner's bounded wait for a small copy and its write to the peer (IpcBackend._send_if_copied),
    # as host_cuda emulates kvxfer._native.event_spin_send.
    import socket

    from kvxfer.testing import host_cuda

    monkeypatch.setenv("KVXFER_HOST_CUDA_DELAY_S", "0.001")  # deferred mode
    stream = host_cuda.stream_create(0)
    event = host_cuda.event_create(0)
    src = np.arange(64, dtype=np.uint8)
    dst = np.zeros(64, dtype=np.uint8)
    a, b = socket.socketpair()
    b.setblocking(False)
    copy_may_run = threading.Event()

    def held() -> None:
        copy_may_run.wait(10)

    try:
        # The stream runs nothing before copy_may_run is set: the copy is in flight until then.
        host_cuda._enqueue(stream, held)
        host_cuda.cuda_copy_rows(src.ctypes.data, 16, None, dst.ctypes.data, 16, None, 4, 16, stream, 0, -1, -1)
        host_cuda.event_record(event, stream)
        assert host_cuda.event_spin_send(event, 1000, a.fileno(), b"frame") == (False, 0)  # gave up after 1 ms
        with pytest.raises(BlockingIOError):
            b.recv(16)
        copy_may_run.set()
        assert host_cuda.event_spin_send(event, 5_000_000, a.fileno(), b"frame") == (True, 5)
        assert b.recv(16) == b"frame" and dst.tolist() == src.tolist()
    finally:
        copy_may_run.set()
        host_cuda.stream_synchronize(stream)
        host_cuda.event_destroy(event)
        host_cuda.stream_destroy(stream)
        a.close()
        b.close()


@pytest.mark.parametrize("key", [b"", b"k" * 32], ids=["unsigned", "signed"])
def test_every_row_delivered_travels_as_a_token_and_anything_else_as_a_record(key: bytes) -> None:
    # "DELIVERED, every row" is 20 bytes (DONE_PREFIX + a token the passive end can look up);
    # partial records are decoded as before; a token without its wait waits for it; a token
    # nobody was given concludes nothing. Signed: the token comes from the key and the sender.
    from kvxfer.backends.ipc.backend import IpcBackend
    from kvxfer.backends.ipc.frames import DONE_PREFIX, EXTRA_DONE
    from kvxfer.contract import Delivered, TransferMode
    from kvxfer.testing import host_cuda
    from kvxfer.testing.ipc_pairs import DeviceRows
    from kvxfer.testing.ipc_scenarios import views

    d_mem = DeviceRows((("D", 64, 32),), cuda=host_cuda)
    p_mem = DeviceRows((("P", 64, 32),), cuda=host_cuda)
    decode = IpcBackend("decode", TransferMode.PUSH, cuda=host_cuda, key=key)
    prefill = IpcBackend("prefill", TransferMode.PUSH, cuda=host_cuda, key=key)  # it only describes and sends
    try:
        decode.register(d_mem.regions)
        prefill.register(p_mem.regions)
        hints, attempts, dvs, pvs = [], [], [], []
        for i in range(4):
            dv, pv, _, _ = views(d_mem.regions[0], p_mem.regions[0], 10, i, f"r{i}")
            hints.append(decode.describe(dv))
            dvs.append(dv)
            pvs.append(prefill.describe(pv))
        assert all((h.extra(EXTRA_DONE) is None) == bool(key) for h in hints)  # signed hints carry no token

        def token(i: int, sender: str) -> bytes:
            if key:
                return prefill._frames.done_token(hints[i].transfer_id, sender, f"r{i}")
            return hints[i].extra(EXTRA_DONE) or b""

        def send(frame: bytes) -> None:
            assert prefill._channel.send(decode._channel.endpoint, frame)

        send(DONE_PREFIX + token(3, prefill.name))  # before its fetch: kept for it
        assert settle(lambda: decode._waits.early), "the early token was not kept"
        attempts = [decode.fetch(dvs[i], pvs[i]) for i in range(4)]
        prebuilt = {w.own_id: w.delivered for w in decode._waits.by_token.values()}
        partial = np.ones(10, dtype=np.bool_)
        partial[3] = False
        send(DONE_PREFIX + token(0, prefill.name))
        send(encode_completion(CompletionRecord(hints[1].transfer_id, prefill.name, "r1", RecordStatus.DELIVERED,
                                                [partial], ""), key))
        wrong = token(2, "someone-else") if key else bytes(16)
        send(DONE_PREFIX + wrong)  # not its token
        for i in (0, 1, 3):
            assert attempts[i].wait(5), i
        first, second, fourth = attempts[0].poll(), attempts[1].poll(), attempts[3].poll()
        assert isinstance(first, Delivered) and first is prebuilt[hints[0].transfer_id]
        assert isinstance(second, Delivered) and second.masks[0].tolist() == partial.tolist()
        assert isinstance(fourth, Delivered) and fourth.all_delivered
        # The wrong token was handled (kept for a wait that may come), and concluded nothing.
        assert settle(lambda: wrong in decode._waits.early), "the wrong token was not handled"
        assert attempts[2].poll() is None and not attempts[2].quiesced()
        assert [w.own_id for w in decode._waits.by_token.values()] == [hints[2].transfer_id]  # ended waits leave
        send(DONE_PREFIX + token(2, prefill.name))
        assert attempts[2].wait(5) and isinstance(attempts[2].poll(), Delivered)
        assert decode._waits.by_token == {}
    finally:
        decode.shutdown()
        prefill.shutdown()
        d_mem.close()
        p_mem.close()


def test_channel_spin_sees_input_without_sleeping_and_leaves_the_gil_free() -> None:
    a, b = Channel("spin-a"), Channel("spin-b")
    counted = [0]
    stop = threading.Event()

    def count() -> None:  # progresses during spin() only if spin() released the GIL
        while not stop.is_set():
            counted[0] += 1

    counter = threading.Thread(target=count)
    counter.start()
    try:
        before, start = counted[0], time.perf_counter()
        assert a.spin(0.2) is False  # nothing came: it gave up after its time
        assert time.perf_counter() - start >= 0.2
        assert counted[0] - before > 1000
        assert b.send(a.endpoint, b"hello")
        frames: list[bytes] = []
        deadline = time.monotonic() + 5
        while not frames and time.monotonic() < deadline:
            assert a.spin(5.0) is True  # the connection, then the frame, end the spin at once
            frames += a.wait(0.0)[0]
        assert frames == [b"hello"]
    finally:
        stop.set()
        counter.join()
        a.close()
        b.close()


@pytest.fixture(params=[True, False], ids=["native", "python-fallback"])
def spin_impl(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """native.spin_poll through kvxfer._native, then through its Python fallback."""
    if not request.param:
        monkeypatch.setattr(native, "_NATIVE", None)
    elif native._NATIVE is None:
        pytest.skip("kvxfer._native is not built")


def test_spin_poll_returns_on_input_or_after_its_time(spin_impl: None) -> None:
    r, w = os.pipe()
    try:
        start = time.perf_counter()
        assert native.spin_poll([r], 0.02) is False and time.perf_counter() - start >= 0.02
        os.write(w, b"x")
        assert native.spin_poll([r], 5.0) is True
    finally:
        os.close(r)
        os.close(w)


def test_spin_poll_returns_when_a_watched_word_is_set(spin_impl: None) -> None:
    # Doorbell words (kvxfer.backends.ipc.doorbells): watched ones end the spin, others do not.
    r, w = os.pipe()
    try:
        words = np.zeros(8, dtype=np.uint64)
        slots = np.array([2, 6], dtype=np.int64)
        assert native.spin_poll([r], 0.01, words, slots) is False
        words[4] = 1  # not watched
        assert native.spin_poll([r], 0.01, words, slots) is False
        words[6] = 3
        assert native.spin_poll([r], 5.0, words, slots) is True
        with pytest.raises(ValueError, match="slots must lie in"):
            native.spin_poll([r], 0.01, words, np.array([8], dtype=np.int64))
    finally:
        os.close(r)
        os.close(w)


def test_send_with_lends_the_socket_only_when_a_frame_can_go_now() -> None:
    a, b = Channel("a"), Channel("b")
    calls: list[int] = []

    def write_all(fd: int, data: bytes) -> int:
        calls.append(fd)
        return os.write(fd, data) if fd >= 0 else 0

    try:
        assert not a.send_with(b.endpoint, b"early", write_all) and calls == [-1]  # not connected yet
        assert a.send(b.endpoint, b"first")
        assert a.send_with(b.endpoint, b"native", write_all) and calls[-1] >= 0
        with a._write_lock:  # another thread is writing: no socket lent, nothing written
            result: list[bool] = []
            t = threading.Thread(target=lambda: result.append(a.send_with(b.endpoint, b"no", write_all)))
            t.start()
            t.join()
            assert result == [False] and calls[-1] == -1
        # A write that took 3 bytes: the rest is pending, and flush() finishes the same frame.
        assert a.send_with(b.endpoint, b"partial", lambda fd, data: os.write(fd, data[:3]))
        assert not a.try_send(b.endpoint, b"x")  # behind the pending tail, never interleaved
        assert not a.send_with(b.endpoint, b"x", write_all) and calls[-1] == -1
        got: list[bytes] = []
        end = time.monotonic() + 10
        while len(got) < 3 and time.monotonic() < end:
            a.flush()
            got += b.wait(0.01)[0]
        assert got == [b"first", b"native", b"partial"]
        assert not a.send_with(b.endpoint, b"lost", lambda fd, data: -32)  # the write failed: caller sends
    finally:
        a.close()
        b.close()
