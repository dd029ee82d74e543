"""The IPC transport's own ceiling: one native row-copy kernel writing a second process's
buffer through a CUDA IPC mapping, with the slot indices already on the device.

This is what IpcBackend's copy costs on the GPU once the host work of a submission
(checks, index upload, records) is set aside; the ``ipc`` case measures the backend end to
end. The child (``multiprocessing`` spawn: CUDA refuses to map a handle in the process that
exported it) allocates and exports a buffer, then waits; it is kept for the whole run and
regrown when a point needs more bytes. Timed with CUDA events around the kernel; the rows
that landed are read back through the mapping and compared with the source.
"""

from __future__ import annotations

import multiprocessing as mp
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from kvxfer.bench.cases import CaseSpec, Measurement, Requirement, Role, Skip
from kvxfer.bench.children import start_child
from kvxfer.bench.config import BenchConfig, LatencySweep, OverheadSweep, Point
from kvxfer.bench.layout import choose_slots, pool_slots
from kvxfer.bench.timing import check_fresh_bytes, cuda_timed, time_runs
from kvxfer.contract import MemoryKind

_ANSWER_S = 120.0


def serve_buffer(conn: Connection, nbytes: int, device: int = 0) -> None:
    """Child: allocate ``nbytes`` on ``device``, send its IPC export, free it when told."""
    from kvxfer import native

    n = native.cuda_module()
    ptr = n.device_alloc(device, nbytes)
    try:
        conn.send(n.ipc_export(device, ptr))
        conn.recv()
    except (EOFError, OSError):
        pass  # the parent went away: free and exit
    finally:
        n.device_free(device, ptr)


class _PeerBuffer:
    """A device buffer of a child process on ``peer_device``, mapped here for ``device``'s kernels."""

    def __init__(self, nbytes: int, device: int = 0, peer_device: int = 0) -> None:
        from kvxfer import native

        self._n = native.cuda_module()
        self.device = device
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=serve_buffer, args=(child, nbytes, peer_device), name="kvxfer-bench-ipc",
                                 daemon=True)
        self.nbytes = nbytes
        self.base = 0
        try:
            try:
                start_child(self._proc.start)  # spared the terminal's Ctrl-C
            finally:
                child.close()
            if not self._conn.poll(_ANSWER_S):
                raise RuntimeError("the buffer process did not answer")
            handle, _base, size = self._conn.recv()
            if size < nbytes:
                raise RuntimeError(f"the buffer process exported {size} bytes, {nbytes} were asked")
            self.base = self._n.ipc_open(device, handle)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        if self.base:
            self._n.stream_synchronize(0, self.device)
            self._n.ipc_close(self.device, self.base)
            self.base = 0
        try:
            self._conn.send("stop")
        except (OSError, ValueError):
            pass
        if self._proc.pid is not None:  # started (a Ctrl-C may have come first)
            self._proc.join(30.0)
            if self._proc.is_alive():
                self._proc.kill()
                self._proc.join(10.0)
        self._conn.close()


class IpcKernel:
    def __init__(self, config: BenchConfig) -> None:
        self.config = config
        self._peer: _PeerBuffer | None = None

    def _buffer(self, nbytes: int) -> _PeerBuffer:
        if self._peer is None or self._peer.nbytes < nbytes:
            if self._peer is not None:
                self._peer.close()
                self._peer = None
            self._peer = _PeerBuffer(nbytes, *self.config.devices)
        return self._peer

    def throughput(self, point: Point) -> Measurement:
        if point.memory != "device":
            raise Skip("an IPC mapping is device memory")
        import torch

        from kvxfer import native

        rng = np.random.default_rng(self.config.seed + 7)
        slots = pool_slots(point, self.config.pool_factor)
        span = slots * point.row_bytes
        peer = self._buffer(span * point.groups)
        p, dev = self.config.devices
        src = torch.randint(0, 256, (span * point.groups,), dtype=torch.uint8, device=f"cuda:{p}")
        picks = [(choose_slots(point, self.config.pool_factor, rng), choose_slots(point, self.config.pool_factor, rng))
                 for _ in range(point.groups)]
        on_device = [(torch.from_numpy(s).to(f"cuda:{p}"), torch.from_numpy(d).to(f"cuda:{p}")) for s, d in picks]
        stream = torch.cuda.current_stream(p).cuda_stream

        def copy() -> None:
            for g, (s, d) in enumerate(on_device):
                native.copy_rows(src_base=int(src.data_ptr()) + g * span, src_stride=point.row_bytes,
                                 src_slots=native.DeviceIndex(int(s.data_ptr())), dst_base=peer.base + g * span,
                                 dst_stride=point.row_bytes, dst_slots=native.DeviceIndex(int(d.data_ptr())),
                                 row_bytes=point.row_bytes, n_rows=int(s.numel()), memory=MemoryKind.DEVICE,
                                 stream=stream, device=p)

        timing = time_runs(cuda_timed(copy, p), self.config.repetition)

        def fresh(seed: int) -> Callable[[], bool]:
            src.random_(0, 256, generator=torch.Generator(device=src.device).manual_seed(seed))
            return lambda: self._verify(torch, src, span, point, picks, peer)

        def copied() -> None:
            copy()
            torch.cuda.synchronize(p)

        check_fresh_bytes(fresh, copied, "rows read back through the mapping")
        verified = True
        where = f" on cuda:{p}, the mapping on cuda:{dev} (peer access)" if p != dev else ""
        return Measurement(
            {"seconds_best": timing.best, "seconds_median": timing.median, "reps": len(timing.samples)},
            {"processes": 2, "how": "kvxfer._native kernel into a CUDA IPC mapping, device-resident indices, "
             f"CUDA events{where}", "calls": point.groups, "verified": verified, "devices": [p, dev]},
        )

    @staticmethod
    def _verify(torch: Any, src: Any, span: int, point: Point, picks: list[tuple[np.ndarray, np.ndarray]],
                peer: _PeerBuffer) -> bool:
        from kvxfer import native

        row = point.row_bytes
        for g, (s, d) in enumerate(picks):
            got = torch.empty(s.size * row, dtype=torch.uint8, device=src.device)
            native.copy_rows(src_base=peer.base + g * span, src_stride=row, src_slots=d, dst_base=int(got.data_ptr()),
                             dst_stride=row, dst_slots=None, row_bytes=row, memory=MemoryKind.DEVICE,
                             device=peer.device)
            torch.cuda.synchronize(src.device)
            want = src[g * span:(g + 1) * span].view(-1, row)[torch.from_numpy(s).to(src.device)]
            if not torch.equal(got.view(-1, row), want):
                raise RuntimeError(f"group {g}: rows read back through the mapping differ from the source")
        return True

    def latency(self, point: Point, sweep: LatencySweep) -> Measurement:
        raise Skip("the kernel alone has no publish-to-outcome path (see the ipc case)")

    def overhead(self, point: Point, sweep: OverheadSweep) -> Measurement:
        raise Skip("the kernel alone has no submission")

    def close(self) -> None:
        if self._peer is not None:
            self._peer.close()
            self._peer = None


SPECS = [
    CaseSpec("ipc_kernel", "native row kernel through a CUDA IPC mapping of a second process (device indices)",
             Role.CEILING, frozenset({Requirement.CUDA, Requirement.KVXFER_IPC}),
             ("memory", "slots", "row_bytes", "rows", "groups"), frozenset({"throughput"}), IpcKernel),
]
