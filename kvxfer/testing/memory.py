"""Row memory the conformance kit can fill and read back, by region name and slots."""

from __future__ import annotations

import abc
from collections.abc import Iterable
from typing import Any

import numpy as np
import numpy.typing as npt

from kvxfer.contract import MemoryKind, SlotRegion

# Memory that an unquiesced attempt may still read or write: never freed in this process.
_RETAINED: list[object] = []


def retain_if_unquiesced(unquiesced: object, *memories: object) -> None:
    """Keep ``memories`` for the life of the process when ``unquiesced`` (what a backend's
    shutdown() returned, or any truthy count of it) says an attempt may still touch them.

    Why: a backend registers addresses, not objects; rows freed under a request that still
    runs are soon handed out again, and its late bytes then land in someone else's memory
    (CI once saw a push concluded Delivered with wrong bytes when a test's helper let the
    publisher's rows go while its progress thread still read them)."""
    if unquiesced:
        _RETAINED.extend(memories)


def shut_down_keeping(backends: Iterable[Any], memories: list[Any]) -> list[frozenset[Any]]:
    """Shut ``backends`` down, then let ``memories`` (what they registered) go, unless an
    attempt was left unquiesced or a shutdown raised: then they are retained for good.
    ``memories`` is emptied either way; what each shutdown() returned comes back."""
    left: list[frozenset[Any]] | None = None
    try:
        left = [b.shutdown() for b in backends]
    finally:
        retain_if_unquiesced(left is None or any(left), *memories)
        memories.clear()
    return left


class RowMemory(abc.ABC):
    """Read and write whole rows of registered regions."""

    @abc.abstractmethod
    def write(self, region: str, slots: npt.NDArray[np.int64], data: bytes) -> None: ...

    @abc.abstractmethod
    def read(self, region: str, slots: npt.NDArray[np.int64]) -> bytes: ...


class HostBuffer:
    """A host allocation cut into slots, with the SlotRegion that describes it."""

    def __init__(self, name: str, slot_bytes: int, slots: int) -> None:
        self.array = np.zeros((slots, slot_bytes), dtype=np.uint8)
        self.region = SlotRegion(name, int(self.array.ctypes.data), slot_bytes, slots, MemoryKind.HOST)


class HostRows(RowMemory):
    """RowMemory over HostBuffers (numpy arrays kept alive here)."""

    def __init__(self, buffers: Iterable[HostBuffer]) -> None:
        self.buffers = {b.region.name: b for b in buffers}

    @property
    def regions(self) -> tuple[SlotRegion, ...]:
        return tuple(b.region for b in self.buffers.values())

    def write(self, region: str, slots: npt.NDArray[np.int64], data: bytes) -> None:
        buf = self.buffers[region].array
        buf[np.asarray(slots, dtype=np.int64)] = np.frombuffer(data, dtype=np.uint8).reshape(-1, buf.shape[1])

    def read(self, region: str, slots: npt.NDArray[np.int64]) -> bytes:
        return self.buffers[region].array[np.asarray(slots, dtype=np.int64)].tobytes()
