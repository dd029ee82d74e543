"""The CUDA row-copy kernel against the torch fallback and a host oracle, on the GPU machine.

Run: ``python -m pytest -q -m gpu tests/gpu/test_native_gpu.py``.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from kvxfer import native  # noqa: E402
from kvxfer.contract import MemoryKind  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(not native.info().cuda_usable, reason=f"kvxfer._native CUDA: {native.info().reason}"),
]


def dev_space(slots: int, stride: int, offset: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (slots * stride + offset + 64,), dtype=torch.uint8, generator=g).cuda()


def oracle(src: np.ndarray, dst: np.ndarray, s_off: int, s_stride: int, s_ix, d_off: int, d_stride: int, d_ix,
           row_bytes: int) -> bytes:
    out = dst.copy()
    for s, d in zip(s_ix.tolist(), d_ix.tolist()):
        out[d_off + d * d_stride:d_off + d * d_stride + row_bytes] = src[s_off + s * s_stride:s_off + s * s_stride + row_bytes]
    return out.tobytes()


@pytest.mark.parametrize("n", [1, 32, 64, 65, 1000])  # inline indices up to 64 rows, uploaded beyond
@pytest.mark.parametrize("row_bytes,offsets", [
    (16, (0, 0)), (4096, (0, 0)), (65536, (0, 0)), (16 * 1024 + 8, (8, 0)), (100, (4, 4)), (4097, (1, 3)),
    (3, (0, 0)), (20000, (0, 0)),
])
def test_kernel_matches_fallback_and_oracle(n: int, row_bytes: int, offsets: tuple[int, int]) -> None:
    slots = max(n + 7, 16)
    s_stride, d_stride = row_bytes + offsets[0], row_bytes + 16 + offsets[1]
    src, dst0 = dev_space(slots, s_stride, offsets[0], 1), dev_space(slots, d_stride, offsets[1], 2)
    rng = np.random.default_rng(n * 7 + row_bytes)
    s_ix = rng.integers(0, slots, size=n).astype(np.int64)
    d_ix = rng.permutation(slots)[:n].astype(np.int64)
    results = []
    for impl in ("native", "fallback"):
        dst = dst0.clone()
        stream = torch.cuda.Stream()
        native.copy_rows(src_base=src.data_ptr() + offsets[0], src_stride=s_stride, src_slots=s_ix,
                         dst_base=dst.data_ptr() + offsets[1], dst_stride=d_stride, dst_slots=d_ix,
                         row_bytes=row_bytes, memory=MemoryKind.DEVICE, stream=stream.cuda_stream, impl=impl,
                         src_limit=slots, dst_limit=slots)
        stream.synchronize()
        results.append(dst.cpu().numpy().tobytes())
    want = oracle(src.cpu().numpy(), dst0.cpu().numpy(), offsets[0], s_stride, s_ix, offsets[1], d_stride, d_ix,
                  row_bytes)
    assert results[0] == want
    assert results[1] == want


def test_gather_scatter_and_device_indices() -> None:
    rb, slots, n = 64 * 1024, 300, 200
    pool = dev_space(slots, rb, 0, 3)
    rng = np.random.default_rng(4)
    ix = rng.permutation(slots)[:n].astype(np.int64)
    buf = torch.zeros(n * rb, dtype=torch.uint8, device="cuda")
    native.gather_rows(src_base=pool.data_ptr(), src_stride=rb, src_slots=ix, dst_base=buf.data_ptr(), row_bytes=rb,
                       memory=MemoryKind.DEVICE)
    torch.cuda.synchronize()
    rows = pool[: slots * rb].view(slots, rb)
    assert torch.equal(buf.view(n, rb), rows[torch.from_numpy(ix).cuda()])
    back = torch.zeros_like(pool)
    dix = torch.from_numpy(ix).cuda()
    native.copy_rows(src_base=buf.data_ptr(), src_stride=rb, src_slots=None,
                     dst_base=back.data_ptr(), dst_stride=rb, dst_slots=None, row_bytes=rb, n_rows=n,
                     memory=MemoryKind.DEVICE)  # contiguous to contiguous
    torch.cuda.synchronize()
    assert torch.equal(back[: n * rb], buf)
    back.zero_()
    ident = torch.arange(n, dtype=torch.int64, device="cuda")
    native.copy_rows(src_base=buf.data_ptr(), src_stride=rb, src_slots=native.DeviceIndex(ident.data_ptr()),
                     dst_base=back.data_ptr(), dst_stride=rb, dst_slots=native.DeviceIndex(dix.data_ptr()),
                     row_bytes=rb, n_rows=n, memory=MemoryKind.DEVICE)
    torch.cuda.synchronize()
    assert torch.equal(back[: slots * rb].view(slots, rb)[dix], buf.view(n, rb))


def test_cuda_errors_carry_cuda_text() -> None:
    from kvxfer import _native

    with pytest.raises(_native.CopyError, match="cudaIpcOpenMemHandle"):
        _native.ipc_open(0, b"\x01" * 64)
    host = np.zeros(64, dtype=np.uint8)
    with pytest.raises(_native.CopyError):
        _native.ipc_export(0, host.ctypes.data)
    with pytest.raises(_native.CopyError, match="64 bytes"):
        _native.ipc_open(0, b"short")
    # The context is still usable after these refusals.
    t = torch.ones(16, device="cuda")
    assert float(t.sum()) == 16.0


def test_ipc_export_names_the_allocation() -> None:
    from kvxfer import _native

    t = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
    handle, base, size = _native.ipc_export(0, t.data_ptr() + 4096)
    assert len(handle) == 64 and base <= t.data_ptr() and t.data_ptr() + t.numel() <= base + size


def test_stream_signal_fd_writes_after_the_work() -> None:
    import os
    import select

    from kvxfer import _native

    r, w = os.pipe()
    try:
        stream = torch.cuda.Stream()
        _native.stream_signal_fd(stream.cuda_stream, w)
        ready, _, _ = select.select([r], [], [], 5.0)
        assert ready and os.read(r, 1) == b"\x01"
    finally:
        os.close(r)
        os.close(w)


def test_event_spin_send_writes_only_after_the_work() -> None:
    import socket
    import time

    from kvxfer import _native

    a, b = socket.socketpair()
    a.setblocking(False)
    b.setblocking(False)
    stream = torch.cuda.Stream()
    event = _native.event_create(0)
    try:
        with torch.cuda.stream(stream):
            torch.cuda._sleep(200_000_000)  # still running when the spin gives up
        _native.event_record(event, stream.cuda_stream)
        start = time.perf_counter()
        assert _native.event_spin_send(event, 50, a.fileno(), b"frame") == (False, 0)
        assert time.perf_counter() - start < 0.05  # gave up after its bound, not at the work's end
        with pytest.raises(BlockingIOError):
            b.recv(16)  # nothing was written
        assert _native.event_spin_send(event, 10_000_000, a.fileno(), b"frame") == (True, 5)  # once it ended
        assert b.recv(16) == b"frame"
        assert _native.event_spin_send(event, 0, -1, b"frame") == (True, 0)
        b.close()
        done, sent = _native.event_spin_send(event, 0, a.fileno(), b"frame")
        assert done and sent < 0  # the peer closed: -errno, no exception, no SIGPIPE
    finally:
        stream.synchronize()
        _native.event_destroy(event)
        a.close()


# Past 8,192 rows the indices upload in chunks: a first one of 8,192 rows, then up to 7 more.
@pytest.mark.parametrize("n", [8193, 16385, 20000, 70001, 262147])
@pytest.mark.parametrize("ends", ["both", "gather", "scatter"])
@pytest.mark.parametrize("row_bytes", [16, 100])
def test_chunked_index_upload_matches_fallback(n: int, ends: str, row_bytes: int) -> None:
    slots = n + 1000
    src = dev_space(slots, row_bytes, 0, 5)
    results = []
    for impl in ("native", "fallback"):
        out = []
        stream = torch.cuda.Stream()
        # Two copies queued back to back before any synchronization: the second takes
        # another staging slot while the first's chunks may still be in flight.
        for rep in range(2):
            r = np.random.default_rng(rep)
            s_ix = None if ends == "scatter" else r.permutation(slots)[:n].astype(np.int64)
            d_ix = None if ends == "gather" else r.permutation(slots)[:n].astype(np.int64)
            dst = torch.zeros(slots * row_bytes + 64, dtype=torch.uint8, device="cuda")
            native.copy_rows(src_base=src.data_ptr(), src_stride=row_bytes, src_slots=s_ix,
                             dst_base=dst.data_ptr(), dst_stride=row_bytes, dst_slots=d_ix, row_bytes=row_bytes,
                             n_rows=n, memory=MemoryKind.DEVICE, stream=stream.cuda_stream, impl=impl)
            out.append(dst)
        stream.synchronize()
        results.append([d.cpu().numpy().tobytes() for d in out])
    assert results[0] == results[1]


def _large_copy(n: int, seed: int, src: torch.Tensor, stream: torch.cuda.Stream, impl: str = "native",
                sync: bool = True) -> torch.Tensor:
    r = np.random.default_rng(seed)
    slots = src.numel() // 16
    s_ix = r.permutation(slots)[:n].astype(np.int64)
    d_ix = r.permutation(slots)[:n].astype(np.int64)
    dst = torch.zeros_like(src)
    native.copy_rows(src_base=src.data_ptr(), src_stride=16, src_slots=s_ix, dst_base=dst.data_ptr(), dst_stride=16,
                     dst_slots=d_ix, row_bytes=16, n_rows=n, memory=MemoryKind.DEVICE, stream=stream.cuda_stream,
                     impl=impl)
    if sync:
        stream.synchronize()
    return dst


def test_fill_helpers_persist_stop_and_restart() -> None:
    from kvxfer import _native  # type: ignore[attr-defined]

    src = dev_space(100_000, 16, 0, 9)[: 100_000 * 16]
    stream = torch.cuda.Stream()
    want = _large_copy(90_000, 1, src, stream, "fallback")
    assert bytes(_large_copy(90_000, 1, src, stream).cpu().numpy()) == bytes(want.cpu().numpy())
    assert _native.fill_helper_threads() == 3  # started by the first chunked copy, kept
    _native.stop_fill_helpers()
    assert _native.fill_helper_threads() == 0
    assert bytes(_large_copy(90_000, 1, src, stream).cpu().numpy()) == bytes(want.cpu().numpy())
    assert _native.fill_helper_threads() == 3


def test_concurrent_large_copies_share_no_helpers() -> None:
    """Callers on several threads at once: one is lent the helpers, the others fill alone."""
    import threading

    src = dev_space(100_000, 16, 0, 11)[: 100_000 * 16]
    want = {seed: bytes(_large_copy(70_000, seed, src, torch.cuda.Stream(), "fallback").cpu().numpy())
            for seed in range(4)}
    got: dict[int, bytes] = {}
    errors: list[BaseException] = []

    def caller(seed: int) -> None:
        try:
            stream = torch.cuda.Stream()
            outs = [_large_copy(70_000, seed, src, stream, sync=False) for _ in range(5)]
            stream.synchronize()
            got[seed] = bytes(outs[-1].cpu().numpy())
            assert all(bytes(o.cpu().numpy()) == got[seed] for o in outs)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=caller, args=(seed,)) for seed in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert got == want


@pytest.mark.parametrize("n", [1, 8, 64, 65, 3000])  # the copy kernel rings up to 64 rows; a store after it beyond
def test_copy_rows_then_rings_the_doorbell_after_every_row_and_again_next_time(n: int) -> None:
    # The doorbell word must hold the value only once every row is in place, and a second
    # copy on the same stream must ring again (the kernel's block counter is reset).
    cuda = native.cuda_module()
    row_bytes, slots = 4096, 4000
    src = dev_space(slots, row_bytes, 0, seed=n)
    word = np.zeros(1, dtype=np.uint64)
    word_dev = cuda.host_register(0, word.ctypes.data, 8)
    stream = cuda.stream_create(0)
    event = cuda.event_create(0)
    rng = np.random.default_rng(n)
    try:
        for round_ in range(2):
            dst = torch.zeros(slots * row_bytes, dtype=torch.uint8, device="cuda")
            torch.cuda.synchronize()  # torch's stream is not ordered with ours
            s_ix = rng.permutation(slots)[:n].astype(np.int64)
            d_ix = rng.permutation(slots)[:n].astype(np.int64)
            word[0] = 0
            bell_err, event_err = cuda.cuda_copy_rows_then(
                src.data_ptr(), row_bytes, s_ix, dst.data_ptr(), row_bytes, d_ix, n, row_bytes, stream, 0,
                word_dev, 1000 + round_, event)
            assert bell_err == "" and event_err == ""
            view = word.view(np.uint64)
            deadline = 5_000_000
            while view[0] == 0 and deadline:  # the CPU sees the store without any CUDA call
                deadline -= 1
            assert int(view[0]) == 1000 + round_, f"round {round_}: doorbell word {int(view[0])}"
            # Read before waiting on anything of that stream (torch copies on its own stream, which
            # our non-blocking one does not order): the rows must be in place once the word is.
            seen = dst.cpu().numpy().tobytes()
            cuda.event_synchronize(event)
            want = oracle(src.cpu().numpy(), np.zeros(slots * row_bytes, np.uint8), 0, row_bytes, s_ix, 0,
                          row_bytes, d_ix, row_bytes)
            assert seen == want, f"round {round_}: rows missing when the doorbell rang"
    finally:
        cuda.stream_synchronize(stream)
        cuda.event_destroy(event)
        cuda.stream_destroy(stream)
        cuda.host_unregister(0, word.ctypes.data)


def test_page_locking_lets_other_python_threads_run() -> None:
    # host_register (and device_free, ipc_open, peer_access) can take a long time in the driver;
    # they run without the interpreter lock, so a backend's progress thread is not frozen meanwhile.
    import threading
    import time

    cuda = native.cuda_module()
    buf = np.ones(4 << 30, dtype=np.uint8)  # touched: page locking then walks 4 GiB of present pages
    ticks = [0]
    inside = threading.Event()
    done = threading.Event()

    def count() -> None:
        inside.wait()
        while not done.is_set():
            ticks[0] += 1

    t = threading.Thread(target=count)
    t.start()
    try:
        inside.set()
        time.sleep(0.01)
        start = ticks[0]
        time.sleep(0.05)  # the counting thread alone: its rate
        rate = (ticks[0] - start) / 0.05
        before = ticks[0]
        t0 = time.perf_counter()
        cuda.host_register(0, buf.ctypes.data, buf.nbytes)
        took = time.perf_counter() - t0
        during = ticks[0] - before
    finally:
        done.set()
        t.join()
    cuda.host_unregister(0, buf.ctypes.data)
    if took < 0.05:
        pytest.skip(f"page locking 4 GiB took {took * 1e3:.1f} ms here, too short to tell")
    # Holding the lock, the counting thread would get at most one switch interval (5 ms) in
    # before the call; released, it counts for most of the call (two threads share the lock
    # only while the main one runs Python, which it does not inside the call).
    assert during > rate * took / 4, f"{during} ticks in {took * 1e3:.0f} ms of cudaHostRegister, {rate:.0f}/s alone"
