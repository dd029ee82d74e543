"""Where a region lies, and the registered span of memory that rows live in."""

from __future__ import annotations

import enum
from dataclasses import dataclass

_ADDRESS_LIMIT = 1 << 64


class MemoryKind(enum.Enum):
    """HOST is CPU-addressable memory; DEVICE is the GPU memory that holds the cache."""

    HOST = "host"
    DEVICE = "device"


@dataclass(frozen=True)
class SlotRegion:
    """A registered span of memory cut into ``slots`` equal slots of ``slot_bytes`` each.

    One row occupies exactly one slot. ``address`` is the span's base as an integer.
    """

    name: str
    address: int
    slot_bytes: int
    slots: int
    memory_kind: MemoryKind
    device_id: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"SlotRegion.name must be a non-empty str, got {self.name!r}")
        for field in ("address", "slot_bytes", "slots", "device_id"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"SlotRegion.{field} must be an int, got {type(value).__name__}")
        if self.address < 0:
            raise ValueError(f"SlotRegion {self.name!r}: address {self.address} is negative")
        if self.slot_bytes <= 0:
            raise ValueError(f"SlotRegion {self.name!r}: slot_bytes must be positive, got {self.slot_bytes}")
        if self.slots <= 0:
            raise ValueError(f"SlotRegion {self.name!r}: slots must be positive, got {self.slots}")
        if self.device_id < 0:
            raise ValueError(f"SlotRegion {self.name!r}: device_id {self.device_id} is negative")
        if not isinstance(self.memory_kind, MemoryKind):
            raise TypeError(
                f"SlotRegion {self.name!r}: memory_kind must be a MemoryKind, got {self.memory_kind!r}"
            )
        if self.address + self.nbytes > _ADDRESS_LIMIT:
            raise ValueError(
                f"SlotRegion {self.name!r}: address {self.address:#x} + {self.nbytes} bytes overflows 64 bits"
            )

    @property
    def nbytes(self) -> int:
        return self.slot_bytes * self.slots

    @property
    def end(self) -> int:
        return self.address + self.nbytes

    def overlaps(self, other: SlotRegion) -> bool:
        """True when both regions share at least one byte of the same memory space."""
        if self.memory_kind != other.memory_kind:
            return False
        if self.memory_kind is MemoryKind.DEVICE and self.device_id != other.device_id:
            return False
        return self.address < other.end and other.address < self.end
