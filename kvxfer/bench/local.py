"""The physical reference: one local copy of the request's bytes (memcpy on host, D2D on GPU).

Every transfer figure is divided by this one, measured in the same run on the same
machine, so a ratio says how close the transport gets to what the memory system can do.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvxfer.bench.cases import CaseSpec, Measurement, Role, Skip
from kvxfer.bench.config import BenchConfig, LatencySweep, OverheadSweep, Point
from kvxfer.bench.timing import time_runs


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
        import torch

        if self._device is None or self._device[0].numel() < n:
            self._device = None
            torch.cuda.empty_cache()
            self._device = (torch.full((n,), 0x5A, dtype=torch.uint8, device="cuda"),
                            torch.zeros(n, dtype=torch.uint8, device="cuda"))
        return self._device

    def throughput(self, point: Point) -> Measurement:
        n = point.total_bytes
        if point.memory == "host":
            src, dst = self._host_buffers(n)
            s, d = src[:n], dst[:n]
            timing = time_runs(lambda: np.copyto(d, s), self.config.repetition)
            ok = bool(d[0] == 0x5A and d[-1] == 0x5A)
            how = "numpy copyto (memcpy)"
        else:
            import torch

            src, dst = self._device_buffers(n)
            s, d = src[:n], dst[:n]
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

            def run() -> float:
                start.record()
                d.copy_(s)
                end.record()
                end.synchronize()
                return start.elapsed_time(end) / 1e3

            timing = time_runs(run, self.config.repetition)
            ok = bool(d[0].item() == 0x5A and d[-1].item() == 0x5A)
            how = "torch copy_ on one device, CUDA events"
        return Measurement(
            {"seconds_best": timing.best, "seconds_median": timing.median, "reps": len(timing.samples)},
            {"how": how, "verified": ok, "descriptors": 1},
        )

    def latency(self, point: Point, sweep: LatencySweep) -> Measurement:
        raise Skip("a local copy has no publish-to-outcome path")

    def overhead(self, point: Point, sweep: OverheadSweep) -> Measurement:
        raise Skip("a local copy has no submission")

    def close(self) -> None:
        self._host = None
        self._device = None


SPECS = [
    CaseSpec(
        name="local_copy", title="local copy (memcpy / D2D)", role=Role.REFERENCE, needs=frozenset(),
        depends=("memory",), modes=frozenset({"throughput"}), factory=LocalCopy,
    ),
]
