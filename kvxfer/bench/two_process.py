"""kvxfer backends with their two ends in two processes: the figures docs/performance.md sets targets for.

The active end (push: the publisher; pull: the fetcher) is a backend in this process; the
passive end is the same kind of backend in a child process (``SubprocessPeer`` for NIXL
and for UCX, ``kvxfer.testing.ipc_pairs.ChildPeer`` for CUDA IPC), with its own rows. The figure
runs from the call that moves bytes to the active end's outcome being visible here
through its wake callback: a backend concludes only once its bytes are in place at the
destination (NIXL: request DONE; IPC: the kernel's event; UCX: a fetcher's receives
done, and a publisher's the fetcher's acknowledgement of them), so this is the transfer. The
child's own outcome is then collected untimed (it crosses a socket and a poll) and must
be Delivered for every row. Rows are compared byte for byte after the timed runs. The
timed publish follows the peer's fetch() back to back: an idle gap between them (as in
serving, where decode registers at admission) made ``IpcBackend``'s publish slower on the
H200 (bench/results/2026-11-29-h200-ipc-throughput, the cold-publish A/B), so these figures
are the warm case.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvxfer.bench.backend_cases import BLOCK_TOKENS, LAYOUT, Watch, nixl_facts, wait_settled
from kvxfer.bench.cases import CaseSpec, Measurement, Requirement, Role, Skip, device_scope
from kvxfer.bench.children import start_child
from kvxfer.bench.config import BenchConfig, LatencySweep, OverheadSweep, Point
from kvxfer.bench.layout import choose_slots, pool_slots
from kvxfer.bench.nixl_raw import latency_measurement
from kvxfer.bench.timing import Timing, check_fresh_bytes, time_runs
from kvxfer.contract import Backend, CacheKind, LayerGroupRows, SlotRegion, TokenRange, TransferMode, View

_LATENCY_VERIFY_BYTES = 512 << 20  # decode rows a latency sweep fills before comparing them
_RESULT_TIMEOUT_S = 60.0
Geometry = tuple[tuple[str, int, int], ...]  # (region name, row bytes, slots) per group


@dataclass(frozen=True)
class Kind:
    """How to build one backend kind's two ends and their rows; each callable's last
    argument is the CUDA device of that end's device rows."""

    memory: tuple[str, ...]                                 # the memory kinds it runs over
    local: Callable[[TransferMode, int], Backend]
    peer: Callable[[TransferMode, Geometry, str, int], Any]  # a PeerEnd with regions, close()
    rebuild_args: Callable[[TransferMode, Geometry, str, int], dict[str, Any]] | None  # a kept child's new backend
    rows: Callable[[Geometry, str, int], Any]               # RowMemory with regions (and close())
    facts: dict[str, Any]
    stamps_outcome: bool = False  # its child reports when its outcome became visible (latency)


def _nixl_kind(packed: str, integrity: bool = True) -> Kind:
    """NixlBackend here and in a SubprocessPeer child, over host or device rows."""

    def local(mode: TransferMode, device: int) -> Backend:
        from kvxfer.backends.nixl import NixlBackend

        return NixlBackend(mode=mode, packed=packed, integrity=integrity)  # type: ignore[arg-type]

    def args(mode: TransferMode, geometry: Geometry, memory: str, device: int) -> dict[str, Any]:
        return {"mode": mode.value, "buffers": [list(g) for g in geometry], "memory_kind": memory,
                "touch": True, "packed": packed, "device": device, "integrity": integrity}

    def peer(mode: TransferMode, geometry: Geometry, memory: str, device: int) -> Any:
        from kvxfer.testing.subprocess_peer import SubprocessPeer

        return SubprocessPeer("kvxfer.testing.nixl_pairs:child_backend", args(mode, geometry, memory, device))

    def rows(geometry: Geometry, memory: str, device: int) -> Any:
        from kvxfer.testing.nixl_pairs import rows_of, touch_pages

        made = rows_of(memory, geometry, device)
        touch_pages(made)
        return made

    from kvxfer.backends.nixl.plan import ChunkBytes

    return Kind(("host", "device"), local, peer, args, rows,  # both ends use the backend's defaults here
                {"processes": 2, "transport": "NIXL over UCX", "packed": packed, "integrity": integrity,
                 **nixl_facts(ChunkBytes())})


