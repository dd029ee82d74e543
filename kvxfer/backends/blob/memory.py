"""An in-memory blob store in this process: for tests, examples, and one-process set-ups.

It keeps copies of the bytes (a put reads the caller's memory, a get writes into it), holds
at most ``capacity_bytes``, and can be told to misbehave the ways a real store does: lose
keys, fail every key after the first ``n`` of a get, be slow, or refuse everything as a dead
store does. Several backends may share one instance (the two ends of a test).
"""

from __future__ import annotations

import ctypes
import threading
import time
from collections.abc import Iterable, Sequence

from kvxfer.backends.blob.digests import DIGEST_SUFFIX
from kvxfer.backends.blob.driver import BlobDriver, KeyStatus, Span, StoreError
from kvxfer.contract import IndexArray


class MemoryStore:
    """The blobs; drivers of one store see the same keys. ``lose(keys)`` drops blobs as an
    eviction or a lost holder does."""

    def __init__(self, capacity_bytes: int = 1 << 30) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.blobs: dict[bytes, bytes] = {}
        self.used = 0
        self.lock = threading.Lock()
        # Faults (tests): a pause per batch, and a store that is down (every key fails).
        self.delay_s = 0.0
        self.down = False
        self.puts = 0
        self.gets = 0

    def lose(self, keys: Iterable[bytes]) -> None:
        with self.lock:
            for key in keys:
                self.used -= len(self.blobs.pop(key, b""))


class MemoryDriver(BlobDriver):
    name = "memory"

    def __init__(self, store: MemoryStore | None = None) -> None:
        self.store = store if store is not None else MemoryStore()
        self._closed = False
        # Fault (tests): row keys this driver handles before every later one fails. A row's digest
        # key (BlobBackend's integrity) neither counts nor fails, so the count is of rows.
        self.fail_after: int | None = None
        self._handled = 0

    def _faulty(self, key: bytes) -> bool:
        if self.store.down:
            return True
        if key.endswith(DIGEST_SUFFIX):
            return False
        self._handled += 1
        return self.fail_after is not None and self._handled > self.fail_after

    def _check(self) -> None:
        if self._closed:
            raise StoreError("the memory store's driver is closed")
        if self.store.delay_s:
            time.sleep(self.store.delay_s)

    def register(self, span: Span) -> None:
        self._check()

    def unregister(self, span: Span) -> None:
        return None

    def put(self, keys: Sequence[bytes], addresses: IndexArray, sizes: IndexArray) -> list[KeyStatus]:
        self._check()
        s = self.store
        out = []
        for key, address, size in zip(keys, addresses.tolist(), sizes.tolist(), strict=True):
            if self._faulty(key):
                out.append(KeyStatus.FAILED)
                continue
            data = ctypes.string_at(address, size)
            with s.lock:
                old = len(s.blobs.get(key, b""))
                if s.used - old + size > s.capacity_bytes:
                    out.append(KeyStatus.FULL)
                    continue
                s.blobs[key] = data
                s.used += size - old
                s.puts += 1
            out.append(KeyStatus.OK)
        return out

    def get(self, keys: Sequence[bytes], addresses: IndexArray, sizes: IndexArray) -> list[KeyStatus]:
        self._check()
        s = self.store
        out = []
        for key, address, size in zip(keys, addresses.tolist(), sizes.tolist(), strict=True):
            if self._faulty(key):
                out.append(KeyStatus.FAILED)
                continue
            with s.lock:
                data = s.blobs.get(key)
            if data is None:
                out.append(KeyStatus.MISSING)
            elif len(data) != size:
                out.append(KeyStatus.WRONG_SIZE)
            else:
                ctypes.memmove(address, data, size)
                with s.lock:
                    s.gets += 1
                out.append(KeyStatus.OK)
        return out

    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        self._check()
        with self.store.lock:
            return [not self.store.down and k in self.store.blobs for k in keys]

    def remove(self, keys: Sequence[bytes]) -> list[KeyStatus]:
        self._check()
        out = []
        with self.store.lock:
            for key in keys:
                data = self.store.blobs.pop(key, None)
                if data is None:
                    out.append(KeyStatus.MISSING)
                else:
                    self.store.used -= len(data)
                    out.append(KeyStatus.OK)
        return out

    def close(self) -> None:
        self._closed = True
