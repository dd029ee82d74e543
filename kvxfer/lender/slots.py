"""Staging slots of one region: contiguous runs granted first-fit, quarantined while a copy
of unknown end may still touch them."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class SlotStats:
    capacity: int
    free: int
    quarantined: int
    largest_run: int


class SlotRuns:
    """``capacity`` slots; a grant is one contiguous run. Quarantined slots return only by
    ``unquarantine``, once nothing can touch them."""

    def __init__(self, name: str, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError(f"staging region {name!r}: capacity must be positive, got {capacity}")
        self.name = name
        self.capacity = capacity
        self._free = np.ones(capacity, dtype=np.bool_)
        self._quarantined = np.zeros(capacity, dtype=np.bool_)

    def _runs(self) -> tuple[np.ndarray, np.ndarray]:
        edges = np.diff(np.concatenate(([0], self._free.view(np.int8), [0])).astype(np.int8))
        starts = np.flatnonzero(edges == 1)
        ends = np.flatnonzero(edges == -1)
        return starts, ends - starts

    def find(self, n: int) -> int | None:
        """Start of the first free run of ``n`` slots, or None (``n == 0`` always fits)."""
        if n == 0:
            return 0
        starts, lengths = self._runs()
        fit = np.flatnonzero(lengths >= n)
        return int(starts[fit[0]]) if fit.size else None

    def usable_run(self) -> int:
        """The longest run of slots not quarantined: the most one lease can ever be granted."""
        edges = np.diff(np.concatenate(([0], (~self._quarantined).view(np.int8), [0])).astype(np.int8))
        lengths = np.flatnonzero(edges == -1) - np.flatnonzero(edges == 1)
        return int(lengths.max()) if lengths.size else 0

    def take(self, start: int, n: int) -> None:
        if not self._free[start: start + n].all():
            raise AssertionError(f"staging region {self.name!r}: slots [{start}, {start + n}) are not free")
        self._free[start: start + n] = False

    def give(self, start: int, n: int) -> None:
        run = slice(start, start + n)
        self._free[run] = ~self._quarantined[run]

    def quarantine(self, start: int, n: int) -> None:
        """These slots may still be accessed by a copy we cannot account for: never reuse."""
        self._quarantined[start: start + n] = True
        self._free[start: start + n] = False

    def unquarantine(self, start: int, n: int, granted: bool) -> None:
        """Nothing can touch these slots any more: free again, or (``granted``: a lease still
        holds them) free once that lease gives them back."""
        run = slice(start, start + n)
        self._quarantined[run] = False
        if not granted:
            self._free[run] = True

    def stats(self) -> SlotStats:
        _, lengths = self._runs()
        return SlotStats(self.capacity, int(self._free.sum()), int(self._quarantined.sum()),
                         int(lengths.max()) if lengths.size else 0)
