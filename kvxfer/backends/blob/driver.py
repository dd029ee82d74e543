"""The blob store driver boundary: what ``BlobBackend`` asks of a content-addressed store.

A store keeps opaque byte strings (blobs) under opaque keys. The backend hands a driver
batches: many keys, each with the address and size of caller memory to read from (put) or
write into (get), as int64 arrays (a batch is built without a Python object per row). A driver answers per key, never for the batch as a whole, so that a
fetch marks exactly the rows that arrived. Memory given to a batch is the caller's until
the call returns; a driver that copies asynchronously must have finished by then.

Zero copy: ``register`` tells the driver which spans of caller memory its batches will
name, so a store that can move bytes straight from and into registered memory does (Mooncake
registers the buffer with its transfer engine); a driver that cannot ignores it.

Drivers here: ``MemoryDriver`` (``kvxfer.backends.blob.memory``: in this process, for tests
and examples, with fault injection) and ``MooncakeDriver`` (``kvxfer.backends.blob.mooncake``:
a real Mooncake Store).
"""

from __future__ import annotations

import abc
import enum
from collections.abc import Sequence
from dataclasses import dataclass

from kvxfer.contract import IndexArray, KvxferError


class KeyStatus(enum.Enum):
    """What became of one key of a batch."""

    OK = "ok"              # put: the blob is stored whole; get: the blob's bytes are in the caller's memory
    MISSING = "missing"    # get: no blob under the key (never put, removed, evicted, or its holder gone)
    WRONG_SIZE = "wrong_size"  # get: the blob is not the size of the memory given for it (nothing was written)
    FULL = "full"          # put: the store has no room for it (nothing was stored)
    FAILED = "failed"      # anything else: the store or its connection failed for this key


@dataclass(frozen=True)
class Span:
    """``size`` bytes of caller memory at ``address`` (host memory, or device memory where
    the driver says it reaches it)."""

    address: int
    size: int


class StoreError(KvxferError):
    """The store cannot be used at all (cannot connect, refused the set-up, closed)."""


class BlobDriver(abc.ABC):
    """One connection to a blob store. Its methods are called from one thread at a time."""

    name: str  # how errors and metrics name the store: "memory", "mooncake"

    @abc.abstractmethod
    def register(self, span: Span) -> None:
        """Memory that later batches will name (see the module doc); StoreError if refused."""

    @abc.abstractmethod
    def unregister(self, span: Span) -> None: ...

    @abc.abstractmethod
    def put(self, keys: Sequence[bytes], addresses: IndexArray, sizes: IndexArray) -> list[KeyStatus]:
        """Store the ``sizes[i]`` bytes at ``addresses[i]`` under ``keys[i]``. A key that
        holds a blob: the memory and shm drivers replace it (a get sees the old or the new
        blob, never neither), and so does Mooncake's unless made with ``keep_stored``: then it
        keeps the blob and answers OK (see ``mooncake.py``)."""

    @abc.abstractmethod
    def get(self, keys: Sequence[bytes], addresses: IndexArray, sizes: IndexArray) -> list[KeyStatus]:
        """Copy the blob under ``keys[i]`` to ``addresses[i]``: OK only when the blob is
        exactly ``sizes[i]`` bytes and all of them were written."""

    @abc.abstractmethod
    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        """Which keys hold a blob now (it may be gone by the next call)."""

    @abc.abstractmethod
    def remove(self, keys: Sequence[bytes]) -> list[KeyStatus]:
        """Drop the blobs (OK, or MISSING for a key that held none)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release the connection; idempotent. Blobs this client holds may go with it
        (Mooncake keeps data in the segment of the client that put it)."""
