"""The CUDA calls IpcBackend makes, emulated over shared host memory: its control path
(records, cancels, dead peers, masks, mappings) then runs in CI, where no GPU exists.

Only what the backend and ``kvxfer.testing.ipc_pairs.DeviceRows`` call is here, with the
same names and signatures as ``kvxfer._native`` (the layout transform of engine geometries
runs ``kvxfer.native.transform_copy`` over host memory). "Device memory" is a ``memfd`` mapped into this process;
its IPC handle names the file descriptor through ``/proc/<pid>/fd/<n>`` and the file's inode
(fd numbers are reused; a handle must never name another allocation), so that another
process maps the same pages (and, as with CUDA, the exporting process may not open its own
handle).

Copies on stream 0 (the legacy default stream, used synchronously by ``DeviceRows``) run at
once. On other streams they run at once too, unless ``KVXFER_HOST_CUDA_DELAY_S`` is set (a
spawned peer inherits it): then a worker thread per stream runs them in order, each that
long after it was queued, and an event completes only when the work queued before it has,
so that the backend's in-flight paths (events still pending, records sent by the progress
thread, peers dying mid-copy, shutdown with copies queued) run too. The real CUDA path is
covered by ``tests/gpu`` on the GPU machine; this module never replaces it there.
"""

from __future__ import annotations

import collections
import ctypes
import itertools
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from kvxfer import native
from kvxfer.backends.ipc.shm_map import map_shared, unmap
from kvxfer.contract import KvxferError, MemoryKind

HAS_CUDA = True
DELAY_ENV = "KVXFER_HOST_CUDA_DELAY_S"  # seconds: deferred mode (see above); a spawned peer inherits it
HANDLE_BYTES = 64  # cudaIpcMemHandle_t



class CopyError(KvxferError, RuntimeError):
    """As kvxfer._native.CopyError."""


