"""A KV store through the blob backend: put and get GB/s, each on its own.

One end (prefill) publishes the point's rows into the store, under their names; the other
(decode) fetches them into rows of its own, scattered as a pool's would be. ``store_*_put``
times publish to its outcome; ``store_*_get`` times fetch to its outcome, after one put, and
checks every row byte for byte. Both ends are BlobBackends in this process; the store is the
case's own:

- ``memory``: the in-process MemoryStore (a copy into a Python bytes object per blob: the
  backend's own cost, with no store behind it to speak of);
- ``shm``: a /dev/shm directory (one file per blob), what ``--store memory`` runs across
  processes;
- ``mooncake``: a Mooncake Store over TCP on this host: a master started for the case, the
  putting client holding the data in its own segment.
"""

from __future__ import annotations

import shutil
import tempfile
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from kvxfer.bench.cases import CaseSpec, Measurement, Role, Skip
from kvxfer.bench.config import BenchConfig, LatencySweep, OverheadSweep, Point
from kvxfer.bench.layout import choose_slots, pool_slots
from kvxfer.bench.timing import Timing, time_runs
from kvxfer.contract import Attempt, CacheKind, Delivered, LayerGroupRows, MemoryKind, SlotRegion, TokenRange, View

_WAIT_S = 120.0
_LAYOUT = b"kvxfer-bench-store-v1"


class _Store:
    """Two drivers on one store, made for a point, and what must go when it is done."""

    def __init__(self, kind: str, capacity: int) -> None:
        from kvxfer.backends.blob import MemoryDriver, MemoryStore, ShmDriver

        self.kind = kind
        self._cleanup: list[Callable[[], None]] = []
        if kind == "memory":
            store = MemoryStore(capacity)
            self.drivers: tuple[Any, Any] = (MemoryDriver(store), MemoryDriver(store))
        elif kind == "shm":
            root = tempfile.mkdtemp(prefix="kvxfer-bench-store-", dir="/dev/shm")
            self._cleanup.append(lambda: shutil.rmtree(root, ignore_errors=True))
            self.drivers = (ShmDriver(root, capacity), ShmDriver(root, capacity))
        else:
            self.drivers = self._mooncake(capacity)

    def _mooncake(self, capacity: int) -> tuple[Any, Any]:
        try:
            from kvxfer.backends.blob.mooncake import MooncakeDriver
            from kvxfer.backends.blob.mooncake_master import MooncakeMaster
        except ImportError as exc:
            raise Skip(f"the Mooncake store is not installed: {exc}") from None
        master = MooncakeMaster()
        self._cleanup.append(lambda: _stop(master))
        holder = MooncakeDriver(master.address, segment_bytes=capacity)
        reader = MooncakeDriver(master.address, segment_bytes=0)
        return holder, reader

    def close(self) -> None:
        for step in reversed(self._cleanup):
            step()


def _stop(master: Any) -> None:
    master.stop()


class StoreCase:
    def __init__(self, config: BenchConfig, kind: str, op: str) -> None:
        self.config = config
        self.kind = kind
        self.op = op

    def throughput(self, point: Point) -> Measurement:
        from kvxfer.backends.blob import BlobBackend

        if point.memory != "host":
            raise Skip("the blob backend reaches host memory only")
        if point.direction != "push":
            raise Skip("a store has no pull: put and get are measured apart")
        rng = np.random.default_rng(self.config.seed + 11)
        slots = pool_slots(point, self.config.pool_factor)
        buffers = [np.zeros(slots * point.row_bytes, dtype=np.uint8) for _ in range(2)]
        buffers[0][:] = rng.integers(0, 256, buffers[0].size, dtype=np.uint8)
        views = [self._view(buffers[i], point, choose_slots(point, self.config.pool_factor, rng), end)
                 for i, end in enumerate(("prefill", "decode"))]
        store = _Store(self.kind, 2 * point.total_bytes + (64 << 20))
        ends = [BlobBackend(d, name=f"bench-{end}", timeout_s=_WAIT_S)
                for d, end in zip(store.drivers, ("prefill", "decode"))]
        try:
            for end, view in zip(ends, views):
                end.register([g.region for g in view.groups])
            def put() -> None:
                _settle(lambda wake: ends[0].publish(views[0], ends[0].describe(views[0]), wake))

            def get() -> None:
                _settle(lambda wake: ends[1].fetch(views[1], ends[1].describe(views[1]), wake))
            if self.op == "put":
                timing = time_runs(put, self.config.repetition)
                verified = True
            else:
                put()
                timing = time_runs(get, self.config.repetition)
                verified = _same_rows(buffers, views, point.row_bytes)
        finally:
            for end in ends:
                end.shutdown()
            store.close()
        return _measurement(timing, point, self.kind, self.op, verified)

    @staticmethod
    def _view(buffer: np.ndarray, point: Point, slots: np.ndarray, end: str) -> View:
        region = SlotRegion(f"{end}-rows", int(buffer.ctypes.data), point.row_bytes,
                            buffer.size // point.row_bytes, MemoryKind.HOST)
        rows = LayerGroupRows("g0", CacheKind.PAGED, region, slots, np.arange(point.rows, dtype=np.int64))
        return View("bench", TokenRange(0, 16 * point.rows), (rows,), _LAYOUT)

    def latency(self, point: Point, sweep: LatencySweep) -> Measurement:
        raise Skip("store cases measure throughput")

    def overhead(self, point: Point, sweep: OverheadSweep) -> Measurement:
        raise Skip("store cases measure throughput")

    def close(self) -> None:
        return None


def _settle(submit: Callable[[Callable[[], None]], Attempt]) -> None:
    """Submit with a wake that sets an event, and wait on it until the attempt ends."""
    woken = threading.Event()
    attempt = submit(woken.set)
    while not (attempt.poll() is not None and attempt.quiesced()):
        if not woken.wait(_WAIT_S):
            raise RuntimeError(f"store transfer did not end within {_WAIT_S:g}s")
        woken.clear()
    outcome = attempt.poll()
    if not isinstance(outcome, Delivered) or not outcome.all_delivered:
        raise RuntimeError(f"store transfer did not deliver every row: {outcome!r}")


def _same_rows(buffers: list[np.ndarray], views: list[View], row_bytes: int) -> bool:
    src, dst = (b.reshape(-1, row_bytes) for b in buffers)
    return bool(np.array_equal(src[views[0].groups[0].slots], dst[views[1].groups[0].slots]))


def _measurement(timing: Timing, point: Point, kind: str, op: str, verified: bool) -> Measurement:
    return Measurement({"seconds_best": timing.best, "seconds_median": timing.median, "reps": len(timing.samples)},
                       {"how": f"BlobBackend {'publish' if op == 'put' else 'fetch'} over the {kind} store, "
                               f"{point.rows} keys in batches of 256, to the outcome", "verified": verified,
                        "store": kind, "descriptors": point.rows})


def _spec(kind: str, op: str, title: str) -> CaseSpec:
    return CaseSpec(f"store_{kind}_{op}", title, Role.BACKEND, frozenset(),
                    ("memory", "direction", "slots", "row_bytes", "rows", "groups"), frozenset({"throughput"}),
                    lambda config: StoreCase(config, kind, op))


SPECS = tuple(_spec(kind, op, f"{what}: {op}")
              for kind, what in (("memory", "blob backend, in-process store"),
                                 ("shm", "blob backend, /dev/shm directory store (--store memory)"),
                                 ("mooncake", "blob backend, Mooncake Store over TCP"))
              for op in ("put", "get"))
