"""InPlaceLender: lends the pool's own pages. Rows are registered where they live.

Regions are the pool's tensors (DEVICE on CUDA, HOST on CPU), so a backend moves bytes
straight between pools. Views are ready at once; arrival counts as soon as it is marked.
"""

from __future__ import annotations

import numpy as np

from kvxfer.contract import SlotRegion
from kvxfer.lender.base import Lease, Lender
from kvxfer.pool import PagedKVPool


class InPlaceLender(Lender):
    """Leases over the pool's pages; leased blocks are pinned against free, eviction, reuse."""

    def __init__(self, pool: PagedKVPool) -> None:
        super().__init__(pool)
        self._regions = pool.slot_regions()
        self._by_name = dict(zip((r.name for r in pool.row_regions()), self._regions))

    @property
    def regions(self) -> tuple[SlotRegion, ...]:
        return self._regions

    def _make_view(self, lease: Lease) -> None:
        regions = [self._by_name[part.region.name] for part in lease._parts]
        lease._view = self._rows_view(lease, regions, [part.blocks for part in lease._parts])

    def _arrive(self, lease: Lease, rows: dict[str, np.ndarray]) -> None:
        for group, idx in rows.items():
            self._record(lease, group, idx)
