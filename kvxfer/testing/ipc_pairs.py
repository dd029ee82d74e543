"""Two-process IPC pairs for the conformance kit, GPU tests and benchmarks.

CUDA refuses to open an IPC handle in the process that exported it, so the other end of an
IpcBackend under test lives in a child process: :class:`ChildPeer` is a conformance-kit
``PeerEnd`` that drives an IpcBackend in a spawned child over a pipe. Device row memory is
plain ``cudaMalloc`` memory from ``kvxfer._native`` (no framework needed); rows are read and
written through the native gather/scatter kernels and a staging buffer.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
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
    CacheKind,
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


# --- the child process ------------------------------------------------------------------
@dataclass(frozen=True)
class PeerSpec:
    mode: TransferMode
    geometry: tuple[tuple[str, int, int], ...] = PEER_GEOMETRY
    device: int = 0
    deadline_s: float = 10.0
    key: bytes | None = None
    emulated: bool = False  # kvxfer.testing.host_cuda instead of CUDA (CI without a GPU)
    busy_poll: bool = False  # IpcBackend(busy_poll=...) in the child
    doorbell: bool = True  # IpcBackend(doorbell=...) in the child (effective with busy_poll)


def cuda_calls(emulated: bool) -> Any:
    """The emulation module when asked for, else None (the backend's default: kvxfer._native)."""
    if not emulated:
        return None
    from kvxfer.testing import host_cuda

    return host_cuda


def _serve(conn: Connection, spec: PeerSpec) -> None:
    from kvxfer.backends.ipc import IpcBackend

    cuda = cuda_calls(spec.emulated)
    memory = DeviceRows(spec.geometry, spec.device, cuda)
    backend = IpcBackend("child", spec.mode, device=spec.device, deadline_s=spec.deadline_s, key=spec.key,
                         busy_poll=spec.busy_poll, doorbell=spec.doorbell, cuda=cuda)
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


def _handle(cmd: str, args: list[Any], backend: Any, memory: DeviceRows, attempts: dict[int, Any],
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
    if cmd == "shutdown":
        return len(backend.shutdown())
    raise ValueError(f"unknown command {cmd!r}")


class ChildPeer(PeerEnd):
    """A PeerEnd whose IpcBackend and device memory live in a spawned child process."""

    def __init__(self, spec: PeerSpec, timeout_s: float = 60.0) -> None:
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_serve, args=(child, spec), name="kvxfer-ipc-peer", daemon=True)
        self._proc.start()
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
