"""Corrupting rows on purpose: fault injection for the integrity checks
(``kvxfer.backends.common.integrity``).

``Corruptor`` is a backend's ``corrupt_landed`` hook: called with rows that just landed, before
the fetcher checks them, it flips one random bit of some and rewrites others whole, and
remembers exactly which rows it changed, so a test can require that those and only those are
reported False. ``kvxfer serve --inject-corruption P`` (and ``kvxfer pair``'s) gives a worker's
backends one, to show that a request whose rows were damaged is recomputed, token for token.
"""

from __future__ import annotations

import ctypes
import threading

import numpy as np
import numpy.typing as npt

from kvxfer import native
from kvxfer.contract import IndexArray, MemoryKind, SlotRegion


def row_bytes(region: SlotRegion, slot: int) -> npt.NDArray[np.uint8]:
    """A writable numpy view of one slot of a host region."""
    if not 0 <= slot < region.slots:
        raise IndexError(f"slot {slot} outside region {region.name!r} of {region.slots} slots")
    buf = (ctypes.c_uint8 * region.slot_bytes).from_address(region.address + slot * region.slot_bytes)
    return np.ctypeslib.as_array(buf)


def _load(region: SlotRegion, slot: int) -> npt.NDArray[np.uint8]:
    """One slot's bytes: a writable view in place (host memory) or a host copy (device memory,
    written back by ``_store``)."""
    if region.memory_kind is not MemoryKind.DEVICE:
        return row_bytes(region, slot)
    if not 0 <= slot < region.slots:
        raise IndexError(f"slot {slot} outside region {region.name!r} of {region.slots} slots")
    out = np.empty(region.slot_bytes, dtype=np.uint8)
    native.cuda_module().copy_bytes(region.device_id, out.ctypes.data, region.address + slot * region.slot_bytes,
                                    region.slot_bytes)
    return out


def _store(region: SlotRegion, slot: int, row: npt.NDArray[np.uint8]) -> None:
    if region.memory_kind is MemoryKind.DEVICE:
        native.cuda_module().copy_bytes(region.device_id, region.address + slot * region.slot_bytes,
                                        row.ctypes.data, region.slot_bytes)


def flip_bit(region: SlotRegion, slot: int, bit: int) -> None:
    """Flip bit ``bit`` (0 .. 8 * slot_bytes - 1) of one slot (host or device memory)."""
    row = _load(region, slot)
    row[bit // 8] ^= np.uint8(1 << (bit % 8))
    _store(region, slot, row)


def reverse_row(region: SlotRegion, slot: int) -> bool:
    """Reverse one slot's bytes (host or device memory); False when that changed nothing (a
    palindrome)."""
    row = _load(region, slot)
    before = row.copy()
    row[:] = before[::-1]
    _store(region, slot, row)
    return not np.array_equal(before, row)


class Corruptor:
    """Changes each landed row (host or device memory) with probability ``p_bit`` (one random bit flipped) or
    ``p_row`` (the whole row rewritten: reversed, or random bytes when reversing changes
    nothing). ``changed`` holds (region name, slot) of every row it changed; ``rows_seen`` counts
    the rows it was shown."""

    def __init__(self, seed: int, *, p_bit: float = 0.0, p_row: float = 0.0) -> None:
        self._rng = np.random.default_rng(seed)
        self.p_bit = p_bit
        self.p_row = p_row
        self.changed: set[tuple[str, int]] = set()
        self.rows_seen = 0
        self._lock = threading.Lock()

    def __call__(self, region: SlotRegion, slots: IndexArray) -> None:
        with self._lock:
            self.rows_seen += int(slots.size)
            draw = self._rng.random(slots.size)
            for slot in np.asarray(slots)[draw < self.p_bit + self.p_row].tolist():
                if self._rng.random() * (self.p_bit + self.p_row) < self.p_bit:
                    flip_bit(region, slot, int(self._rng.integers(0, 8 * region.slot_bytes)))
                elif not reverse_row(region, slot):
                    row = _load(region, slot)
                    fresh = self._rng.integers(0, 256, size=row.size, dtype=np.uint8)
                    if np.array_equal(fresh, row):
                        fresh[0] ^= 1
                    row[:] = fresh
                    _store(region, slot, row)
                self.changed.add((region.name, int(slot)))

    def pick(self, region: str, slots: IndexArray) -> np.ndarray:
        """Which of these rows (of region ``region``) to damage, for a mover that damages them
        itself as they land (the IPC copy kernel flips one bit of each, before its check):
        each with probability ``p_bit + p_row``, remembered in ``changed``."""
        with self._lock:
            self.rows_seen += int(slots.size)
            chosen = self._rng.random(slots.size) < self.p_bit + self.p_row
            self.changed.update((region, int(s)) for s in np.asarray(slots)[chosen].tolist())
            return chosen

    def take(self) -> set[tuple[str, int]]:
        """The rows changed since the last take."""
        with self._lock:
            out, self.changed = self.changed, set()
            return out