def ucx_child_backend(mode: str, buffers: list[list[Any]], memory_kind: str = "host", touch: bool = False,
                      device: int = 0, **options: Any) -> tuple[Backend, Any, None]:
    """Runs in the ``ucx_2p`` case's child (a SubprocessPeer): a UcxBackend with the
    backend's defaults over rows of the bench's geometry (``buffers``: [name, slot bytes,
    slots] items), as ``kvxfer.testing.nixl_pairs.child_backend`` builds NIXL's."""
    from kvxfer.backends.ucx import UcxBackend
    from kvxfer.testing.nixl_pairs import rows_of, touch_pages

    if memory_kind == "device":
        import torch

        torch.cuda.set_device(device)
    memory = rows_of(memory_kind, tuple((str(n), int(b), int(k)) for n, b, k in buffers), device)
    if touch:
        touch_pages(memory)
    backend = UcxBackend(mode=TransferMode(mode), **options)
    backend.register(memory.regions)
    return backend, memory, None


def _ucx_kind(**options: Any) -> Kind:
    """UcxBackend here and in a SubprocessPeer child (``ucx_child_backend``), both with the
    backend's defaults but ``options``, over host rows (device rows where ucxx has CUDA),
    touched as NIXL's are, so that ``ucx_2p`` and ``nixl_2p`` measure the same thing."""
    from kvxfer.backends.ucx import UcxBackend
    from kvxfer.backends.ucx.transport import load_ucxx, ucxx_version

    libucxx = load_ucxx()[0]  # not `import ucxx`: it would leave UCX_* options in os.environ for NIXL

    def local(mode: TransferMode, device: int) -> Backend:
        return UcxBackend(mode=mode, **options)

    def args(mode: TransferMode, geometry: Geometry, memory: str, device: int) -> dict[str, Any]:
        return {"mode": mode.value, "buffers": [list(g) for g in geometry], "memory_kind": memory, "touch": True,
                "device": device, **options}

    def peer(mode: TransferMode, geometry: Geometry, memory: str, device: int) -> Any:
        from kvxfer.testing.subprocess_peer import SubprocessPeer

        return SubprocessPeer(f"{__name__}:ucx_child_backend", args(mode, geometry, memory, device))

    def rows(geometry: Geometry, memory: str, device: int) -> Any:
        from kvxfer.testing.nixl_pairs import rows_of, touch_pages

        made = rows_of(memory, geometry, device)
        touch_pages(made)
        return made

    # Which settings were measured: the window, and UCX's peer error handling where the backend has it.
    settings = {**(UcxBackend.__init__.__kwdefaults__ or {}), **options}
    return Kind(("host", "device"), local, peer, args, rows,
                {"processes": 2, "transport": "UCX tag messages (ucxx)", "ucxx": ucxx_version(),
                 "ucxx_ucx": ".".join(map(str, libucxx.get_ucx_version())),
                 **{k: settings[k] for k in ("window", "error_handling") if k in settings}})


