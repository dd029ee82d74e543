"""The physical reference: one local copy of the request's bytes (memcpy on host, D2D on GPU,
the peer copy between the two GPUs when the prefill and decode ends are on different devices).

Every transfer figure is divided by this one, measured in the same run on the same
machine, so a ratio says how close the transport gets to what the memory system can do.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from kvxfer.bench.cases import CaseSpec, Measurement, Role, Skip
from kvxfer.bench.config import BenchConfig, LatencySweep, OverheadSweep, Point
from kvxfer.bench.layout import choose_slots, pool_slots
from kvxfer.bench.timing import Timing, check_fresh_bytes, cuda_timed, time_runs


class LocalCopy:
    def __init__(self, config: BenchConfig) -> None:
        self.config = config
        self._host: tuple[np.ndarray, np.ndarray] | None = None
        self._device: tuple[Any, Any] | None = None

    def _host_buffers(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        if self._host is None or self._host[0].size < n:
            src = np.full(n, 0x5A, dtype=np.uint8)  # written, so every page is resident
            self._host = (src, np.zeros(n, dtype=np.uint8))
        return self._host

    def _device_buffers(self, n: int) -> tuple[Any, Any]:
        """The source on the prefill device, the destination on the decode device."""
        import torch

        if self._device is None or self._device[0].numel() < n:
            self._device = None
            torch.cuda.empty_cache()
            p, d = self.config.devices
            self._device = (torch.full((n,), 0x5A, dtype=torch.uint8, device=f"cuda:{p}"),
                            torch.zeros(n, dtype=torch.uint8, device=f"cuda:{d}"))
        return self._device

    def throughput(self, point: Point) -> Measurement:
        n = point.total_bytes
        if point.memory == "host":
            src, dst = self._host_buffers(n)
            s, d = src[:n], dst[:n]
            # The host's copy rate is the best of one memcpy and kvxfer.native's threaded
            # memcpy in 1 MiB pieces: a single thread does not saturate memory on every host.
            timing = time_runs(lambda: np.copyto(d, s), self.config.repetition)
            how = "numpy copyto (one memcpy)"
            threaded = self._threaded(src, dst, n)
            facts_extra: dict[str, Any] = {"memcpy_gbps": n / timing.best / 1e9}
            if threaded is not None:
                facts_extra["threaded_gbps"] = n / threaded.best / 1e9
                if threaded.best < timing.best:
                    timing, how = threaded, "kvxfer.native threaded memcpy, 1 MiB pieces"
            ok = bool(d[0] == 0x5A and d[-1] == 0x5A)
        else:
            src, dst = self._device_buffers(n)
            s, d = src[:n], dst[:n]
            # Across devices torch copies on the source device's current stream: time it there.
            timing = time_runs(cuda_timed(lambda: d.copy_(s), self.config.prefill_device), self.config.repetition)
            ok = bool(d[0].item() == 0x5A and d[-1].item() == 0x5A)
            p, dev = self.config.devices
            how = (f"torch copy_ cuda:{p} -> cuda:{dev} (peer copy), CUDA events on cuda:{p}"
                   if self.config.two_devices else f"torch copy_ on cuda:{p}, CUDA events")
            facts_extra = {"devices": [p, dev]}
        return Measurement(
            {"seconds_best": timing.best, "seconds_median": timing.median, "reps": len(timing.samples)},
            {"how": how, "verified": ok, "descriptors": 1, **facts_extra},
        )

    def _threaded(self, src: np.ndarray, dst: np.ndarray, n: int) -> Timing | None:
        from kvxfer import native
        from kvxfer.contract import MemoryKind

        piece = 1 << 20
        if n % piece or not native.info().compiled:
            return None
        rows = np.arange(n // piece, dtype=np.int64)
        s_base, d_base = int(src.ctypes.data), int(dst.ctypes.data)

        def copy() -> None:
            native.copy_rows(src_base=s_base, src_stride=piece, src_slots=rows, dst_base=d_base, dst_stride=piece,
                             dst_slots=rows, row_bytes=piece, memory=MemoryKind.HOST)

        return time_runs(copy, self.config.repetition)

    def latency(self, point: Point, sweep: LatencySweep) -> Measurement:
        raise Skip("a local copy has no publish-to-outcome path")

    def overhead(self, point: Point, sweep: OverheadSweep) -> Measurement:
        raise Skip("a local copy has no submission")

    def close(self) -> None:
        self._host = None
        self._device = None


class LocalRows(LocalCopy):
    """The point's rows copied inside one process by kvxfer.native's batched row copy.

    Host: the native multi-threaded memcpy (or numpy without the compiled module); device:
    one CUDA row-copy kernel. This is what a same-node copy of these exact rows costs when
    no transport is in the way, per group one call, as a backend would issue it.
    """

    def throughput(self, point: Point) -> Measurement:
        from kvxfer import native
        from kvxfer.contract import MemoryKind

        rng = np.random.default_rng(self.config.seed + 2)
        slots = pool_slots(point, self.config.pool_factor)
        span = slots * point.row_bytes
        n = span * point.groups
        src_slots = [choose_slots(point, self.config.pool_factor, rng) for _ in range(point.groups)]
        dst_slots = [choose_slots(point, self.config.pool_factor, rng) for _ in range(point.groups)]
        device = point.memory == "device"
        p, d = self.config.devices
        if device:
            src, dst = self._device_buffers(n)
            src_base, dst_base = int(src.data_ptr()), int(dst.data_ptr())
            if self.config.two_devices and not native.cuda_module().peer_access(p, d):
                raise Skip(f"cuda:{p} cannot reach cuda:{d}'s memory (no peer access)")
        else:
            src, dst = self._host_buffers(n)
            src_base, dst_base = int(src.ctypes.data), int(dst.ctypes.data)
        kind = MemoryKind.DEVICE if device else MemoryKind.HOST

        def copy() -> None:
            for g in range(point.groups):
                native.copy_rows(src_base=src_base + g * span, src_stride=point.row_bytes, src_slots=src_slots[g],
                                 dst_base=dst_base + g * span, dst_stride=point.row_bytes, dst_slots=dst_slots[g],
                                 row_bytes=point.row_bytes, memory=kind, src_limit=slots, dst_limit=slots,
                                 device=p if device else -1)

        if device:
            timing = time_runs(cuda_timed(copy, p), self.config.repetition)
        else:
            timing = time_runs(copy, self.config.repetition)
        self._check_rows(point, src, dst, span, src_slots, dst_slots, copy)  # raises on a mismatch
        info = native.info()
        how = ("kvxfer._native " + ("CUDA kernel" if device else "host memcpy")) if info.compiled else "numpy/torch fallback"
        if device and self.config.two_devices:
            how += f" on cuda:{p} writing cuda:{d} (peer access)"
        return Measurement(
            {"seconds_best": timing.best, "seconds_median": timing.median, "reps": len(timing.samples)},
            {"how": how, "calls": point.groups, "verified": True, **({"devices": [p, d]} if device else {})},
        )

    @staticmethod
    def _check_rows(point: Point, src: Any, dst: Any, span: int, src_slots: list[np.ndarray],
                    dst_slots: list[np.ndarray], copy: Callable[[], None]) -> None:
        """Every destination row against its source row, after fresh bytes moved once more."""
        row, n = point.row_bytes, span * point.groups

        def fresh(seed: int) -> Callable[[], bool]:
            if isinstance(src, np.ndarray):
                src[:n] = np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)
                return lambda: all(np.array_equal(src[g * span:(g + 1) * span].reshape(-1, row)[src_slots[g]],
                                                  dst[g * span:(g + 1) * span].reshape(-1, row)[dst_slots[g]])
                                   for g in range(point.groups))
            import torch

            src[:n].random_(0, 256, generator=torch.Generator(device=src.device).manual_seed(seed))

            def same() -> bool:
                torch.cuda.synchronize(src.device)
                torch.cuda.synchronize(dst.device)
                return all(torch.equal(
                    src[g * span:(g + 1) * span].view(-1, row)[torch.from_numpy(src_slots[g]).to(src.device)].cpu(),
                    dst[g * span:(g + 1) * span].view(-1, row)[torch.from_numpy(dst_slots[g]).to(dst.device)].cpu())
                    for g in range(point.groups))
            return same

        check_fresh_bytes(fresh, copy, "local rows")

SPECS = [
    CaseSpec(
        name="local_copy", title="local copy (memcpy / D2D)", role=Role.REFERENCE, needs=frozenset(),
        depends=("memory",), modes=frozenset({"throughput"}), factory=LocalCopy,
    ),
    CaseSpec(
        name="local_rows", title="local row copy of the same rows (kvxfer.native)", role=Role.BASELINE,
        needs=frozenset(), depends=("memory", "slots", "row_bytes", "rows", "groups"),
        modes=frozenset({"throughput"}), factory=LocalRows,
    ),
]
