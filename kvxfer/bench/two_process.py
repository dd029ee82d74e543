"""The kvxfer NIXL backend with its two ends in two processes: the figure PERF.md targets.

The active end (push: the publisher; pull: the fetcher) is a NixlBackend in this process;
the passive end is a NixlBackend in a child process (``kvxfer.testing.subprocess_peer``),
with its own host rows. The figure runs from the call that moves bytes to the active
end's outcome being visible here through its wake callback: NIXL reports a request DONE
only once its bytes are in place at the destination, so this is the transfer; the child's
own outcome is then collected untimed (it crosses a socket and a 1 ms poll) and must be
Delivered for every row. Rows are compared byte for byte after the timed runs.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from kvxfer.bench.backend_cases import BLOCK_TOKENS, LAYOUT, Watch, wait_settled
from kvxfer.bench.cases import CaseSpec, Measurement, Requirement, Role, Skip
from kvxfer.bench.config import BenchConfig, LatencySweep, OverheadSweep, Point
from kvxfer.bench.layout import choose_slots, pool_slots
from kvxfer.bench.timing import time_runs
from kvxfer.contract import CacheKind, LayerGroupRows, MemoryKind, SlotRegion, TokenRange, TransferMode, View

_RESULT_TIMEOUT_S = 60.0


def passive_child(mode: str, row_bytes: int, slots: int, groups: int) -> tuple[Any, Any, None]:
    """Runs in the child: a NixlBackend over ``groups`` host regions of ``slots`` rows each."""
    from kvxfer.backends.nixl import NixlBackend
    from kvxfer.testing.memory import HostBuffer, HostRows

    memory = HostRows([HostBuffer(f"peer-g{g}", row_bytes, slots) for g in range(groups)])
    backend = NixlBackend(mode=TransferMode(mode))
    backend.register(memory.regions)
    return backend, memory, None


def _view(regions: tuple[SlotRegion, ...] | list[SlotRegion], slots: list[np.ndarray], rows: int) -> View:
    groups = tuple(LayerGroupRows(f"g{i}", CacheKind.PAGED, r, slots[i], np.arange(rows, dtype=np.int64))
                   for i, r in enumerate(regions))
    return View("bench", TokenRange(0, rows * BLOCK_TOKENS), groups, LAYOUT)


class TwoProcessNixl:
    def __init__(self, config: BenchConfig) -> None:
        self.config = config
        self._rng = np.random.default_rng(config.seed + 3)

    def throughput(self, point: Point) -> Measurement:
        from kvxfer.backends.nixl import NixlBackend
        from kvxfer.testing.subprocess_peer import SubprocessPeer

        if point.memory != "host":
            raise Skip("the two-process pair runs over host memory (kvxfer.testing.subprocess_peer)")
        push = point.direction == "push"
        mode = TransferMode.PUSH if push else TransferMode.PULL
        n_slots = pool_slots(point, self.config.pool_factor)
        local_mem = [np.zeros((n_slots, point.row_bytes), dtype=np.uint8) for _ in range(point.groups)]
        local_regions = [SlotRegion(f"local-g{g}", int(a.ctypes.data), point.row_bytes, n_slots, MemoryKind.HOST)
                         for g, a in enumerate(local_mem)]
        local_slots = [choose_slots(point, self.config.pool_factor, self._rng) for _ in range(point.groups)]
        peer_slots = [choose_slots(point, self.config.pool_factor, self._rng) for _ in range(point.groups)]
        peer = SubprocessPeer("kvxfer.bench.two_process:passive_child", {
            "mode": mode.value, "row_bytes": point.row_bytes, "slots": n_slots, "groups": point.groups})
        local = None
        try:
            local = NixlBackend(mode=mode)
            local.register(local_regions)
            v_local = _view(local_regions, local_slots, point.rows)
            v_peer = _view(peer.regions, peer_slots, point.rows)
            rng = np.random.default_rng(self.config.seed + point.rows)
            source = [rng.integers(0, 256, size=(point.rows, point.row_bytes), dtype=np.uint8)
                      for _ in range(point.groups)]
            for g in range(point.groups):
                if push:
                    local_mem[g][local_slots[g]] = source[g]
                else:
                    peer.write(peer.regions[g].name, peer_slots[g], source[g].tobytes())
            op_peer = "fetch" if push else "publish"

            def run() -> float:
                assert local is not None
                h_local = local.describe(v_local)
                h_peer = peer.describe(v_peer)
                handle = peer.start(op_peer, v_peer, h_local)
                watch = Watch()
                t0 = time.perf_counter()
                attempt = local.publish(v_local, h_peer, wake=watch) if push else local.fetch(v_local, h_peer,
                                                                                            wake=watch)
                watch.bind(attempt)
                seen = watch.wait_outcome()
                mine = wait_settled(attempt, "local attempt")
                theirs, quiesced = peer.result(handle, _RESULT_TIMEOUT_S)
                for name, outcome in (("local", mine), ("peer", theirs)):
                    if outcome is None or not outcome.all_delivered:
                        raise RuntimeError(f"{name} outcome {outcome!r} is not Delivered for every row")
                if not quiesced:
                    raise RuntimeError("the peer's attempt did not quiesce")
                return seen - t0

            timing = time_runs(run, self.config.repetition)
            for g in range(point.groups):
                got = (np.frombuffer(peer.read(peer.regions[g].name, peer_slots[g]), dtype=np.uint8)
                       if push else local_mem[g][local_slots[g]])
                if not np.array_equal(got.reshape(source[g].shape), source[g]):
                    raise RuntimeError(f"group {g}: destination rows differ from the source after the timed runs")
        finally:
            left = len(local.shutdown()) if local is not None else 0
            peer.close()
        if left:
            raise RuntimeError(f"{left} attempts were not quiesced at shutdown")
        return Measurement({"seconds_best": timing.best, "seconds_median": timing.median, "reps": len(timing.samples)},
                           {"processes": 2, "verified": True, "chunk_bytes": local.chunk_bytes,
                            "measured": "move call to the active end's outcome visible (NIXL DONE: bytes in place)"})

    def latency(self, point: Point, sweep: LatencySweep) -> Measurement:
        raise Skip("latency is measured with both ends in one process (the decode outcome must reach the timer)")

    def overhead(self, point: Point, sweep: OverheadSweep) -> Measurement:
        raise Skip("submission overhead does not depend on where the peer runs: see the one-process nixl case")

    def close(self) -> None:
        pass


SPECS = [
    CaseSpec("nixl_2p", "kvxfer NIXL backend, peer in a second process", Role.BACKEND,
             frozenset({Requirement.NIXL, Requirement.KVXFER_NIXL, Requirement.SUBPROCESS_PEER}),
             ("memory", "direction", "slots", "row_bytes", "rows", "groups"), frozenset({"throughput"}),
             TwoProcessNixl),
]
