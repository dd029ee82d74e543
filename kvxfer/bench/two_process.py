"""kvxfer backends with their two ends in two processes: the figures PERF.md targets.

The active end (push: the publisher; pull: the fetcher) is a backend in this process; the
passive end is the same kind of backend in a child process (``SubprocessPeer`` for NIXL
over host memory, ``ipc_pair.ChildPeer`` for CUDA IPC), with its own rows. The figure
runs from the call that moves bytes to the active end's outcome being visible here
through its wake callback: a backend concludes only once its bytes are in place at the
destination (NIXL: request DONE; IPC: the kernel's event), so this is the transfer. The
child's own outcome is then collected untimed (it crosses a socket and a poll) and must
be Delivered for every row. Rows are compared byte for byte after the timed runs.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvxfer.bench.backend_cases import BLOCK_TOKENS, LAYOUT, Watch, wait_settled
from kvxfer.bench.cases import CaseSpec, Measurement, Requirement, Role, Skip
from kvxfer.bench.config import BenchConfig, LatencySweep, OverheadSweep, Point
from kvxfer.bench.layout import choose_slots, pool_slots
from kvxfer.bench.timing import time_runs
from kvxfer.contract import Backend, CacheKind, LayerGroupRows, SlotRegion, TokenRange, TransferMode, View

_RESULT_TIMEOUT_S = 60.0
Geometry = tuple[tuple[str, int, int], ...]  # (region name, row bytes, slots) per group


def passive_nixl_child(mode: str, geometry: list[list[Any]]) -> tuple[Any, Any, None]:
    """Runs in the child (``SubprocessPeer``): a NixlBackend over host rows of ``geometry``."""
    from kvxfer.backends.nixl import NixlBackend
    from kvxfer.testing.memory import HostBuffer, HostRows

    memory = HostRows([HostBuffer(name, row_bytes, slots) for name, row_bytes, slots in geometry])
    backend = NixlBackend(mode=TransferMode(mode))
    backend.register(memory.regions)
    return backend, memory, None


@dataclass(frozen=True)
class Kind:
    """How to build one backend kind's two ends and their rows."""

    memory: str                                             # the memory kind it runs over
    local: Callable[[TransferMode], Backend]
    peer: Callable[[TransferMode, Geometry], Any]           # a PeerEnd with regions, close()
    rows: Callable[[Geometry], Any]                         # RowMemory with regions (and close())
    facts: dict[str, Any]


def _nixl_kind() -> Kind:
    def local(mode: TransferMode) -> Backend:
        from kvxfer.backends.nixl import NixlBackend

        return NixlBackend(mode=mode)

    def peer(mode: TransferMode, geometry: Geometry) -> Any:
        from kvxfer.testing.subprocess_peer import SubprocessPeer

        return SubprocessPeer("kvxfer.bench.two_process:passive_nixl_child",
                              {"mode": mode.value, "geometry": [list(g) for g in geometry]})

    def rows(geometry: Geometry) -> Any:
        from kvxfer.testing.memory import HostBuffer, HostRows

        return HostRows([HostBuffer(name, row_bytes, slots) for name, row_bytes, slots in geometry])

    return Kind("host", local, peer, rows, {"processes": 2, "transport": "NIXL over UCX, host memory", "packed": "auto"})


def _ipc_kind() -> Kind:
    def local(mode: TransferMode) -> Backend:
        from kvxfer.backends.ipc import IpcBackend

        return IpcBackend("bench", mode)

    def peer(mode: TransferMode, geometry: Geometry) -> Any:
        from kvxfer.backends.ipc_pair import ChildPeer, PeerSpec

        return ChildPeer(PeerSpec(mode, geometry=geometry))

    def rows(geometry: Geometry) -> Any:
        from kvxfer.backends.ipc_pair import DeviceRows

        return DeviceRows(geometry)

    return Kind("device", local, peer, rows, {"processes": 2, "transport": "CUDA IPC mapping + native row kernel"})


def _view(regions: tuple[SlotRegion, ...] | list[SlotRegion], slots: list[np.ndarray], rows: int) -> View:
    groups = tuple(LayerGroupRows(f"g{i}", CacheKind.PAGED, r, slots[i], np.arange(rows, dtype=np.int64))
                   for i, r in enumerate(regions))
    return View("bench", TokenRange(0, rows * BLOCK_TOKENS), groups, LAYOUT)


