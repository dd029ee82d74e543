"""A worker's end of ``kvxfer doctor --peer URL``: a NIXL target the doctor's initiator moves bytes to and from.

The HTTP adapter (``kvxfer.worker.app``) routes ``/doctor/probe`` here. ``ProbeHost.open``
makes a NIXL agent of the probe's own (not the worker's backend's: its own UCX worker, its
own lock, nothing shared with serving) and registers one buffer of at most ``MAX_BYTES``:
host memory, or, when asked for and the worker's pool is on a GPU, device memory on that
GPU. The answer is what the doctor's initiator loads (the agent's metadata, the buffer's
address and device) with the worker's host name and its NIXL and UCX versions.

One probe at a time (a second is ``ProbeBusy``, naming the first). A probe is freed by
``free``; after ``IDLE_S`` without a ``renew`` (the doctor renews every few seconds while
it measures, so a doctor that died leaves nothing behind for long); when the event loop
that opened it ends (the worker's shutdown: ``asyncio.run`` cancels the probe's watch
task, which frees it); by ``close``; and at interpreter exit. Freeing deregisters the
buffer and drops the agent, which ends its threads.

The target must progress UCX for the initiator's one-sided operations to move over TCP, so
the probe's agent runs NIXL's progress thread, which polls without pause: it takes a core of
the worker's host (0.98 of one measured idle) for as long as a probe is open, which is why a
probe lives only while the doctor measures and renews it. A thread that sleeps between polls
would cost less but read the lane low (60 to 100% of these figures over TCP here).
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import ctypes
import glob
import logging
import mmap
import os
import socket
import threading
import time
import uuid
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvxfer.backends.nixl import nixl_api, raw_agent
from kvxfer.contract import KvxferError

log = logging.getLogger(__name__)

MAX_BYTES = 256 << 20
"""The largest buffer a probe registers: the worker's memory is for serving."""
MIN_BYTES = 128 << 10
"""The smallest: the doctor's row figures need two 64 KiB rows."""
IDLE_S = 60.0
"""A probe not renewed for this long is freed (the doctor died, or was cut off)."""
MEMORY = ("host", "device")


class ProbeError(KvxferError):
    """A probe call refused; the message says why."""


class ProbeInvalid(ProbeError):
    """The call asks for what no probe can be (a size out of bounds, unknown memory)."""


class ProbeBusy(ProbeError):
    """Another probe is open, or the worker is shutting down: nothing was made."""


class ProbeUnknown(ProbeError):
    """No open probe has that id (freed already, or expired)."""