class _Memory:
    """This process's allocations (memfd, owned) and mappings of other processes' (opened)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.owned: dict[int, tuple[int, int]] = {}    # base -> (size, fd)
        self.opened: dict[int, int] = {}               # base -> size
        self.ids = itertools.count(1)


_MEM = _Memory()


def _map(fd: int, size: int) -> int:
    try:
        return map_shared(fd, size)
    except OSError as exc:
        raise CopyError(f"mmap failed: {exc.strerror}") from exc


def device_count() -> int:
    return 1


def versions() -> tuple[int, int]:
    return (0, 0)


def device_alloc(device: int, nbytes: int) -> int:
    fd = os.memfd_create(f"kvxfer-host-cuda-{next(_MEM.ids)}")
    try:
        os.ftruncate(fd, max(1, nbytes))
        base = _map(fd, max(1, nbytes))
    except BaseException:
        os.close(fd)
        raise
    with _MEM.lock:
        _MEM.owned[base] = (max(1, nbytes), fd)
    return base


def device_free(device: int, ptr: int) -> None:
    _drain_all()  # as cudaFree: no queued copy may still touch it
    with _MEM.lock:
        entry = _MEM.owned.pop(ptr, None)
    if entry is None:
        raise CopyError("cudaFree: not an allocation of this process")
    size, fd = entry
    unmap(ptr, size)
    os.close(fd)


def ipc_export(device: int, ptr: int) -> tuple[bytes, int, int]:
    with _MEM.lock:
        for base, (size, fd) in _MEM.owned.items():
            if base <= ptr < base + size:
                name = f"/proc/{os.getpid()}/fd/{fd}:{os.fstat(fd).st_ino}"
                return name.encode().ljust(HANDLE_BYTES, b"\0"), base, size
    raise CopyError("cuMemGetAddressRange failed: the address is not device memory of this process")


def ipc_open(device: int, handle: bytes) -> int:
    if len(handle) != HANDLE_BYTES:
        raise CopyError(f"an IPC handle is {HANDLE_BYTES} bytes, got {len(handle)}")
    path, _, inode = handle.rstrip(b"\0").decode().rpartition(":")
    if path.startswith(f"/proc/{os.getpid()}/"):
        raise CopyError("cudaIpcOpenMemHandle: cudaErrorInvalidContext: a process cannot open its own handle")
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError as exc:
        raise CopyError(f"cudaIpcOpenMemHandle: {exc}") from exc
    try:
        stat = os.fstat(fd)
        if str(stat.st_ino) != inode:
            raise CopyError("cudaIpcOpenMemHandle: the handle's allocation was freed")
        size = stat.st_size
        base = _map(fd, size)
    finally:
        os.close(fd)  # the mapping keeps the pages
    with _MEM.lock:
        _MEM.opened[base] = size
    return base


def ipc_close(device: int, base: int) -> None:
    _drain_all()
    with _MEM.lock:
        size = _MEM.opened.pop(base, None)
    if size is None:
        raise CopyError("cudaIpcCloseMemHandle: not an open mapping")
    unmap(base, size)


def copy_bytes(device: int, dst: int, src: int, nbytes: int) -> None:
    ctypes.memmove(dst, src, nbytes)


_REGISTERED: set[int] = set()  # host_register()ed addresses (device address = host address here)


def host_register(device: int, ptr: int, nbytes: int) -> int:
    with _MEM.lock:
        if ptr in _REGISTERED:
            raise CopyError("cudaHostRegister: cudaErrorHostMemoryAlreadyRegistered")
        _REGISTERED.add(ptr)
    return ptr


def host_unregister(device: int, ptr: int) -> None:
    with _MEM.lock:
        if ptr not in _REGISTERED:
            raise CopyError("cudaHostUnregister: cudaErrorHostMemoryNotRegistered")
        _REGISTERED.discard(ptr)


def stream_write_word(device: int, stream: int, ptr: int, value: int) -> None:
    if ptr % 8:
        raise CopyError("stream_write_word: the word's address is not 8-byte aligned")

    def write() -> None:
        ctypes.c_uint64.from_address(ptr).value = value

    _enqueue(stream, write)


CORRUPT_ROW = 0xFE  # a check byte that asks the test hook to damage its row (native/cuda_api.h RowCheck)


def _check_rows(src_base: int, src_stride: int, src_slots: Any, dst_base: int, dst_stride: int, dst_slots: Any,
                n_rows: int, row_bytes: int, check_ptr: int, check_k: int, corrupt: bool) -> int:
    """The kernel's row check, after the copy: rows marked CORRUPT_ROW lose one bit where they
    landed (``corrupt``), then each row's digest where it was read and where it landed; one
    byte per row at ``check_ptr`` (0 the same, 1 not). The rows that differ."""
    out = np.ctypeslib.as_array((ctypes.c_uint8 * n_rows).from_address(check_ptr))
    src = np.arange(n_rows, dtype=np.int64) if src_slots is None else src_slots
    dst = np.arange(n_rows, dtype=np.int64) if dst_slots is None else dst_slots
    if corrupt:
        for row in np.flatnonzero(out == CORRUPT_ROW).tolist():
            ctypes.c_uint8.from_address(dst_base + int(dst[row]) * dst_stride).value ^= 1
    read = native.row_digests(base=src_base, stride=src_stride, slots=src, row_bytes=row_bytes, k=check_k)
    landed = native.row_digests(base=dst_base, stride=dst_stride, slots=dst, row_bytes=row_bytes, k=check_k)
    out[:] = read != landed
    return int(np.count_nonzero(out))


def cuda_copy_rows(src_base: int, src_stride: int, src_index: Any, dst_base: int, dst_stride: int, dst_index: Any,
                   n_rows: int, row_bytes: int, stream: int, device: int = -1, src_limit: int = -1,
                   dst_limit: int = -1, check_ptr: int = 0, check_k: int = 0, corrupt: bool = False) -> None:
    src_slots, dst_slots = _index(src_index), _index(dst_index)  # copies: the caller may reuse its arrays
    for slots, limit, what in ((src_slots, src_limit, "source"), (dst_slots, dst_limit, "destination")):
        # Refused at once, as the real launch does (limit -1: not checked).
        if slots is not None and limit >= 0 and slots.size and (slots.min() < 0 or slots.max() >= limit):
            raise CopyError(f"{what} index outside [0, {limit})")

    def copy() -> None:
        native.copy_rows(src_base=src_base, src_stride=src_stride, src_slots=src_slots, dst_base=dst_base,
                         dst_stride=dst_stride, dst_slots=dst_slots, row_bytes=row_bytes, n_rows=n_rows,
                         memory=MemoryKind.HOST)
        if check_ptr and n_rows:
            _check_rows(src_base, src_stride, src_slots, dst_base, dst_stride, dst_slots, n_rows, row_bytes,
                        check_ptr, check_k, corrupt)

    _enqueue(stream, copy)


def cuda_copy_rows_then(src_base: int, src_stride: int, src_index: Any, dst_base: int, dst_stride: int,
                        dst_index: Any, n_rows: int, row_bytes: int, stream: int, device: int, bell_ptr: int,
                        bell_value: int, event: int, check_ptr: int = 0, check_k: int = 0,
                        corrupt: bool = False) -> tuple[str, str]:
    cuda_copy_rows(src_base, src_stride, src_index, dst_base, dst_stride, dst_index, n_rows, row_bytes, stream,
                   device, check_ptr=check_ptr, check_k=check_k, corrupt=corrupt)
    if check_ptr and bell_ptr:
        # As the kernel: a checked copy rings only from a small copy's kernel (64 rows or fewer),
        # and only if every row checked out.
        if n_rows > 64:
            return _then(device, stream, 0, 0, event)
        if bell_ptr % 8:
            return "stream_write_word: the word's address is not 8-byte aligned", _then(device, stream, 0, 0, event)[1]

        def ring_if_clean() -> None:
            if not any((ctypes.c_uint8 * n_rows).from_address(check_ptr)):
                ctypes.c_uint64.from_address(bell_ptr).value = bell_value

        _enqueue(stream, ring_if_clean)
        return _then(device, stream, 0, 0, event)
    return _then(device, stream, bell_ptr, bell_value, event)


def cuda_transform_copy(src_addr: Any, dst_addr: Any, tokens: Any, heads: int, unit_bytes: int,
                        src_token_stride: int, src_head_stride: int, dst_token_stride: int, dst_head_stride: int,
                        stream: int, device: int = -1) -> None:
    # Copies: the caller may reuse its arrays once the launch returns, as with the real one.
    src, dst, tok = (np.array(a, dtype=np.int64, copy=True) for a in (src_addr, dst_addr, tokens))
    if not src.ndim == dst.ndim == tok.ndim == 1 or not src.size == dst.size == tok.size:
        raise CopyError("src_addr, dst_addr and tokens must be one-dimensional, one entry per segment")
    if tok.size and int(tok.min()) < 0:
        raise CopyError("a segment's token count is negative")  # refused at once, as the real launch does
    if heads < 1 or unit_bytes < 1 or min(src_token_stride, src_head_stride, dst_token_stride, dst_head_stride) < 0:
        raise CopyError("heads and unit_bytes must be at least 1, strides non-negative")

    def copy() -> None:
        try:
            native.transform_copy(src, dst, tok, heads=heads, unit_bytes=unit_bytes,
                                  src_strides=(src_token_stride, src_head_stride),
                                  dst_strides=(dst_token_stride, dst_head_stride), memory=MemoryKind.HOST)
        except native.RowCopyError as exc:  # a launch run at once raises what the real one does
            raise CopyError(f"layout transform: {exc}") from exc

    _enqueue(stream, copy)


def cuda_transform_copy_then(src_addr: Any, dst_addr: Any, tokens: Any, heads: int, unit_bytes: int,
                             src_token_stride: int, src_head_stride: int, dst_token_stride: int,
                             dst_head_stride: int, stream: int, device: int, bell_ptr: int, bell_value: int,
                             event: int) -> tuple[str, str]:
    cuda_transform_copy(src_addr, dst_addr, tokens, heads, unit_bytes, src_token_stride, src_head_stride,
                        dst_token_stride, dst_head_stride, stream, device)
    return _then(device, stream, bell_ptr, bell_value, event)


def _then(device: int, stream: int, bell_ptr: int, bell_value: int, event: int) -> tuple[str, str]:
    """The doorbell store and the event record queued after a copy: (store error, event error)."""
    errors = ["", ""]
    for i, (wanted, call) in enumerate(((bell_ptr, lambda: stream_write_word(device, stream, bell_ptr, bell_value)),
                                         (event, lambda: event_record(event, stream)))):
        if wanted:
            try:
                call()
            except CopyError as exc:
                errors[i] = str(exc)
    return errors[0], errors[1]


def _index(index: Any) -> Any:
    return None if index is None else np.array(index, dtype=np.int64, copy=True)


# --- streams and events -------------------------------------------------------------------
def _delay_s() -> float:
    try:
        return max(0.0, float(os.environ.get(DELAY_ENV, "0") or 0))
    except ValueError:
        return 0.0


class _Stream:
    """Work queued on one stream, run in order by a worker thread (deferred mode only)."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.queue: collections.deque[tuple[float, Callable[[], None] | None, int]] = collections.deque()
        self.queued = 0     # items ever queued
        self.done = 0       # items run (in order)
        self.closed = False
        self.error: str | None = None  # a copy that failed: the stream's later events report it
        self.thread: threading.Thread | None = None

    def put(self, fn: Callable[[], None] | None, delay: float) -> int:
        with self.cond:
            self.queued += 1
            self.queue.append((time.monotonic() + delay, fn, self.queued))
            if self.thread is None:
                self.thread = threading.Thread(target=self._run, name="kvxfer-host-cuda", daemon=True)
                self.thread.start()
            self.cond.notify_all()
            return self.queued

    def _run(self) -> None:
        while True:
            with self.cond:
                while not self.queue and not self.closed:
                    self.cond.wait()
                if not self.queue:
                    return
                due, fn, _ = self.queue[0]
            time.sleep(max(0.0, due - time.monotonic()))
            try:
                if fn is not None:
                    fn()
            except Exception as exc:  # as a device fault: sticky, reported by later queries
                self.error = self.error or f"row copy failed: {exc}"
            with self.cond:
                self.queue.popleft()
                self.done += 1
                self.cond.notify_all()

    def drain(self) -> None:
        with self.cond:
            while self.done < self.queued:
                self.cond.wait()

    def close(self) -> None:
        self.drain()
        with self.cond:
            self.closed = True
            self.cond.notify_all()
        if self.thread is not None:
            self.thread.join()


