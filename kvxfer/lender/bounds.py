"""ResumeBounds, and how a request's filled blocks turn into them.

A fetched request may resume decoding at ``p`` only if every group holds what position
``p`` needs: full attention needs every token of ``[0, p)``; a sliding-window group needs
``[p - window, p)`` and its sink blocks; a STATE group needs its state to be exactly at
``p``. Arrival counts only up to the first missing ordinal of a run. Each group gives an
interval of positions; the request's bounds are their intersection (the most restrictive),
and an empty intersection means recompute from 0: ``ResumeBounds(0, 0)``. A window group
with several valid runs offers only its latest run able to serve (a deliberate
simplification: an earlier run could in principle meet a tighter bound of another group).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvxfer.contract import CacheKind
from kvxfer.pool import LayerGroupSpec


@dataclass(frozen=True)
class ResumeBounds:
    """Resume at any ``p`` with ``restart_floor <= p <= usable_until``; (0, 0) = from scratch."""

    usable_until: int
    restart_floor: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.restart_floor <= self.usable_until:
            raise ValueError(f"ResumeBounds needs 0 <= restart_floor <= usable_until, got "
                             f"floor {self.restart_floor}, usable {self.usable_until}")

    def allows(self, position: int) -> bool:
        return self.restart_floor <= position <= self.usable_until


def group_interval(spec: LayerGroupSpec, filled: np.ndarray) -> tuple[int, int]:
    """(floor, usable) positions one group supports, given ``filled`` per ordinal."""
    if spec.kind is CacheKind.STATE:
        at = int(filled[0]) if filled.size else -1
        return (at, at) if at >= 0 else (0, 0)
    if filled.size == 0:
        return 0, 0
    bt = spec.block_tokens
    starts = np.arange(filled.size, dtype=np.int64) * bt
    full = filled >= starts + bt
    nonempty = filled > starts
    # A block continues the previous block's run if that one is full and this one holds data.
    cont = np.zeros(filled.size, dtype=np.bool_)
    cont[1:] = full[:-1] & nonempty[1:]
    run_first = np.flatnonzero(nonempty & ~cont)
    if run_first.size == 0:
        return 0, 0
    # Each run ends at the first block of it that is not full (or the last nonempty block).
    # (An empty block that breaks a run is itself not full: its ``filled`` is the run's end.)
    not_full = np.append(np.flatnonzero(~full), filled.size - 1)
    run_end = filled[not_full[np.searchsorted(not_full, run_first)]]
    run_start = starts[run_first]
    prefix_end = int(run_end[0]) if run_start[0] == 0 else 0
    if spec.window is None:
        return 0, prefix_end
    window = spec.window
    sinks_ok = prefix_end >= min(spec.sink_blocks * bt, int(filled.size) * bt)
    # Latest run able to hold a full window (or the prefix run, which needs none); one
    # numpy pass, as a request with gaps may have as many runs as rows.
    serves = np.flatnonzero((run_start == 0) | ((run_end - run_start >= window) & sinks_ok))
    if serves.size == 0:
        return 0, 0
    a, e = int(run_start[serves[-1]]), int(run_end[serves[-1]])
    return (0, e) if a == 0 else (a + window, e)


def resume_bounds(specs: tuple[LayerGroupSpec, ...], filled: dict[str, np.ndarray]) -> ResumeBounds:
    floor, usable = 0, None
    for spec in specs:
        f, u = group_interval(spec, filled[spec.name])
        floor = max(floor, f)
        usable = u if usable is None else min(usable, u)
    usable = usable or 0
    if floor > usable:
        return ResumeBounds(0, 0)
    return ResumeBounds(usable, floor)
