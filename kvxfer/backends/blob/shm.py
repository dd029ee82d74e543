"""A blob store in a directory that the processes of one host share: one file per key.

On ``/dev/shm`` (tmpfs, the default) the blobs live in memory, and any process on the host
that opens the same directory sees them: a prefill worker's rows outlive it, and a later
decode worker, or another instance, reads them. A put writes a temporary file and renames it
over the key's file, so a reader sees a whole blob or none; the store's size is bounded by
``capacity_bytes`` (what the directory holds, counted at each put: FULL past it).

    driver = ShmDriver("/dev/shm/kvxfer-store")      # kvxfer serve --store memory
"""

from __future__ import annotations

import ctypes
import errno
import os
import secrets
from collections.abc import Sequence
from pathlib import Path

from kvxfer.backends.blob.driver import BlobDriver, KeyStatus, Span, StoreError
from kvxfer.contract import IndexArray

DEFAULT_PATH = "/dev/shm/kvxfer-store"
DEFAULT_CAPACITY = 4 << 30


class ShmDriver(BlobDriver):
    name = "memory"

    def __init__(self, path: str | os.PathLike[str] = DEFAULT_PATH, capacity_bytes: int = DEFAULT_CAPACITY) -> None:
        self.path = Path(path)
        self.capacity_bytes = capacity_bytes
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            probe = self.path / f".probe-{secrets.token_hex(4)}"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as exc:
            raise StoreError(f"store directory {self.path}: {exc.strerror or exc}") from None
        self._closed = False

    def _file(self, key: bytes) -> Path:
        return self.path / key.hex()

    def _used(self) -> int:
        try:
            return sum(_size(e) for e in os.scandir(self.path) if e.is_file())
        except OSError as exc:
            raise StoreError(f"store directory {self.path}: {exc.strerror or exc}") from None

    def _check(self) -> None:
        if self._closed:
            raise StoreError(f"the store driver for {self.path} is closed")

    def register(self, span: Span) -> None:
        self._check()

    def unregister(self, span: Span) -> None:
        return None

    def put(self, keys: Sequence[bytes], addresses: IndexArray, sizes: IndexArray) -> list[KeyStatus]:
        self._check()
        used = self._used()
        out = []
        for key, address, size in zip(keys, addresses.tolist(), sizes.tolist(), strict=True):
            target = self._file(key)
            old = _size(target)
            if used - old + size > self.capacity_bytes:
                out.append(KeyStatus.FULL)
                continue
            tmp = self.path / f".{key.hex()}.{secrets.token_hex(4)}"
            try:
                with open(tmp, "wb") as f:
                    f.write(ctypes.string_at(address, size))
                os.replace(tmp, target)
            except OSError as exc:
                tmp.unlink(missing_ok=True)
                out.append(KeyStatus.FULL if exc.errno == errno.ENOSPC else KeyStatus.FAILED)
                continue
            used += size - old
            out.append(KeyStatus.OK)
        return out

    def get(self, keys: Sequence[bytes], addresses: IndexArray, sizes: IndexArray) -> list[KeyStatus]:
        self._check()
        out = []
        for key, address, size in zip(keys, addresses.tolist(), sizes.tolist(), strict=True):
            try:
                with open(self._file(key), "rb") as f:
                    if os.fstat(f.fileno()).st_size != size:
                        out.append(KeyStatus.WRONG_SIZE)
                        continue
                    buffer = (ctypes.c_char * size).from_address(address)
                    got = f.readinto(memoryview(buffer).cast("B"))
            except FileNotFoundError:
                out.append(KeyStatus.MISSING)
                continue
            except OSError:
                out.append(KeyStatus.FAILED)
                continue
            out.append(KeyStatus.OK if got == size else KeyStatus.FAILED)
        return out

    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        self._check()
        return [self._file(k).exists() for k in keys]

    def remove(self, keys: Sequence[bytes]) -> list[KeyStatus]:
        self._check()
        out = []
        for key in keys:
            try:
                self._file(key).unlink()
                out.append(KeyStatus.OK)
            except FileNotFoundError:
                out.append(KeyStatus.MISSING)
        return out

    def close(self) -> None:
        self._closed = True


def _size(entry: os.DirEntry[str] | Path) -> int:
    """The file's size, 0 once it is gone: another process may remove or replace it between
    a listing (or an exists()) and the stat."""
    try:
        return entry.stat().st_size
    except FileNotFoundError:
        return 0
