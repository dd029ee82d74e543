"""The CUDA calls IpcBackend makes, emulated over shared host memory: its control path
(records, cancels, dead peers, masks, mappings) then runs in CI, where no GPU exists.

Only what the backend and ``ipc_pair.DeviceRows`` call is here, with the same names and
signatures as ``kvxfer._native``. "Device memory" is a ``memfd`` mapped into this process;
its IPC handle names the file descriptor through ``/proc/<pid>/fd/<n>``, so that another
process maps the same pages (and, as with CUDA, the exporting process may not open its own
handle). Copies run at once on the calling thread (native host row copy), so every event
is complete when recorded: work is never later than CUDA's, only earlier. The real CUDA
path is covered by ``tests/gpu`` on the GPU machine; this module never replaces it there.
"""

from __future__ import annotations

import ctypes
import itertools
import os
import threading
from typing import Any

import numpy as np

from kvxfer import native
from kvxfer.contract import MemoryKind

HAS_CUDA = True
HANDLE_BYTES = 64  # cudaIpcMemHandle_t

_PROT_RW = 0x1 | 0x2
_MAP_SHARED = 0x01
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.restype = ctypes.c_int
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]


class CopyError(RuntimeError):
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
    addr = _libc.mmap(None, size, _PROT_RW, _MAP_SHARED, fd, 0)
    if addr is None or addr == ctypes.c_void_p(-1).value:
        raise CopyError(f"mmap failed: {os.strerror(ctypes.get_errno())}")
    return int(addr)


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
    with _MEM.lock:
        size, fd = _MEM.owned.pop(ptr)
    _libc.munmap(ptr, size)
    os.close(fd)


def ipc_export(device: int, ptr: int) -> tuple[bytes, int, int]:
    with _MEM.lock:
        for base, (size, fd) in _MEM.owned.items():
            if base <= ptr < base + size:
                handle = f"/proc/{os.getpid()}/fd/{fd}".encode().ljust(HANDLE_BYTES, b"\0")
                return handle, base, size
    raise CopyError("cuMemGetAddressRange failed: the address is not device memory of this process")


def ipc_open(device: int, handle: bytes) -> int:
    if len(handle) != HANDLE_BYTES:
        raise CopyError(f"an IPC handle is {HANDLE_BYTES} bytes, got {len(handle)}")
    path = handle.rstrip(b"\0").decode()
    if path.startswith(f"/proc/{os.getpid()}/"):
        raise CopyError("cudaIpcOpenMemHandle: cudaErrorInvalidContext: a process cannot open its own handle")
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError as exc:
        raise CopyError(f"cudaIpcOpenMemHandle: {exc}") from exc
    try:
        size = os.fstat(fd).st_size
        base = _map(fd, size)
    finally:
        os.close(fd)  # the mapping keeps the pages
    with _MEM.lock:
        _MEM.opened[base] = size
    return base


def ipc_close(device: int, base: int) -> None:
    with _MEM.lock:
        size = _MEM.opened.pop(base, None)
    if size is None:
        raise CopyError("cudaIpcCloseMemHandle: not an open mapping")
    _libc.munmap(base, size)


def copy_bytes(device: int, dst: int, src: int, nbytes: int) -> None:
    ctypes.memmove(dst, src, nbytes)


def cuda_copy_rows(src_base: int, src_stride: int, src_index: Any, dst_base: int, dst_stride: int, dst_index: Any,
                   n_rows: int, row_bytes: int, stream: int, device: int = -1, src_limit: int = -1,
                   dst_limit: int = -1) -> None:
    try:
        native.copy_rows(src_base=src_base, src_stride=src_stride, src_slots=_index(src_index), dst_base=dst_base,
                         dst_stride=dst_stride, dst_slots=_index(dst_index), row_bytes=row_bytes, n_rows=n_rows,
                         memory=MemoryKind.HOST, src_limit=None if src_limit < 0 else src_limit,
                         dst_limit=None if dst_limit < 0 else dst_limit)
    except native.RowCopyError as exc:
        raise CopyError(str(exc)) from exc


def _index(index: Any) -> Any:
    return None if index is None else np.ascontiguousarray(index, dtype=np.int64)


# Streams and events: copies are done when queued, so both are bookkeeping only.
_HANDLES = itertools.count(1)


def stream_create(device: int) -> int:
    return next(_HANDLES)


def stream_destroy(stream: int) -> None:
    pass


def stream_synchronize(stream: int) -> None:
    pass


def event_create(device: int) -> int:
    return next(_HANDLES)


def event_record(event: int, stream: int) -> None:
    pass


def event_query(event: int) -> bool:
    return True


def event_synchronize(event: int) -> None:
    pass


def event_destroy(event: int) -> None:
    pass