class TwoProcessCase:
    def __init__(self, config: BenchConfig, kind: Kind) -> None:
        self.config = config
        self.kind = kind
        self._rng = np.random.default_rng(config.seed + 3)
        self._peers: dict[TransferMode, Any] = {}  # children kept across points, where they can rebuild

    def _peer(self, mode: TransferMode, geometry: Geometry) -> Any:
        """A child for ``geometry``: reused (rebuilt in place) when it supports that, since a
        child takes seconds to start (NIXL's import alone) and tens of seconds on a busy host."""
        peer = self._peers.get(mode)
        if peer is not None:
            try:
                peer.rebuild({"mode": mode.value, "geometry": [list(g) for g in geometry]})
                return peer
            except Exception:
                self._peers.pop(mode)
                peer.close()
        peer = self.kind.peer(mode, geometry)
        if hasattr(peer, "rebuild"):
            self._peers[mode] = peer
        return peer

    def throughput(self, point: Point) -> Measurement:
        if point.memory != self.kind.memory:
            raise Skip(f"this pair runs over {self.kind.memory} memory")
        push = point.direction == "push"
        mode = TransferMode.PUSH if push else TransferMode.PULL
        n_slots = pool_slots(point, self.config.pool_factor)
        geometry_local = tuple((f"local-g{g}", point.row_bytes, n_slots) for g in range(point.groups))
        geometry_peer = tuple((f"peer-g{g}", point.row_bytes, n_slots) for g in range(point.groups))
        local_slots = [choose_slots(point, self.config.pool_factor, self._rng) for _ in range(point.groups)]
        peer_slots = [choose_slots(point, self.config.pool_factor, self._rng) for _ in range(point.groups)]
        memory = self.kind.rows(geometry_local)
        peer = local = None
        try:
            peer = self._peer(mode, geometry_peer)
            local = self.kind.local(mode)
            local.register(memory.regions)
            v_local = _view(memory.regions, local_slots, point.rows)
            v_peer = _view(peer.regions, peer_slots, point.rows)
            rng = np.random.default_rng(self.config.seed + point.rows)
            source = [rng.integers(0, 256, size=point.rows * point.row_bytes, dtype=np.uint8).tobytes()
                      for _ in range(point.groups)]
            for g in range(point.groups):
                if push:
                    memory.write(memory.regions[g].name, local_slots[g], source[g])
                else:
                    peer.write(peer.regions[g].name, peer_slots[g], source[g])
            op_peer = "fetch" if push else "publish"

            def run() -> float:
                assert local is not None and peer is not None
                h_local = local.describe(v_local)
                h_peer = peer.describe(v_peer)
                handle = peer.start(op_peer, v_peer, h_local)
                watch = Watch()
                t0 = time.perf_counter()
                attempt = (local.publish(v_local, h_peer, wake=watch) if push
                           else local.fetch(v_local, h_peer, wake=watch))
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
                got = (peer.read(peer.regions[g].name, peer_slots[g]) if push
                       else memory.read(memory.regions[g].name, local_slots[g]))
                if got != source[g]:
                    raise RuntimeError(f"group {g}: destination rows differ from the source after the timed runs")
        finally:
            left = len(local.shutdown()) if local is not None else 0
            if peer is not None and self._peers.get(mode) is not peer:
                peer.close()  # a kept child shuts its backend down when it rebuilds, or at close()
            if hasattr(memory, "close"):
                memory.close()
        if left:
            raise RuntimeError(f"{left} attempts were not quiesced at shutdown")
        return Measurement({"seconds_best": timing.best, "seconds_median": timing.median, "reps": len(timing.samples)},
                           {**self.kind.facts, "verified": True,
                            "measured": "move call to the active end's outcome visible (bytes in place)"})

    def latency(self, point: Point, sweep: LatencySweep) -> Measurement:
        raise Skip("latency is measured with both ends in one process (the decode outcome must reach the timer)")

    def overhead(self, point: Point, sweep: OverheadSweep) -> Measurement:
        raise Skip("submission overhead is measured with both ends in one process")

    def close(self) -> None:
        peers, self._peers = list(self._peers.values()), {}
        for peer in peers:
            peer.close()


_ALL = ("memory", "direction", "slots", "row_bytes", "rows", "groups")
SPECS = [
    CaseSpec("nixl_2p", "kvxfer NIXL backend, peer in a second process", Role.BACKEND,
             frozenset({Requirement.NIXL, Requirement.KVXFER_NIXL, Requirement.SUBPROCESS_PEER}), _ALL,
             frozenset({"throughput"}), lambda config: TwoProcessCase(config, _nixl_kind())),
    CaseSpec("ipc", "kvxfer CUDA IPC backend, peer in a second process", Role.BACKEND,
             frozenset({Requirement.CUDA, Requirement.KVXFER_IPC}), _ALL,
             frozenset({"throughput"}), lambda config: TwoProcessCase(config, _ipc_kind())),
]
