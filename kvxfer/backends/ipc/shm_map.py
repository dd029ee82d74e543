"""A file's pages mapped shared, by address (libc mmap through ctypes).

For memory that something other than Python writes (a GPU through cudaHostRegister, another
process): the address is what CUDA and the native code take, and, unlike Python's ``mmap``
object, nothing here holds a buffer export that would keep the mapping from being unmapped.
"""

from __future__ import annotations

import ctypes
import mmap
import os

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.restype = ctypes.c_int
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED = ctypes.c_void_p(-1).value


def map_shared(fd: int, nbytes: int) -> int:
    """The address of ``nbytes`` of ``fd`` mapped read-write and shared; OSError naming why not."""
    address = _libc.mmap(None, nbytes, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, fd, 0)
    if address is None or address == _MAP_FAILED:
        err = ctypes.get_errno()
        raise OSError(err, f"mmap of {nbytes} bytes: {os.strerror(err)}")
    return int(address)


def unmap(address: int, nbytes: int) -> None:
    _libc.munmap(address, nbytes)
