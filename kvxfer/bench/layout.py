"""Where rows live in a bench run: slot choices, buffers, and layer-major descriptor maths.

Scattered rows are a random permutation of distinct slots drawn from a pool ``pool_factor``
times larger than the request, independently on each end, so that almost no two
consecutive rows are adjacent on both ends: the worst case for coalescing, which is what
a long-lived paged pool looks like. Contiguous rows are slots ``0..n-1`` on both ends.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from kvxfer.bench.config import Point

I64 = npt.NDArray[np.int64]


def pool_slots(point: Point, pool_factor: int) -> int:
    """Slots each group's region needs on one end for ``point``."""
    return point.rows * (pool_factor if point.slots == "scattered" else 1)


def choose_slots(point: Point, pool_factor: int, rng: np.random.Generator) -> I64:
    """The slots of one group on one end, in row order."""
    if point.slots == "contiguous":
        return np.arange(point.rows, dtype=np.int64)
    return rng.choice(pool_slots(point, pool_factor), size=point.rows, replace=False).astype(np.int64)


def row_addresses(base: int, group_bytes: int, row_bytes: int, slots_by_group: list[I64]) -> I64:
    """Byte addresses of every row when group g's region starts at ``base + g * group_bytes``."""
    return np.concatenate([base + g * group_bytes + s * row_bytes for g, s in enumerate(slots_by_group)]).astype(
        np.int64
    )


def layer_major_addresses(base: int, group_bytes: int, row_bytes: int, layers: int,
                          slots_by_group: list[I64]) -> tuple[I64, int]:
    """Addresses of the pieces that a layer-major pool ("peer practice") posts for the same rows.

    A layer-major pool keeps one region per layer and per K/V: a block's row of
    ``row_bytes`` is ``2 * layers`` pieces of ``row_bytes // (2 * layers)`` bytes, and each
    piece lives in its own region at the block's slot. Returns (addresses, piece bytes).
    """
    parts = 2 * layers
    if row_bytes % parts:
        raise ValueError(f"row of {row_bytes} bytes does not split into {parts} equal layer pieces")
    piece = row_bytes // parts
    out = []
    for g, slots in enumerate(slots_by_group):
        # Region p of group g spans (pool slots x piece bytes); the group's span is group_bytes.
        pool = group_bytes // row_bytes
        region_base = base + g * group_bytes + np.arange(parts, dtype=np.int64)[:, None] * (pool * piece)
        out.append((region_base + slots[None, :] * piece).reshape(-1))
    return np.concatenate(out).astype(np.int64), piece