_HANDLES = itertools.count(1)
_STREAMS: dict[int, _Stream] = {}
_EVENTS: dict[int, tuple[int, int]] = {}  # event -> (stream, item it waits for); (0, 0) = complete
_BROKEN: dict[int, str] = {}  # event -> the device error every query of it raises, until destroyed
_BREAK_NEXT: collections.deque[str] = collections.deque()  # errors for the next events recorded
_LOCK = threading.Lock()


def break_next_event(message: str) -> None:
    """Fault injection: the next event recorded (by event_record or cuda_copy_rows_then) is
    left by a device error. Every query of it raises CopyError(message) until it is
    destroyed, also after it is recorded again: after a real device fault nothing says what
    state an event is in, so a backend that reuses it must see that here. The work queued
    before it still runs."""
    with _LOCK:
        _BREAK_NEXT.append(message)


def clear_faults() -> None:
    """Drop injected faults not yet taken (a test that ends early leaves none behind)."""
    with _LOCK:
        _BREAK_NEXT.clear()


def _enqueue(stream: int, fn: Callable[[], None]) -> None:
    delay = _delay_s()
    with _LOCK:
        queue = _STREAMS.get(stream)
    if stream == 0 or queue is None or (delay == 0 and queue.done == queue.queued):
        fn()  # nothing ahead of it: run now
        return
    queue.put(fn, delay)


