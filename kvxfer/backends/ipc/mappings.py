"""Peers' device allocations mapped into this process through CUDA IPC handles.

A handle is opened once and cached (CUDA refuses to open one handle twice in a process,
and opening costs far more than a copy). A mapping counts the submissions that use it; it
is closed only when none does: when its peer is gone, or at shutdown. A dead peer's
mapping is marked so that no new copy is launched into it, and is closed once the copies
already queued on it have completed (the backend releases them after their event).
All of this runs on the backend's progress thread. The same bookkeeping serves the peer's
doorbell ring (``doorbells``), opened by a different ``Opener``.
"""

from __future__ import annotations

import logging
import struct
from dataclasses import dataclass
from types import ModuleType
from typing import Protocol

log = logging.getLogger(__name__)

EXTRA_PREFIX = "ipc.region."
_EXPORT = struct.Struct("<64sQQ")  # handle, allocation base, allocation size (exporter's addresses)


@dataclass(frozen=True)
class Export:
    """What a peer needs to map one of our regions: the allocation that holds it."""

    handle: bytes
    alloc_base: int
    alloc_size: int

    def pack(self) -> bytes:
        return _EXPORT.pack(self.handle, self.alloc_base, self.alloc_size)

    @staticmethod
    def unpack(data: bytes, region: str) -> Export:
        if len(data) != _EXPORT.size:
            raise ValueError(f"IPC export of region {region!r} is {len(data)} bytes, expected {_EXPORT.size}")
        handle, base, size = _EXPORT.unpack(data)
        return Export(handle, base, size)


class Opener(Protocol):
    """How one kind of peer memory is mapped into this process, and unmapped."""

    def open(self, export: Export) -> int: ...  # its base here; raises the native CopyError
    def close(self, base: int) -> None: ...


class IpcOpener:
    """A peer's device allocation, through its CUDA IPC handle."""

    def __init__(self, native: ModuleType, device: int) -> None:
        self._native = native
        self._device = device

    def open(self, export: Export) -> int:
        return int(self._native.ipc_open(self._device, export.handle))

    def close(self, base: int) -> None:
        self._native.ipc_close(self._device, base)


@dataclass(eq=False)
class Mapping:
    export: Export
    peer: bytes
    base: int  # the allocation's base in this process
    opener: Opener
    users: int = 0
    dead: bool = False
    closed: bool = False

    def translate(self, peer_address: int, nbytes: int) -> int | None:
        """Our address of the peer's ``[peer_address, +nbytes)``, or None if outside the allocation."""
        offset = peer_address - self.export.alloc_base
        if offset < 0 or offset + nbytes > self.export.alloc_size:
            return None
        return self.base + offset


class Mappings:
    """Open mappings by handle; reference counts; close after quiescence."""

    def __init__(self, native: ModuleType, device: int) -> None:
        self._native = native
        self._ipc = IpcOpener(native, device)
        self._by_handle: dict[bytes, Mapping] = {}

    def acquire(self, peer: bytes, export: Export, opener: Opener | None = None) -> Mapping:
        """The mapping of ``export`` (opened now if needed, by ``opener``: a CUDA IPC handle
        by default), with one more user. Raises the native CopyError when it cannot be opened."""
        mapping = self._by_handle.get(export.handle)
        if mapping is not None and mapping.dead:
            raise RuntimeError(f"peer {peer!r} is gone; its mapping closes once the copies in flight end")
        if mapping is None:
            opener = opener or self._ipc
            base = opener.open(export)
            mapping = Mapping(export, peer, base, opener)
            self._by_handle[export.handle] = mapping
        mapping.users += 1
        return mapping

    def release(self, mapping: Mapping) -> None:
        mapping.users -= 1
        if mapping.dead and mapping.users == 0:
            self._close(mapping)

    def peer_gone(self, peer: bytes) -> None:
        """Stop using the peer's mappings; close those with no copy in flight."""
        for mapping in list(self._by_handle.values()):
            if mapping.peer == peer and not mapping.dead:
                mapping.dead = True
                if mapping.users == 0:
                    self._close(mapping)

    def in_use(self) -> int:
        return sum(m.users for m in self._by_handle.values())

    def close_all(self) -> int:
        """Close every mapping no copy uses; return how many are still in use (left open)."""
        left = 0
        for mapping in list(self._by_handle.values()):
            if mapping.users:
                left += 1
            else:
                self._close(mapping)
        return left

    def __len__(self) -> int:
        return len(self._by_handle)

    def _close(self, mapping: Mapping) -> None:
        if mapping.closed:
            return
        mapping.closed = True
        if self._by_handle.get(mapping.export.handle) is mapping:
            del self._by_handle[mapping.export.handle]
        try:
            mapping.opener.close(mapping.base)
        except (self._native.CopyError, OSError) as exc:
            log.warning("closing the IPC mapping of peer %r failed: %s", mapping.peer, exc)
