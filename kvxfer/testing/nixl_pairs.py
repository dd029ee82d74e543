"""Connected NIXL pairs for the conformance kit: both ends in this process, or the peer in a
child process (``ChildPairs``, over ``kvxfer.testing.subprocess_peer``), over host memory
(or device memory with ``memory_kind="device"``); and a two-process push throughput probe."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from kvxfer.backends.nixl import EtcdSettings, NixlBackend
from kvxfer.contract import Backend, MemoryKind, SlotRegion, TransferMode
from kvxfer.testing.conformance import InProcessPeer, Pair
from kvxfer.testing.memory import HostBuffer, HostRows, RowMemory, retain_if_unquiesced
from kvxfer.testing.subprocess_peer import SubprocessPeer, live_children

# Geometry as in kvxfer.testing.pairs: two groups of unequal row sizes at each end.
LOCAL_BUFFERS = (("L0", 256, 64), ("L1", 96, 40))
PEER_BUFFERS = (("P0", 256, 48), ("P1", 96, 50))


def host_rows(spec: tuple[tuple[str, int, int], ...]) -> HostRows:
    return HostRows([HostBuffer(name, slot_bytes, slots) for name, slot_bytes, slots in spec])


class DeviceRows(RowMemory):
    """Rows in CUDA memory (torch tensors kept alive here), registered as DEVICE regions."""

    def __init__(self, spec: tuple[tuple[str, int, int], ...], device: int = 0) -> None:
        import torch  # noqa: PLC0415 - only where CUDA exists

        self._torch = torch
        self.tensors = {name: torch.zeros((slots, slot_bytes), dtype=torch.uint8, device=f"cuda:{device}")
                        for name, slot_bytes, slots in spec}
        self.regions = tuple(
            SlotRegion(name, int(t.data_ptr()), t.shape[1], t.shape[0], MemoryKind.DEVICE, device)
            for name, t in self.tensors.items())
        torch.cuda.synchronize(device)

    def write(self, region: str, slots: np.ndarray, data: bytes) -> None:
        t = self.tensors[region]
        rows = self._torch.frombuffer(bytearray(data), dtype=self._torch.uint8).reshape(-1, t.shape[1])
        # A copy: views hand out read-only slot arrays, which torch warns about sharing.
        t[self._torch.as_tensor(np.array(slots, dtype=np.int64), device=t.device)] = rows.to(t.device)
        self._torch.cuda.synchronize(t.device)  # the tensor's device: it need not be the current one

    def read(self, region: str, slots: np.ndarray) -> bytes:
        t = self.tensors[region]
        index = self._torch.as_tensor(np.array(slots, dtype=np.int64), device=t.device)
        return bytes(t[index].cpu().numpy().tobytes())


def touch_pages(memory: HostRows | DeviceRows) -> None:
    """Fault host pages in (np.zeros maps them lazily), so that timings measure the transfer."""
    if isinstance(memory, HostRows):
        for buffer in memory.buffers.values():
            buffer.array.fill(1)


def rows_of(memory: str, spec: tuple[tuple[str, int, int], ...], device: int = 0) -> HostRows | DeviceRows:
    """Host rows, or device rows on CUDA device ``device``, of the given geometry."""
    return DeviceRows(spec, device) if memory == "device" else host_rows(spec)


def make_backend(mode: TransferMode, memory: HostRows | DeviceRows, **options: Any) -> NixlBackend:
    backend = NixlBackend(mode=mode, **options)
    backend.register(memory.regions)
    return backend


def fault_injector(backend: Any) -> Callable[[int | None], None]:
    """Sets ``fail_after_rows`` of a backend that has it (NIXL, IPC, ucx, loopback)."""
    def inject(rows: int | None) -> None:
        backend.fail_after_rows = rows
    return inject


def two_ends(mode: TransferMode, build: Callable[[TransferMode, HostRows | DeviceRows], Backend],
             memory_kind: str = "host") -> Pair:
    """A pair of backends that ``build`` makes, both in this process, over the kit's geometry."""
    local_mem, peer_mem = rows_of(memory_kind, LOCAL_BUFFERS), rows_of(memory_kind, PEER_BUFFERS)
    local, peer = build(mode, local_mem), build(mode, peer_mem)

    def close() -> None:
        retain_if_unquiesced(local.shutdown() | peer.shutdown(), local_mem, peer_mem)

    return Pair(local, local_mem, local_mem.regions, InProcessPeer(peer, peer_mem, peer_mem.regions,
                                                                   fault_injector(peer)),
                mode, fault_injector(local), close)