def _drain_all() -> None:
    with _LOCK:
        queues = list(_STREAMS.values())
    for queue in queues:
        queue.drain()


def stream_create(device: int) -> int:
    handle = next(_HANDLES)
    with _LOCK:
        _STREAMS[handle] = _Stream()
    return handle


def stream_destroy(stream: int) -> None:
    with _LOCK:
        queue = _STREAMS.pop(stream, None)
    if queue is not None:
        queue.close()


def stream_synchronize(stream: int, device: int = -1) -> None:
    with _LOCK:
        queue = _STREAMS.get(stream)
    if queue is not None:
        queue.drain()


def event_create(device: int) -> int:
    handle = next(_HANDLES)
    with _LOCK:
        _EVENTS[handle] = (0, 0)
    return handle


def event_record(event: int, stream: int) -> None:
    with _LOCK:
        queue = _STREAMS.get(stream)
    item = 0
    if queue is not None and _delay_s() > 0:
        item = queue.put(None, 0.0)  # a marker: done once everything queued before it is
    with _LOCK:
        _EVENTS[event] = (stream, item)
        if _BREAK_NEXT:
            _BROKEN[event] = _BREAK_NEXT.popleft()


def event_query(event: int) -> bool:
    with _LOCK:
        stream, item = _EVENTS.get(event, (0, 0))
        queue = _STREAMS.get(stream)
        broken = _BROKEN.get(event)
    if broken is not None:
        raise CopyError(broken)
    if item == 0 or queue is None:
        return True
    with queue.cond:
        if queue.error is not None:
            raise CopyError(queue.error)
        return queue.done >= item


def _spin(event: int, timeout_us: int) -> bool:
    end = time.perf_counter() + timeout_us / 1e6
    while not event_query(event):
        if time.perf_counter() >= end:
            return False
        os.sched_yield()  # lets the stream's worker thread (which needs the GIL) run the copy
    return True


def event_spin_send(event: int, spin_us: int, fd: int, frame: bytes, check_host: int = 0,
                    check_rows: int = 0) -> tuple[bool, int]:
    done = _spin(event, spin_us)
    if not done or fd < 0:
        return done, 0
    if check_rows and any((ctypes.c_uint8 * check_rows).from_address(check_host)):
        return True, 0  # a row failed its check: the frame (DELIVERED) does not go
    try:
        return True, os.write(fd, frame)  # the socket is non-blocking; Python ignores SIGPIPE
    except BlockingIOError:
        return True, 0
    except OSError as exc:
        return True, -(exc.errno or 1)


def event_synchronize(event: int) -> None:
    while not event_query(event):
        time.sleep(0.0002)


def event_destroy(event: int) -> None:
    with _LOCK:
        _EVENTS.pop(event, None)
        _BROKEN.pop(event, None)