def _ipc_kind(busy_poll: bool = False, doorbell: bool = True, integrity: bool = True) -> Kind:
    def local(mode: TransferMode, device: int) -> Backend:
        from kvxfer.backends.ipc import IpcBackend

        return IpcBackend("bench", mode, device=device, busy_poll=busy_poll, doorbell=doorbell, integrity=integrity)

    def peer(mode: TransferMode, geometry: Geometry, memory: str, device: int) -> Any:
        from kvxfer.testing.ipc_pairs import ChildPeer, PeerSpec

        return ChildPeer(PeerSpec(mode, geometry=geometry, device=device, busy_poll=busy_poll, doorbell=doorbell,
                                  integrity=integrity))

    def rows(geometry: Geometry, memory: str, device: int) -> Any:
        from kvxfer.testing.ipc_pairs import DeviceRows

        return DeviceRows(geometry, device)

    return Kind(("device",), local, peer, None, rows,
                {"processes": 2, "transport": "CUDA IPC mapping + native row kernel", "busy_poll": busy_poll,
                 "doorbell": busy_poll and doorbell, "integrity": integrity},
                stamps_outcome=True)


def _view(regions: tuple[SlotRegion, ...] | list[SlotRegion], slots: list[np.ndarray], rows: int,
          request: str = "bench") -> View:
    groups = tuple(LayerGroupRows(f"g{i}", CacheKind.PAGED, r, slots[i], np.arange(rows, dtype=np.int64))
                   for i, r in enumerate(regions))
    return View(request, TokenRange(0, rows * BLOCK_TOKENS), groups, LAYOUT)