def nixl_pair(mode: TransferMode, *, deadline_s: float = 10.0, **options: Any) -> Pair:
    """Two NixlBackends in this process (UCX between two agents of one process)."""
    return two_ends(mode, lambda m, memory: make_backend(m, memory, deadline_s=deadline_s, **options))


def child_backend(mode: str, deadline_s: float = 10.0, buffers: list[list[Any]] | None = None,
                  memory_kind: str = "host", touch: bool = False, device: int = 0,
                  **options: Any) -> tuple[NixlBackend, HostRows | DeviceRows, Callable[[int | None], None]]:
    """Runs in the child process of a SubprocessPeer: a NixlBackend over host (or device)
    buffers (``buffers``: [name, slot_bytes, slots] items; the kit's peer geometry by default).
    Device buffers live on CUDA device ``device``, made the child's current device, as a
    decode worker on that GPU would have it. ``etcd`` (JSON): ``EtcdSettings`` fields."""
    spec = tuple((str(n), int(b), int(k)) for n, b, k in buffers) if buffers else PEER_BUFFERS
    if isinstance(options.get("etcd"), dict):
        options["etcd"] = EtcdSettings(**options["etcd"])
    if memory_kind == "device":
        import torch  # noqa: PLC0415 - only where CUDA exists

        torch.cuda.set_device(device)
    memory = rows_of(memory_kind, spec, device)
    if touch:
        touch_pages(memory)
    backend = make_backend(TransferMode(mode), memory, deadline_s=deadline_s, **options)
    return backend, memory, fault_injector(backend)


class ChildPairs:
    """A ``make_pair`` factory whose peer is a NixlBackend in one child process, rebuilt for
    each pair (a fresh child per pair costs seconds on a busy 2-core machine). ``close()``
    ends the child. ``devices``: the CUDA devices of this end's and the child's device rows.
    Another backend's pairs subclass it with their ``CHILD`` and ``_local_backend``."""

    def __init__(self, *, deadline_s: float = 10.0, memory_kind: str = "host", devices: tuple[int, int] = (0, 0),
                 **options: Any) -> None:
        self.options = {"deadline_s": deadline_s, **options}
        self.memory_kind = memory_kind
        self.devices = devices
        self.peer: SubprocessPeer | None = None

    CHILD = "kvxfer.testing.nixl_pairs:child_backend"  # the child's factory (SubprocessPeer)

    def _local_backend(self, mode: TransferMode, memory: HostRows | DeviceRows) -> Backend:
        return make_backend(mode, memory, **self.options)

    def __call__(self, mode: TransferMode) -> Pair:
        kwargs = {"mode": mode.value, "memory_kind": self.memory_kind, "device": self.devices[1], **self.options}
        if self.peer is None:
            self.peer = SubprocessPeer(self.CHILD, kwargs)
        else:
            self.peer.rebuild(kwargs)
        peer = self.peer
        local_mem = rows_of(self.memory_kind, LOCAL_BUFFERS, self.devices[0])
        local = self._local_backend(mode, local_mem)

        def close() -> None:
            try:
                retain_if_unquiesced(local.shutdown(), local_mem)
            finally:
                peer.shutdown()

        return Pair(local, local_mem, local_mem.regions, peer, mode, fault_injector(local), close)

    def close(self) -> None:
        if self.peer is not None:
            self.peer.close()
            self.peer = None

    @classmethod
    def kept(cls, **options: Any) -> Iterator[ChildPairs]:
        """For a module-scoped fixture (``yield from``): the pairs, then, at teardown, their
        child closed and AssertionError if any child process of this one is left running."""
        pairs = cls(**options)
        try:
            yield pairs
        finally:
            pairs.close()
        left = live_children()
        if left:
            raise AssertionError(f"child processes left running: {left}")


