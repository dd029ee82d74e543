"""Two-process IPC pairs for the conformance kit, GPU tests and benchmarks.

CUDA refuses to open an IPC handle in the process that exported it, so the other end of an
IpcBackend under test lives in a child process: :class:`ChildPeer` is a conformance-kit
``PeerEnd`` that drives an IpcBackend in a child process over a pipe (forked from the kit's
fork server: ``kvxfer.testing.forked_peers``). Device row memory is
plain ``cudaMalloc`` memory from ``kvxfer._native`` (no framework needed); rows are read and
written through the native gather/scatter kernels and a staging buffer. An engine's own KV
(``DeviceKV``, torch tensors) serves transfers between engine geometries.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import os
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import numpy.typing as npt

from kvxfer import native
from kvxfer.backends.ipc.channel import CHANNEL_DIR_PREFIX
from kvxfer.contract import (
    BlockOrder,
    CacheKind,
    HeadOrder,
    Hint,
    LayerGroupRows,
    MemoryKind,
    Outcome,
    Peer,
    SlotRegion,
    TokenRange,
    TransferMode,
    View,
)
from kvxfer.testing.conformance import Pair, PeerEnd
from kvxfer.testing.forked_peers import peer_context, start_peer
from kvxfer.testing.memory import RowMemory

Index = npt.NDArray[np.int64]
LOCAL_GEOMETRY = (("L0", 256, 64), ("L1", 96, 40))
PEER_GEOMETRY = (("P0", 256, 48), ("P1", 96, 50))


class DeviceRows(RowMemory):
    """Device regions from cudaMalloc, each cut into slots; freed by close()."""

    def __init__(self, geometry: tuple[tuple[str, int, int], ...], device: int = 0, cuda: Any = None) -> None:
        self._n = cuda or native.cuda_module()
        self.device = device
        self._ptrs: dict[str, int] = {}
        self._regions: dict[str, SlotRegion] = {}
        try:
            for name, slot_bytes, slots in geometry:
                ptr = self._n.device_alloc(device, slot_bytes * slots)
                self._ptrs[name] = ptr
                self._regions[name] = SlotRegion(name, ptr, slot_bytes, slots, MemoryKind.DEVICE, device)
                zeros = np.zeros(slot_bytes * slots, dtype=np.uint8)
                self._n.copy_bytes(device, ptr, zeros.ctypes.data, zeros.size)
        except BaseException:
            self.close()
            raise

    @property
    def regions(self) -> tuple[SlotRegion, ...]:
        return tuple(self._regions.values())

    def write(self, region: str, slots: Index, data: bytes) -> None:
        r = self._regions[region]
        host = np.frombuffer(data, dtype=np.uint8).copy()
        slots = np.ascontiguousarray(slots, dtype=np.int64)
        staging = self._n.device_alloc(self.device, max(1, host.size))
        try:
            self._n.copy_bytes(self.device, staging, host.ctypes.data, host.size)
            self._n.cuda_copy_rows(staging, r.slot_bytes, None, r.address, r.slot_bytes, slots, slots.size,
                                   r.slot_bytes, 0, self.device, -1, r.slots)
            self._n.stream_synchronize(0, self.device)
        finally:
            self._n.device_free(self.device, staging)

    def read(self, region: str, slots: Index) -> bytes:
        r = self._regions[region]
        slots = np.ascontiguousarray(slots, dtype=np.int64)
        host = np.empty(slots.size * r.slot_bytes, dtype=np.uint8)
        staging = self._n.device_alloc(self.device, max(1, host.size))
        try:
            self._n.cuda_copy_rows(r.address, r.slot_bytes, slots, staging, r.slot_bytes, None, slots.size,
                                   r.slot_bytes, 0, self.device, r.slots, -1)
            self._n.copy_bytes(self.device, host.ctypes.data, staging, host.size)
        finally:
            self._n.device_free(self.device, staging)
        return host.tobytes()

    def close(self) -> None:
        for ptr in self._ptrs.values():
            self._n.device_free(self.device, ptr)
        self._ptrs.clear()


KV_OFFSET = 4096  # over host_cuda, where an engine's first tensor starts in its allocation


class DeviceKV(RowMemory):
    """An engine's own KV (``EngineKV``, float16) in device memory, built from a JSON-able spec,
    for transfers between engine geometries::

        {"kind": "layers" | "pool", "layers": 2, "kv_heads": 4, "head_dim": 8, "heads": [0, 4],
         "blocks": 12, "block_tokens": 16, "order": "nhd" | "hnd"}

    ``"layers"``: one tensor per layer, ``[2, blocks, bt, H, D]`` (NHD) or ``[2, blocks, H, bt,
    D]`` (HND); ``"pool"``: one block-major tensor ``[blocks, layers, 2, bt, H, D]`` (NHD), as a
    kvxfer pool lays out a group. Over CUDA (``cuda`` None) the tensors come from torch's
    caching allocator, after a small one, so that they start inside an allocation; over
    ``kvxfer.testing.host_cuda`` they are carved out of one allocation from ``KV_OFFSET`` on.
    The regions are DEVICE memory either way (a region's slots are its float16 elements);
    ``offsets`` says where each starts in its allocation."""

    def __init__(self, spec: dict[str, Any], device: int = 0, cuda: Any = None, name: str = "kv") -> None:
        self._n = cuda or native.cuda_module()
        self.device = device
        self._on_gpu = cuda is None
        self._arena = 0
        layers, held = int(spec["layers"]), int(spec["heads"][1]) - int(spec["heads"][0])
        blocks, bt, dim = int(spec["blocks"]), int(spec["block_tokens"]), int(spec["head_dim"])
        order = HeadOrder(spec.get("order", "nhd"))
        shapes: list[tuple[int, ...]]
        if spec["kind"] == "pool":
            shapes = [(blocks, layers, 2, bt, held, dim)]
        else:
            shapes = [(2, blocks, bt, held, dim) if order is HeadOrder.NHD else (2, blocks, held, bt, dim)] * layers
        self._keep: list[Any] = []
        self.tensors = self._gpu_tensors(shapes) if self._on_gpu else self._arena_tensors(shapes)
        try:
            self.kv = _engine_kv(spec, self.tensors, name, device)
            self.offsets = {r.name: r.address - int(self._n.ipc_export(device, r.address)[1]) for r in self.kv.regions}
        except BaseException:
            self.close()
            raise

    def _gpu_tensors(self, shapes: list[tuple[int, ...]]) -> list[Any]:
        import torch

        where = torch.device("cuda", self.device)
        self._keep.append(torch.empty(512, dtype=torch.uint8, device=where))  # the segment's first block
        tensors = [torch.zeros(shape, dtype=torch.float16, device=where) for shape in shapes]
        torch.cuda.synchronize(where)
        return tensors

    def _arena_tensors(self, shapes: list[tuple[int, ...]]) -> list[Any]:
        import torch

        sizes = [2 * int(np.prod(shape)) for shape in shapes]
        starts = KV_OFFSET + np.concatenate(([0], np.cumsum([-(-n // 256) * 256 for n in sizes])))
        self._arena = self._n.device_alloc(self.device, int(starts[-1]))
        tensors = []
        for shape, start, nbytes in zip(shapes, starts.tolist(), sizes):
            buffer = (ctypes.c_char * nbytes).from_address(self._arena + start)
            tensors.append(torch.frombuffer(buffer, dtype=torch.float16).view(shape))
        return tensors

    @property
    def regions(self) -> tuple[SlotRegion, ...]:
        return self.kv.regions

    def shared(self) -> tuple[Any, dict[str, int]]:
        """(the EngineKV without its tensors, for another process to lend views of; offsets)."""
        return type(self.kv)(self.kv.geometry, self.kv.layout, ()), dict(self.offsets)

    def fill(self, seed: int) -> None:
        """Random KV (torch's generator, ``seed``) in every tensor."""
        import torch

        g = torch.Generator().manual_seed(seed)
        for t in self.tensors:
            t.copy_(torch.randn(t.shape, generator=g).to(torch.float16))
        self._sync()

    def bytes_of(self, region: str) -> np.ndarray:
        """A copy of the region's bytes."""
        return np.array(self._flat(region).cpu().numpy(), copy=True)

    def write(self, region: str, slots: Index, data: bytes) -> None:
        import torch

        data_bytes = self.bytes_of(region)
        rows = data_bytes.reshape(-1, self._slot(region))
        rows[np.asarray(slots, dtype=np.int64)] = np.frombuffer(data, dtype=np.uint8).reshape(-1, rows.shape[1])
        self._flat(region).copy_(torch.from_numpy(data_bytes))
        self._sync()

    def read(self, region: str, slots: Index) -> bytes:
        rows = self.bytes_of(region).reshape(-1, self._slot(region))
        return rows[np.asarray(slots, dtype=np.int64)].tobytes()

    def _slot(self, region: str) -> int:
        return next(r.slot_bytes for r in self.kv.regions if r.name == region)

    def _flat(self, region: str) -> Any:
        import torch

        index = next(i for i, r in enumerate(self.kv.regions) if r.name == region)
        return self.tensors[index].reshape(-1).view(torch.uint8)

    def _sync(self) -> None:
        if self._on_gpu:
            import torch

            torch.cuda.synchronize(torch.device("cuda", self.device))

    def close(self) -> None:
        """Drop the tensors (their memory back to torch's cache, or the allocation freed)."""
        self.tensors = []
        self._keep.clear()
        if self._arena:
            self._n.device_free(self.device, self._arena)
            self._arena = 0


def _engine_kv(spec: dict[str, Any], tensors: list[Any], name: str, device: int) -> Any:
    """The spec's EngineKV over ``tensors``, its regions DEVICE memory of ``device``."""
    from kvxfer.lender.engine_kv import EngineKV  # torch: imported only where an engine's KV is made

    heads, kv_heads = (int(spec["heads"][0]), int(spec["heads"][1])), int(spec["kv_heads"])
    if spec["kind"] == "pool":
        t = tensors[0]
        layers = range(int(spec["layers"]))
        kv = EngineKV.from_planes([t[:, i, 0] for i in layers], [t[:, i, 1] for i in layers], tensors=(t,),
                                  kv_heads=kv_heads, heads=heads, head_order=HeadOrder.NHD,
                                  order=BlockOrder.BLOCK_MAJOR, name=name)
    else:
        kv = EngineKV.per_layer(tensors, kv_heads=kv_heads, heads=heads, head_order=HeadOrder(spec.get("order", "nhd")),
                                name=name)
    regions = tuple(dataclasses.replace(r, memory_kind=MemoryKind.DEVICE, device_id=device) for r in kv.regions)
    return EngineKV(dataclasses.replace(kv.geometry, regions=regions), kv.layout, kv.tensors)


# --- the child process ------------------------------------------------------------------
@dataclass(frozen=True)
class PeerSpec:
    mode: TransferMode
    geometry: tuple[tuple[str, int, int], ...] = PEER_GEOMETRY
    kv: dict[str, Any] | None = None  # an engine's KV (DeviceKV) instead of row memory
    device: int = 0
    deadline_s: float = 10.0
    key: bytes | None = None
    emulated: bool = False  # kvxfer.testing.host_cuda instead of CUDA (CI without a GPU)
    busy_poll: bool = False  # IpcBackend(busy_poll=...) in the child
    doorbell: bool = True  # IpcBackend(doorbell=...) in the child (effective with busy_poll)
    integrity: bool = True  # IpcBackend(integrity=...) in the child


def cuda_calls(emulated: bool) -> Any:
    """The emulation module when asked for, else None (the backend's default: kvxfer._native)."""
    if not emulated:
        return None
    from kvxfer.testing import host_cuda

    return host_cuda


def _serve(conn: Connection, spec: PeerSpec) -> None:
    from kvxfer.backends.ipc import IpcBackend

    cuda = cuda_calls(spec.emulated)
    memory: Any = DeviceRows(spec.geometry, spec.device, cuda) if spec.kv is None else DeviceKV(
        spec.kv, spec.device, cuda, name="peer-kv")
    backend = IpcBackend("child", spec.mode, device=spec.device, deadline_s=spec.deadline_s, key=spec.key,
                         busy_poll=spec.busy_poll, doorbell=spec.doorbell, cuda=cuda, integrity=spec.integrity)
    backend.register(memory.regions)
    attempts: dict[int, Any] = {}
    visible: dict[int, int] = {}
    conn.send(("ok", memory.regions))
    try:
        while True:
            cmd, *args = conn.recv()
            try:
                if cmd == "close":
                    conn.send(("ok", None))
                    return
                conn.send(("ok", _handle(cmd, args, backend, memory, attempts, visible)))
            except BaseException as exc:  # reported to the parent, which re-raises it
                conn.send(("err", exc))
    except (EOFError, OSError):
        pass  # the parent went away
    finally:
        backend.shutdown()
        memory.close()


def _handle(cmd: str, args: list[Any], backend: Any, memory: Any, attempts: dict[int, Any],
            visible: dict[int, int]) -> Any:
    if cmd == "describe":
        return backend.describe(*args)
    if cmd == "start":
        op, view, hint = args
        handle = len(attempts) + 1
        holder: list[Any] = []

        def wake() -> None:  # records when the outcome first became visible here
            if handle not in visible and holder and holder[0].poll() is not None:
                visible[handle] = time.monotonic_ns()

        attempt = (backend.fetch if op == "fetch" else backend.publish)(view, hint, wake)
        holder.append(attempt)
        attempts[handle] = attempt
        wake()
        return handle
    if cmd == "result":
        handle, timeout = args
        attempt = attempts[handle]
        # Waits on the attempt's own event: a polling loop here woke every half millisecond
        # and took the GIL from the progress thread, inflating the decode-side latency it measures.
        attempt.wait(timeout)
        return attempt.poll(), attempt.quiesced(), visible.get(handle)
    if cmd == "ping":
        return None
    if cmd == "cancel":
        attempts[args[0]].cancel()
        return None
    if cmd == "write":
        memory.write(*args)
        return None
    if cmd == "read":
        return memory.read(*args)
    if cmd == "inject":
        backend.fail_after_rows = args[0]
        return True
    if cmd == "bells":
        return backend.bells_rung
    if cmd == "kv":
        return memory.shared()
    if cmd == "fill":
        memory.fill(args[0])
        return None
    if cmd == "shutdown":
        return len(backend.shutdown())
    raise ValueError(f"unknown command {cmd!r}")


class ChildPeer(PeerEnd):
    """A PeerEnd whose IpcBackend and device memory live in a spawned child process."""

    def __init__(self, spec: PeerSpec, timeout_s: float = 60.0) -> None:
        ctx = peer_context()
        self._conn, child = ctx.Pipe()
        self._proc = start_peer(ctx, _serve, (child, spec), "kvxfer-ipc-peer")
        child.close()
        self._timeout = timeout_s
        self._socket_dir = ""
        self.regions = self._reply()
        self.last_visible_ns: int | None = None

    def _reply(self) -> Any:
        if not self._conn.poll(self._timeout):
            self.kill()
            raise TimeoutError("the IPC peer process did not answer")
        status, value = self._conn.recv()
        if status == "err":
            raise value
        return value

    def _call(self, *msg: Any) -> Any:
        self._conn.send(msg)
        return self._reply()

    def describe(self, view: View, audience: Peer | None = None) -> Hint:
        hint: Hint = self._call("describe", view, audience)
        self._socket_dir = os.path.dirname(os.fsdecode(hint.endpoint))  # the child's channel folder
        return hint

    def start(self, op: str, view: View, hint: Hint) -> int:
        return self._call("start", op, view, hint)  # type: ignore[no-any-return]

    def result(self, handle: int, timeout: float) -> tuple[Outcome | None, bool]:
        outcome, quiet, visible = self._call("result", handle, timeout)
        self.last_visible_ns = visible
        return outcome, quiet

    def cancel(self, handle: int) -> None:
        self._call("cancel", handle)

    def ping(self) -> None:
        """A round trip to the child's command loop: by then its backend's progress thread has
        almost surely handled what the last command started (latency harnesses use this to
        publish into an idle decode end, as serving does: its fetch is registered long before)."""
        self._call("ping")

    def write(self, region: str, slots: Index, data: bytes) -> None:
        self._call("write", region, np.asarray(slots, dtype=np.int64), data)

    def read(self, region: str, slots: Index) -> bytes:
        return self._call("read", region, np.asarray(slots, dtype=np.int64))  # type: ignore[no-any-return]

    def bells_rung(self) -> int:
        """How many of the child's waits its doorbell concluded (IpcBackend.bells_rung)."""
        return int(self._call("bells"))

    def inject_fault(self, rows: int | None) -> bool:
        return bool(self._call("inject", rows))

    def kv(self) -> tuple[Any, dict[str, int]]:
        """A KV child's (PeerSpec.kv) EngineKV, without tensors (the memory is the child's), and
        where each of its regions starts in its allocation."""
        return self._call("kv")  # type: ignore[no-any-return]

    def fill(self, seed: int) -> None:
        """Random KV in a KV child's tensors."""
        self._call("fill", seed)

    def shutdown(self) -> int:
        return int(self._call("shutdown"))

    @property
    def pid(self) -> int | None:
        return self._proc.pid

    def close(self) -> None:
        """Stop the child (its backend shuts down, its memory is freed) and reap it."""
        if self._proc.is_alive():
            try:
                self._call("close")
            except (OSError, EOFError, TimeoutError):
                pass
            self._proc.join(10.0)
        self.kill()

    def kill(self) -> None:
        if self._proc.is_alive():
            self._proc.kill()
        self._proc.join(10.0)
        self._conn.close()
        # A killed child cannot remove its channel's folder; a clean close already did.
        if self._socket_dir and os.path.basename(self._socket_dir).startswith(CHANNEL_DIR_PREFIX):
            shutil.rmtree(self._socket_dir, ignore_errors=True)


def ipc_pair(mode: TransferMode, *, device: int = 0, peer_device: int | None = None, deadline_s: float = 10.0,
             emulated: bool = False, busy_poll: bool = False) -> Pair:
    """A local IpcBackend over device memory on ``device`` here, and its peer in a child
    process on ``peer_device`` (default: the same device; another GPU moves rows over peer
    access). ``emulated``: both over kvxfer.testing.host_cuda, for CI without a GPU."""
    from kvxfer.backends.ipc import IpcBackend

    cuda = cuda_calls(emulated)
    peer = ChildPeer(PeerSpec(mode, device=device if peer_device is None else peer_device, deadline_s=deadline_s,
                              emulated=emulated, busy_poll=busy_poll))
    try:
        memory = DeviceRows(LOCAL_GEOMETRY, device, cuda)
    except BaseException:
        peer.close()
        raise
    local = IpcBackend("local", mode, device=device, deadline_s=deadline_s, busy_poll=busy_poll, cuda=cuda)
    local.register(memory.regions)

    def inject_local(rows: int | None) -> None:
        local.fail_after_rows = rows

    def close() -> None:
        local.shutdown()
        peer.close()
        memory.close()

    return Pair(local, memory, memory.regions, peer, mode, inject_local, close)


@contextlib.contextmanager
def push_pair(row_bytes: int, slots: int, emulated: bool = False, busy_poll: bool = False,
              devices: tuple[int, int] = (0, 0)) -> Iterator[tuple[ChildPeer, DeviceRows, Any]]:
    """For the bench scripts: a decode ChildPeer (busy-polling, with its doorbell, if asked)
    and, here, a publishing IpcBackend over its own DeviceRows, each ``slots`` rows of
    ``row_bytes``, on ``devices`` (prefill here, decode in the child); all three closed on
    the way out."""
    from kvxfer.backends.ipc import IpcBackend

    cuda = cuda_calls(emulated)
    peer = ChildPeer(PeerSpec(TransferMode.PUSH, geometry=(("decode", row_bytes, slots),), device=devices[1],
                              emulated=emulated, busy_poll=busy_poll))
    memory = local = None
    try:
        memory = DeviceRows((("prefill", row_bytes, slots),), devices[0], cuda=cuda)
        local = IpcBackend("prefill", TransferMode.PUSH, device=devices[0], cuda=cuda)
        local.register(memory.regions)
        yield peer, memory, local
    finally:
        if local is not None:
            local.shutdown()
        peer.close()
        if memory is not None:
            memory.close()


def one_group_view(region: SlotRegion, slots: npt.NDArray[np.int64], request: str) -> View:
    """A view of ``slots`` in ``region`` as one layer group, ordinals 0..n-1."""
    group = LayerGroupRows("g", CacheKind.PAGED, region, slots, np.arange(slots.size, dtype=np.int64))
    return View(request, TokenRange(0, slots.size * 16), (group,), b"x")