class TwoProcessCase:
    def __init__(self, config: BenchConfig, kind: Kind) -> None:
        self.config = config
        self.kind = kind
        self._rng = np.random.default_rng(config.seed + 3)
        self._peers: dict[tuple[TransferMode, str], Any] = {}  # children kept across points, where they can rebuild

    def _devices(self, mode: TransferMode) -> tuple[int, int]:
        """(this process's device, the child's): the active end is here, prefill for push."""
        return self.config.active_devices("push" if mode is TransferMode.PUSH else "pull")

    def _peer(self, mode: TransferMode, geometry: Geometry, memory: str) -> Any:
        """A child for ``geometry``: reused (rebuilt in place) when it supports that, since a
        child takes seconds to start (NIXL's import alone) and tens of seconds on a busy host."""
        key = (mode, memory)
        device = self._devices(mode)[1]
        peer = self._peers.get(key)
        if peer is not None and self.kind.rebuild_args is not None:
            try:
                peer.rebuild(self.kind.rebuild_args(mode, geometry, memory, device))
                return peer
            except Exception:
                self._peers.pop(key)
                peer.close()
        peer = start_child(lambda: self.kind.peer(mode, geometry, memory, device))  # spared the terminal's Ctrl-C
        if self.kind.rebuild_args is not None:
            self._peers[key] = peer
        return peer

    def throughput(self, point: Point) -> Measurement:
        if point.memory not in self.kind.memory:
            raise Skip(f"this pair runs over {' or '.join(self.kind.memory)} memory")
        push = point.direction == "push"
        mode = TransferMode.PUSH if push else TransferMode.PULL
        n_slots = pool_slots(point, self.config.pool_factor)
        geometry_local = tuple((f"local-g{g}", point.row_bytes, n_slots) for g in range(point.groups))
        geometry_peer = tuple((f"peer-g{g}", point.row_bytes, n_slots) for g in range(point.groups))
        local_slots = [choose_slots(point, self.config.pool_factor, self._rng) for _ in range(point.groups)]
        peer_slots = [choose_slots(point, self.config.pool_factor, self._rng) for _ in range(point.groups)]
        here = self._devices(mode)[0]
        memory = self.kind.rows(geometry_local, point.memory, here)
        peer = local = None
        paths: set[str] = set()
        try:
            peer = self._peer(mode, geometry_peer, point.memory)
            with device_scope(point.memory, here):
                local = self.kind.local(mode, here)
                if local.register(memory.regions):
                    raise Skip(f"{type(local).__name__} cannot reach {point.memory} memory in this process")
            v_local = _view(memory.regions, local_slots, point.rows)
            v_peer = _view(peer.regions, peer_slots, point.rows)
            def stamp(seed: int) -> list[bytes]:
                """Random bytes into the source rows (this end's for a push, the peer's for a pull)."""
                assert peer is not None
                rng = np.random.default_rng(seed)
                data = [rng.integers(0, 256, size=point.rows * point.row_bytes, dtype=np.uint8).tobytes()
                        for _ in range(point.groups)]
                for g in range(point.groups):
                    if push:
                        memory.write(memory.regions[g].name, local_slots[g], data[g])
                    else:
                        peer.write(peer.regions[g].name, peer_slots[g], data[g])
                return data

            stamp(self.config.seed + point.rows)
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
                if hasattr(local, "path_of"):
                    paths.add(str(local.path_of(attempt)))
                mine = wait_settled(attempt, "local attempt")
                theirs, quiesced = peer.result(handle, _RESULT_TIMEOUT_S)
                for name, outcome in (("local", mine), ("peer", theirs)):
                    if outcome is None or not outcome.all_delivered:
                        raise RuntimeError(f"{name} outcome {outcome!r} is not Delivered for every row")
                if not quiesced:
                    raise RuntimeError("the peer's attempt did not quiesce")
                return seen - t0

            timing = time_runs(run, self.config.repetition)

            def fresh(seed: int) -> Callable[[], bool]:
                source = stamp(seed)

                def landed() -> bool:
                    assert peer is not None
                    return all((peer.read(peer.regions[g].name, peer_slots[g]) if push
                                else memory.read(memory.regions[g].name, local_slots[g])) == source[g]
                               for g in range(point.groups))
                return landed

            check_fresh_bytes(fresh, run, "destination rows")
        finally:
            left = len(local.shutdown()) if local is not None else 0
            if peer is not None and self._peers.get((mode, point.memory)) is not peer:
                peer.close()  # a kept child shuts its backend down when it rebuilds, or at close()
            if hasattr(memory, "close"):
                memory.close()
        if left:
            raise RuntimeError(f"{left} attempts were not quiesced at shutdown")
        facts = {**self.kind.facts, "verified": True, **self._placement(point),
                 "measured": "move call to the active end's outcome visible (bytes in place)"}
        if paths:
            facts["path"] = "/".join(sorted(paths))
        return Measurement({"seconds_best": timing.best, "seconds_median": timing.median, "reps": len(timing.samples)},
                           facts)

    def latency(self, point: Point, sweep: LatencySweep) -> Measurement:
        """publish() call here -> the fetch outcome visible in the child (its wake callback
        stamps CLOCK_MONOTONIC, which both processes share). Push only: the decode end must
        be the child, and only ``kvxfer.testing.ipc_pairs.ChildPeer`` reports when its outcome became visible.
        Every sample's rows are compared byte for byte, a block of samples at a time (see below)."""
        if point.memory not in self.kind.memory:
            raise Skip(f"this pair runs over {' or '.join(self.kind.memory)} memory")
        if point.direction != "push" or not self.kind.stamps_outcome:
            raise Skip("two-process latency is measured for IPC push (its child stamps the decode outcome)")
        total = sweep.warmup + sweep.samples
        # Each sample lands in decode slots no earlier sample used, and the rows are compared
        # after a block of samples rather than after each: reading and clearing device rows
        # between samples (allocations, synchronous copies in both processes) made the next
        # sample up to twice as slow on the H200 host, a cost of the harness, not the transport.
        block = max(1, min(total, _LATENCY_VERIFY_BYTES // (point.rows * point.row_bytes)))
        src_slots = 4 * point.rows
        dst_slots = block * point.rows + block * point.rows // 4  # fresh, scattered slots for a block of samples
        here = self._devices(TransferMode.PUSH)[0]
        memory = self.kind.rows((("prefill", point.row_bytes, src_slots),), point.memory, here)
        peer = local = None
        samples: list[float] = []
        left = 0
        try:
            peer = self._peer(TransferMode.PUSH, (("decode", point.row_bytes, dst_slots),), point.memory)
            with device_scope(point.memory, here):
                local = self.kind.local(TransferMode.PUSH, here)
                local.register(memory.regions)
            rng = np.random.default_rng(self.config.seed + 5)
            everything = np.arange(src_slots, dtype=np.int64)
            # Distinct bytes in every source slot; every sample's rows are compared (untimed).
            memory.write("prefill", everything, rng.integers(0, 256, src_slots * point.row_bytes, dtype=np.uint8).tobytes())
            for first in range(0, total, block):
                count = min(block, total - first)
                fresh = rng.permutation(dst_slots)[: count * point.rows].astype(np.int64).reshape(count, point.rows)
                sources = []
                for k in range(count):
                    i = first + k
                    src = rng.permutation(src_slots)[:point.rows].astype(np.int64)
                    sources.append(src)
                    v_local = _view(memory.regions, [src], point.rows, f"lat{i}")
                    v_peer = _view(peer.regions, [fresh[k]], point.rows, f"lat{i}")
                    h_peer = peer.describe(v_peer)
                    handle = peer.start("fetch", v_peer, local.describe(v_local))
                    # In serving the decode end's fetch is registered long before prefill ends;
                    # publishing while the child still handles the registration times that too.
                    # The ping's answer can still come before the child's progress thread has
                    # finished its pass over the new wait (about 1% of samples on the H200):
                    # settle_us sleeps on top (see LatencySweep).
                    peer.ping()
                    if sweep.settle_us:
                        time.sleep(sweep.settle_us / 1e6)
                    watch = Watch()  # an owner waits for its wake callback: polling here took the GIL every 0.2 ms
                    t0 = time.monotonic_ns()
                    attempt = local.publish(v_local, h_peer, wake=watch)
                    watch.bind(attempt)
                    watch.wait_outcome()
                    mine = wait_settled(attempt, "local attempt")
                    theirs, quiesced = peer.result(handle, _RESULT_TIMEOUT_S)
                    if mine is None or theirs is None or not (mine.all_delivered and theirs.all_delivered) or not quiesced:
                        raise RuntimeError(f"sample {i}: outcomes {mine!r} / {theirs!r} are not Delivered and quiet")
                    if peer.last_visible_ns is None:
                        raise RuntimeError(f"sample {i}: the decode end did not stamp its outcome")
                    if i >= sweep.warmup:
                        samples.append((peer.last_visible_ns - t0) / 1e9)
                if peer.read("decode", fresh.reshape(-1)) != memory.read("prefill", np.concatenate(sources)):
                    raise RuntimeError(f"samples {first}..{first + count - 1}: the decode rows differ from the prefill rows")
                # Cleared, so that no later block can pass on rows left by this one.
                peer.write("decode", fresh.reshape(-1), bytes(fresh.size * point.row_bytes))
        finally:
            if local is not None:
                left = len(local.shutdown())
            if peer is not None:
                peer.close()
            if hasattr(memory, "close"):
                memory.close()
        if left:
            raise RuntimeError(f"{left} attempts were not quiesced at shutdown")
        return latency_measurement(Timing(tuple(samples)), {
            **self.kind.facts, "verified": True, **self._placement(point), "settle_us": sweep.settle_us,
            "measured": "publish call to decode outcome visible (decode end in a second process)"})

    def _placement(self, point: Point) -> dict[str, Any]:
        return {"devices": list(self.config.devices)} if point.memory == "device" else {}

    def overhead(self, point: Point, sweep: OverheadSweep) -> Measurement:
        raise Skip("submission overhead is measured with both ends in one process")

    def close(self) -> None:
        peers, self._peers = list(self._peers.values()), {}
        for peer in peers:
            peer.close()


_ALL = ("memory", "direction", "slots", "row_bytes", "rows", "groups")
SPECS = [
    CaseSpec("nixl_2p", "kvxfer NIXL backend (packed=auto), peer in a second process", Role.BACKEND,
             frozenset({Requirement.NIXL, Requirement.KVXFER_NIXL, Requirement.SUBPROCESS_PEER}), _ALL,
             frozenset({"throughput"}), lambda config: TwoProcessCase(config, _nixl_kind("auto"))),
    CaseSpec("nixl_2p_no_integrity", "kvxfer NIXL backend (packed=auto), integrity=False on both ends (no row "
             "digests: nixl_2p's reference for their cost), peer in a second process", Role.BACKEND,
             frozenset({Requirement.NIXL, Requirement.KVXFER_NIXL, Requirement.SUBPROCESS_PEER}), _ALL,
             frozenset({"throughput"}), lambda config: TwoProcessCase(config, _nixl_kind("auto", integrity=False))),
    CaseSpec("nixl_2p_packed", "kvxfer NIXL backend, packed rows (bounce arena), peer in a second process",
             Role.BACKEND, frozenset({Requirement.NIXL, Requirement.KVXFER_PACKED, Requirement.SUBPROCESS_PEER}),
             _ALL, frozenset({"throughput"}), lambda config: TwoProcessCase(config, _nixl_kind("always"))),
    CaseSpec("ucx_2p", "kvxfer UCX backend (ucxx tag messages), peer in a second process", Role.BACKEND,
             frozenset({Requirement.UCXX, Requirement.SUBPROCESS_PEER}), _ALL,
             frozenset({"throughput"}), lambda config: TwoProcessCase(config, _ucx_kind())),
    CaseSpec("ucx_2p_no_integrity", "kvxfer UCX backend, integrity=False on both ends (no row digests: ucx_2p's "
             "reference for their cost), peer in a second process", Role.BACKEND,
             frozenset({Requirement.UCXX, Requirement.SUBPROCESS_PEER}), _ALL,
             frozenset({"throughput"}), lambda config: TwoProcessCase(config, _ucx_kind(integrity=False))),
    CaseSpec("ucx_2p_no_error_handling", "kvxfer UCX backend, error_handling=False on both ends (UCX may use shared "
             "memory; a dead peer is seen only at the deadline), peer in a second process", Role.BACKEND,
             frozenset({Requirement.UCXX, Requirement.SUBPROCESS_PEER}), _ALL,
             frozenset({"throughput"}), lambda config: TwoProcessCase(config, _ucx_kind(error_handling=False))),
    CaseSpec("ipc", "kvxfer CUDA IPC backend, peer in a second process", Role.BACKEND,
             frozenset({Requirement.CUDA, Requirement.KVXFER_IPC}), _ALL,
             frozenset({"throughput", "latency"}), lambda config: TwoProcessCase(config, _ipc_kind())),
    CaseSpec("ipc_no_integrity", "kvxfer CUDA IPC backend, integrity=False on both ends (no row check in the copy "
             "kernel: ipc's reference for its cost), peer in a second process", Role.BACKEND,
             frozenset({Requirement.CUDA, Requirement.KVXFER_IPC}), _ALL,
             frozenset({"throughput", "latency"}), lambda config: TwoProcessCase(config, _ipc_kind(integrity=False))),
    CaseSpec("ipc_busy_poll", "kvxfer CUDA IPC backend, busy_poll=True on both ends (a core each polls their sockets "
             "and the waiter's doorbell word)",
             Role.BACKEND, frozenset({Requirement.CUDA, Requirement.KVXFER_IPC}), _ALL,
             frozenset({"throughput", "latency"}), lambda config: TwoProcessCase(config, _ipc_kind(busy_poll=True))),
    CaseSpec("ipc_busy_poll_sockets", "kvxfer CUDA IPC backend, busy_poll=True, doorbell=False (records over "
             "sockets only: ipc_busy_poll's reference)",
             Role.BACKEND, frozenset({Requirement.CUDA, Requirement.KVXFER_IPC}), _ALL,
             frozenset({"throughput", "latency"}),
             lambda config: TwoProcessCase(config, _ipc_kind(busy_poll=True, doorbell=False))),
]