def push_rows_throughput(memory_kind: str = "host", *, rows: int = 4096, row_bytes: int = 64 << 10,
                         run: int = 16, coalesce: bool = True, reps: int = 3,
                         **options: Any) -> dict[str, float]:
    """GB/s of a NixlBackend push between two processes: ``rows`` rows in runs of ``run``
    slots contiguous on both ends (runs scattered), from publish() to the publisher's
    outcome (every chunk DONE: NIXL flushed, so the rows are at the peer). Best and median
    of ``reps``; the bytes of the last repetition are checked. ``options`` go to the
    publishing NixlBackend (e.g. ``chunk_bytes``)."""
    slots = rows * 2
    spec = (("S", row_bytes, slots),)
    rng = np.random.default_rng(0)

    def runs_of() -> np.ndarray:
        starts = rng.permutation(slots // run)[: rows // run] * run
        return (starts[:, None] + np.arange(run)[None, :]).reshape(-1).astype(np.int64)

    local_mem = rows_of(memory_kind, spec)
    touch_pages(local_mem)
    local = make_backend(TransferMode.PUSH, local_mem, coalesce=coalesce, deadline_s=120.0, **options)
    peer = SubprocessPeer("kvxfer.testing.nixl_pairs:child_backend",
                          {"mode": "push", "buffers": [["P", row_bytes, slots]], "memory_kind": memory_kind,
                           "deadline_s": 120.0, "touch": True})
    from kvxfer.contract import CacheKind, LayerGroupRows, TokenRange, View  # noqa: PLC0415
    from kvxfer.wire import decode_hint, encode_hint  # noqa: PLC0415

    times: list[float] = []
    try:
        ordinals = np.arange(rows, dtype=np.int64)
        payload = rng.integers(0, 256, rows * row_bytes, dtype=np.uint8).tobytes()
        for i in range(reps + 1):  # the first run warms up connections and pages
            request = f"tput-{i}"
            lslots, pslots = runs_of(), runs_of()
            lview = View(request, TokenRange(0, rows * 16),
                         (LayerGroupRows("g", CacheKind.PAGED, local_mem.regions[0], lslots, ordinals),), b"T")
            pview = View(request, TokenRange(0, rows * 16),
                         (LayerGroupRows("g", CacheKind.PAGED, peer.regions[0], pslots, ordinals),), b"T")
            if i == reps:
                local_mem.write("S", lslots, payload)
            phint = peer.describe_bytes(pview)
            handle = peer.start_bytes("fetch", pview, encode_hint(local.describe(lview)))
            start = time.perf_counter()
            attempt = local.publish(lview, decode_hint(phint))
            if not attempt.wait(120.0):
                raise RuntimeError("push did not conclude")
            elapsed = time.perf_counter() - start
            outcome, _ = peer.result(handle, 60.0)
            if outcome is None or not outcome.all_delivered:
                raise RuntimeError(f"push did not deliver every row: {outcome}")
            if i:
                times.append(elapsed)
            if i == reps and peer.read("P", pslots) != payload:
                raise RuntimeError("bytes at the peer differ")
        inline = local.stats().chunks_posted_inline
    finally:
        local.shutdown()
        peer.close()
    times.sort()
    total = rows * row_bytes
    return {"best_gbps": total / times[0] / 1e9, "median_gbps": total / times[len(times) // 2] / 1e9,
            "rows": rows, "row_bytes": row_bytes, "run": run, "coalesce": coalesce, "chunks_posted_inline": inline}
