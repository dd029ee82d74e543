"""The regions a backend has registered, and the checks every submission passes first."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from kvxfer.contract import InvalidSubmission, LayerGroupRows, LayoutMismatch, MemoryKind, SlotRegion, View
from kvxfer.contract.arrays import all_distinct


class RegionTable:
    """Registered regions by name. Refuses unreachable memory kinds and overlaps."""

    def __init__(self, reachable: frozenset[MemoryKind]) -> None:
        self._reachable = reachable
        self._regions: dict[str, SlotRegion] = {}

    def reachable(self, regions: Iterable[SlotRegion]) -> tuple[list[SlotRegion], tuple[SlotRegion, ...]]:
        """The regions of a memory kind this backend reaches, and those it does not (which
        register() skips and returns, as the contract says)."""
        batch = list(regions)
        for region in batch:
            if not isinstance(region, SlotRegion):
                raise TypeError(f"register() takes SlotRegion items, got {type(region).__name__}")
        return ([r for r in batch if r.memory_kind in self._reachable],
                tuple(r for r in batch if r.memory_kind not in self._reachable))

    def add(self, regions: Iterable[SlotRegion]) -> list[SlotRegion]:
        """Validate all, then add all: a refused batch registers nothing. Pass only regions
        of reachable kinds (``reachable``); any other is refused here."""
        batch = list(regions)
        for i, region in enumerate(batch):
            if not isinstance(region, SlotRegion):
                raise TypeError(f"register() takes SlotRegion items, got {type(region).__name__}")
            if region.memory_kind not in self._reachable:
                raise InvalidSubmission(
                    f"region {region.name!r} is {region.memory_kind.name} memory, which this backend cannot reach"
                )
            if region.name in self._regions and self._regions[region.name] != region:
                raise InvalidSubmission(f"region name {region.name!r} is already registered with another span")
            for other in list(self._regions.values()) + batch[:i]:
                if other.name != region.name and region.overlaps(other):
                    raise InvalidSubmission(f"region {region.name!r} overlaps registered region {other.name!r}")
        added = [r for r in batch if r.name not in self._regions]
        for region in added:
            self._regions[region.name] = region
        return added

    def get(self, name: str) -> SlotRegion | None:
        return self._regions.get(name)

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(self._regions.values())

    def __len__(self) -> int:
        return len(self._regions)

    def _check_geometry(self, view: View) -> None:
        """An engine view's memory is its geometry's regions, all registered, and its block
        ids lie within the geometry's blocks."""
        geometry = view.geometry
        assert geometry is not None
        for region in geometry.regions:
            registered = self._regions.get(region.name)
            if registered is None or registered != region:
                raise InvalidSubmission(f"the view's KV lies in region {region.name!r}, which is not registered")
        span = view.groups[0].slot_bounds
        if span is not None and (span[0] < 0 or span[1] >= geometry.blocks):
            bad = span[0] if span[0] < 0 else span[1]
            raise LayoutMismatch(f"the view names block {bad}, outside the {geometry.blocks} blocks of its tensors")

    def check_view(self, view: View, *, for_fetch: bool) -> None:
        """Raise InvalidSubmission for rows in no registered region, out of range, with
        repeated ordinals, or (for a fetch, whose rows are written, and for describe(), whose
        hint may expose them to a write) overlapping rows."""
        if not isinstance(view, View):
            raise InvalidSubmission(f"expected a View, got {type(view).__name__}")
        if view.geometry is not None:
            self._check_geometry(view)
        for group in view.groups:
            registered = self._regions.get(group.region.name)
            # Usually the very object registered (a lender makes its regions once): no field compare.
            if registered is None or (registered is not group.region and registered != group.region):
                raise InvalidSubmission(
                    f"group {group.layer_group!r} rows lie in region {group.region.name!r}, which is not registered"
                )
            span = group.slot_bounds  # cached on the group: describe() then publish() pay once
            if span is None:
                continue
            low, high = span
            if low < 0 or high >= registered.slots:
                raise InvalidSubmission(
                    f"group {group.layer_group!r}: slot {low if low < 0 else high} is outside "
                    f"region {registered.name!r} of {registered.slots} slots"
                )
            if not group.ordinals_distinct:
                raise InvalidSubmission(f"group {group.layer_group!r} repeats an ordinal")
        if for_fetch:
            # Rows of one region are equal slots, and registered regions never overlap, so
            # two rows overlap exactly when they name the same slot of the same region.
            by_region: dict[str, list[LayerGroupRows]] = {}
            for group in view.groups:
                by_region.setdefault(group.region.name, []).append(group)
            for name, parts in by_region.items():
                if len(parts) == 1:
                    distinct = parts[0].slots_distinct
                else:
                    distinct = all_distinct(np.concatenate([g.slots for g in parts]))
                if not distinct:
                    raise InvalidSubmission(f"the view names region {name!r} slots more than once (overlapping rows: "
                                           "a fetch would write one slot twice)")