def nixl_versions() -> dict[str, str]:
    """NIXL's package version and the version of the UCX library NIXL loaded."""
    from importlib import metadata  # noqa: PLC0415

    out: dict[str, str] = {}
    for dist in ("nixl", "nixl-cu13", "nixl-cu12"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    try:
        api = nixl_api()

        package_dir = Path(api.__file__).resolve().parent
        libs = glob.glob(str(package_dir.parent / f"{package_dir.name}.libs" / "libucp-*.so*"))
        lib = ctypes.CDLL(libs[0]) if libs else ctypes.CDLL("libucp.so.0")
        lib.ucp_get_version_string.restype = ctypes.c_char_p
        out["ucx"] = lib.ucp_get_version_string().decode()
        out["nixl_module"] = package_dir.name
    except (ImportError, OSError, IndexError, AttributeError) as exc:
        out["ucx"] = f"unknown ({exc})"
    return out


def parse_open(body: dict[str, Any]) -> tuple[int, str]:
    """``{"bytes": N, "memory": "host" | "device"}`` (memory: host when absent) read and
    checked; ProbeInvalid naming the field otherwise."""
    unknown = sorted(set(body) - {"bytes", "memory"})
    if unknown:
        raise ProbeInvalid(f"unknown field {unknown[0]!r}: a probe takes 'bytes' and 'memory'")
    nbytes = body.get("bytes")
    if not isinstance(nbytes, int) or isinstance(nbytes, bool):
        raise ProbeInvalid(f"'bytes' must be a whole number of bytes, got {nbytes!r}")
    if not MIN_BYTES <= nbytes <= MAX_BYTES:
        raise ProbeInvalid(f"'bytes' must be {MIN_BYTES} to {MAX_BYTES} ({MAX_BYTES >> 20} MiB: a probe borrows "
                           f"the worker's memory), got {nbytes}")
    memory = body.get("memory", "host")
    if memory not in MEMORY:
        raise ProbeInvalid(f"'memory' must be 'host' or 'device', got {memory!r}")
    return nbytes, str(memory)


def _agent(name: str) -> Any:
    """A NIXL agent with a UCX backend and NIXL's own progress thread (see the module)."""
    return raw_agent(name, progress_thread=True)


@dataclass
class _Target:
    id: str
    agent_name: str
    memory: str
    nbytes: int
    address: int
    device: int
    metadata: bytes
    opened: float
    touched: float
    agent: Any = None
    descs: Any = None
    buffer: Any = None


class ProbeHost:
    """The probes of one worker: at most one open at a time. ``device`` is where the
    worker's pool lives ("cpu" or "cuda:N"): a device probe's buffer goes there."""

    def __init__(self, worker: str, device: str, *, idle_s: float = IDLE_S, max_bytes: int = MAX_BYTES) -> None:
        self.worker = worker
        self.device = device
        self.idle_s = idle_s
        self.max_bytes = max_bytes
        self._device_buffer: Any = None  # kept once made (see _build)
        self._lock = threading.Lock()  # the probe's own: serving never takes it
        self._target: _Target | None = None
        self._opening = False
        self._closed = False
        self._watch: asyncio.Task[None] | None = None
        self._versions: dict[str, str] | None = None
        _HOSTS.add(self)

    # --- what the routes call ---------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        """The open probe (or null), and the bounds a new one takes."""
        with self._lock:
            target = self._target
            active = None if target is None else {
                "id": target.id, "memory": target.memory, "bytes": target.nbytes,
                "age_s": round(time.monotonic() - target.opened, 1),
                "expires_in_s": round(max(0.0, target.touched + self.idle_s - time.monotonic()), 1)}
        return {"active": active, "max_bytes": self.max_bytes, "idle_s": self.idle_s, "worker": self.worker,
                "device": self.device}

    async def open(self, nbytes: int, memory: str) -> dict[str, Any]:
        """Make a probe target and answer what the doctor's initiator needs."""
        if nbytes > self.max_bytes:
            raise ProbeInvalid(f"'bytes' {nbytes} is over this worker's probe limit of {self.max_bytes}")
        if memory == "device" and not self.device.startswith("cuda"):
            raise ProbeInvalid(f"this worker's pool is on {self.device}: it has no device memory to probe")
        with self._lock:
            if self._closed:
                raise ProbeBusy("the worker is shutting down: it opens no probe")
            if self._target is not None or self._opening:
                raise ProbeBusy(self._busy())
            self._opening = True
        # The thread installs the probe and arms its expiry itself: a caller cancelled while
        # it runs (its client went away) leaves a probe that expires, not one nobody knows.
        target = await asyncio.to_thread(self._make, nbytes, memory, asyncio.get_running_loop())
        log.info("doctor probe %s opened: %s memory, %d bytes", target.id, memory, nbytes)
        return {"id": target.id, "agent": target.agent_name, "metadata": target.metadata.hex(),
                "address": target.address, "device": target.device, "memory": memory, "bytes": nbytes,
                "idle_s": self.idle_s, "host": socket.gethostname(), "worker": self.worker,
                "worker_device": self.device, "versions": self._versions}

    def renew(self, probe_id: str) -> dict[str, Any]:
        """The doctor is still measuring: the probe lives another ``idle_s``."""
        with self._lock:
            target = self._find(probe_id)
            target.touched = time.monotonic()
        return {"id": probe_id, "expires_in_s": self.idle_s}

    async def free(self, probe_id: str) -> dict[str, Any]:
        with self._lock:
            target = self._find(probe_id)
            self._target = None
        self._stop_watch()
        await asyncio.to_thread(_free, target)
        log.info("doctor probe %s freed", probe_id)
        return {"id": probe_id, "freed": True}

    def close(self) -> None:
        """Free the open probe (if any) here and now, and open no other."""
        with self._lock:
            self._closed = True
            target, self._target = self._target, None
        self._stop_watch()
        if target is not None:
            _free(target)
            log.info("doctor probe %s freed at shutdown", target.id)

    async def aclose(self) -> None:
        await asyncio.to_thread(self.close)

    # --- inside ---------------------------------------------------------------------------
    def _busy(self) -> str:
        target = self._target
        if target is None:
            return "a doctor probe is being opened on this worker already: one probe at a time"
        left = max(0.0, target.touched + self.idle_s - time.monotonic())
        return (f"doctor probe {target.id} is active on this worker already (opened "
                f"{time.monotonic() - target.opened:.0f}s ago): one probe at a time; retry when it ends "
                f"(unless its doctor renews it, it expires in {left:.0f}s)")

    def _find(self, probe_id: str) -> _Target:
        target = self._target
        if target is None or target.id != probe_id:
            raise ProbeUnknown(f"no doctor probe {probe_id!r} on this worker (freed, or expired after "
                               f"{self.idle_s:g}s without a word from its doctor)")
        return target

    def _make(self, nbytes: int, memory: str, loop: asyncio.AbstractEventLoop) -> _Target:
        """On a thread of its own: the buffer, the agent, the registration; then installed
        as the open probe, its expiry armed on ``loop``."""
        try:
            target = self._build(nbytes, memory)
        except BaseException:
            with self._lock:
                self._opening = False
            raise
        with self._lock:
            self._opening = False
            closed = self._closed
            if not closed:
                self._target = target
        if closed:
            _free(target)
            raise ProbeBusy("the worker is shutting down: it opens no probe")
        try:
            loop.call_soon_threadsafe(self._arm, target)
        except RuntimeError:  # the loop closed meanwhile: nothing would expire it
            self.close()
            raise ProbeBusy("the worker is shutting down: it opens no probe") from None
        return target

    def _build(self, nbytes: int, memory: str) -> _Target:
        if self._versions is None:
            self._versions = nixl_versions()
        probe_id = uuid.uuid4().hex[:12]
        name = f"kvxfer-doctor-target-{self.worker}-{os.getpid()}-{probe_id}"
        if memory == "device":
            import torch  # noqa: PLC0415 - a GPU worker has it

            device = torch.device(self.device)
            torch.cuda.set_device(device)  # this thread's current GPU: UCX may take it
            # One buffer of the largest size, kept for the worker's life and reused by every
            # device probe: given back to torch's caching allocator, a late write of a doctor
            # that outlived its probe (cuda_ipc reaches it without us) could land in memory the
            # worker reuses, as the host path's private mapping prevents.
            if self._device_buffer is None:
                self._device_buffer = torch.zeros((self.max_bytes,), dtype=torch.uint8, device=device)
            buffer: Any = self._device_buffer[:nbytes]
            buffer.zero_()
            address, index, kind = int(buffer.data_ptr()), int(buffer.device.index or 0), "VRAM"
        else:
            # A mapping of its own, unmapped when freed: a late write of a doctor that outlived
            # its probe (over cma, straight into this process) faults there, and never lands in
            # memory the worker reuses, as it could in the heap.
            buffer = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            view = np.frombuffer(buffer, dtype=np.uint8)
            view[:] = 0  # every page touched, as the doctor's own target
            address, index, kind = int(view.ctypes.data), 0, "DRAM"
            del view
        now = time.monotonic()
        target = _Target(probe_id, name, memory, nbytes, address, index, b"", now, now, buffer=buffer)
        try:
            target.agent = _agent(name)
            target.descs = target.agent.register_memory([(address, nbytes, index, "")], kind)
            target.metadata = bytes(target.agent.get_agent_metadata())
        except BaseException:
            _free(target)
            raise
        return target

    def _arm(self, target: _Target) -> None:
        """On the loop: the task that expires ``target`` (none once it was freed)."""
        with self._lock:
            if self._target is not target:
                return
        self._watch = asyncio.get_running_loop().create_task(self._expire(target))

    async def _expire(self, target: _Target) -> None:
        """Free ``target`` once ``idle_s`` passed without a renewal; and when cancelled by
        the event loop's end (the worker's shutdown) rather than by ``free``."""
        try:
            while True:
                with self._lock:
                    if self._target is not target:
                        return
                    left = target.touched + self.idle_s - time.monotonic()
                    if left <= 0:
                        self._target = None
                        break
                await asyncio.sleep(left)
        except asyncio.CancelledError:
            with self._lock:
                mine = self._target is target
                if mine:
                    self._target = None
            if mine:  # the loop is ending with the probe open: free it before the process goes
                _free(target)
                log.info("doctor probe %s freed: the worker is stopping", target.id)
            raise
        log.warning("doctor probe %s expired: no word from its doctor for %gs; freed", target.id, self.idle_s)
        await asyncio.to_thread(_free, target)

    def _stop_watch(self) -> None:
        watch, self._watch = self._watch, None
        if watch is not None and not watch.done():
            with contextlib.suppress(RuntimeError):  # its loop closed already: nothing to stop
                watch.get_loop().call_soon_threadsafe(watch.cancel)


def _free(target: _Target) -> None:
    """Deregister the buffer, drop the agent (its destructor ends its threads), drop the buffer."""
    agent, descs = target.agent, target.descs
    target.agent = target.descs = None
    if agent is not None and descs is not None:
        try:
            agent.deregister_memory(descs)
        except Exception as exc:  # noqa: BLE001 - the agent goes either way
            log.warning("doctor probe %s: NIXL deregister_memory failed: %s", target.id, exc)
    del agent, descs
    buffer, target.buffer = target.buffer, None
    if isinstance(buffer, mmap.mmap):
        buffer.close()


_HOSTS: weakref.WeakSet[ProbeHost] = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    """At exit, no probe agent is left for the interpreter's teardown to meet half-destroyed."""
    for host in list(_HOSTS):
        host.close()
