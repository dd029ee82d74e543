"""Repeated timing: warm up, time many runs, keep every sample; best and median from them."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from kvxfer.bench.config import Repetition


@dataclass(frozen=True)
class Timing:
    """Seconds per run, each sample kept so that best, median and percentiles stay honest."""

    samples: tuple[float, ...]

    def __post_init__(self) -> None:
        if not self.samples:
            raise ValueError("a Timing needs at least one sample")

    @property
    def best(self) -> float:
        return min(self.samples)

    @property
    def median(self) -> float:
        return float(np.median(self.samples))

    def percentile(self, q: float) -> float:
        return float(np.percentile(np.asarray(self.samples), q))


def cuda_timed(fn: Callable[[], object], device: int | None = None) -> Callable[[], float]:
    """``fn`` as a run for ``time_runs`` that returns its device time: CUDA events recorded on
    the current stream of ``device`` (default: the current device) around it, with that
    device current while ``fn`` runs (torch must be importable and see a GPU)."""
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    where = torch.cuda.current_device() if device is None else device

    def run() -> float:
        with torch.cuda.device(where):
            start.record()
            fn()
            end.record()
        end.synchronize()
        return float(start.elapsed_time(end)) / 1e3

    return run


def time_runs(run: Callable[[], float | None], rep: Repetition, *, setup: Callable[[], None] | None = None) -> Timing:
    """Call ``run`` ``rep.warmup`` times untimed, then up to ``rep.reps`` times timed.

    ``run`` may return its own measured seconds (when only part of the call is the figure,
    e.g. device time by events); otherwise the whole call is timed with perf_counter.
    Stops early once ``rep.budget_s`` is spent, but never with fewer than 3 samples.
    ``setup`` runs before every call, untimed (e.g. describe both ends afresh).
    """
    for _ in range(rep.warmup):
        if setup is not None:
            setup()
        run()
    samples: list[float] = []
    spent = 0.0
    while len(samples) < rep.reps and (len(samples) < 3 or spent < rep.budget_s):
        if setup is not None:
            setup()
        t0 = time.perf_counter()
        own = run()
        elapsed = time.perf_counter() - t0
        samples.append(float(own) if own is not None else elapsed)
        spent += elapsed
    return Timing(tuple(samples))


_FRESH_SEEDS = itertools.count(1 << 20)  # no two checks of a process stamp the same bytes


def check_fresh_bytes(stamp: Callable[[int], Callable[[], bool]], move: Callable[[], object], what: str) -> None:
    """After a case's timed runs: stamp source bytes no earlier check stamped (``stamp(seed)``
    returns the check of the destination), ``move`` them once more, untimed, and check. Equal
    bytes after the timed runs alone would prove only the warm-up: every timed run moved the
    same, unchanged source, so a transport that stopped moving bytes would pass."""
    check = stamp(next(_FRESH_SEEDS))
    move()
    if not check():
        raise RuntimeError(f"{what}: destination bytes differ from the source after the timed runs")
