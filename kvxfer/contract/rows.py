"""Token ranges, the rows of one layer group, and the immutable view a lease yields."""

from __future__ import annotations

import enum
import functools
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvxfer.contract.arrays import BoolArray, IndexArray, all_distinct, bounds, frozen_int64, is_positions
from kvxfer.contract.geometry import KVGeometry
from kvxfer.contract.memory import SlotRegion


class CacheKind(enum.Enum):
    """PAGED rows are token blocks; STATE rows are one recurrent-state slot per request."""

    PAGED = "paged"
    STATE = "state"


@dataclass(frozen=True)
class TokenRange:
    """The half-open token interval ``[start, end)``."""

    start: int
    end: int

    def __post_init__(self) -> None:
        for name in ("start", "end"):
            value = getattr(self, name)
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool):
                raise TypeError(f"TokenRange.{name} must be an int, got {type(value).__name__}")
            object.__setattr__(self, name, int(value))
        if self.start < 0:
            raise ValueError(f"TokenRange start {self.start} is negative")
        if self.start > self.end:
            raise ValueError(f"TokenRange start {self.start} is past end {self.end}")

    def __len__(self) -> int:
        return self.end - self.start


@dataclass(frozen=True, eq=False)
class LayerGroupRows:
    """The rows of one layer group: ``slots[i]`` of ``region`` holds block ``ordinals[i]``.

    Both arrays are read-only int64 copies taken at construction.
    """

    layer_group: str
    kind: CacheKind
    region: SlotRegion
    slots: IndexArray
    ordinals: IndexArray

    def __post_init__(self) -> None:
        if not isinstance(self.layer_group, str) or not self.layer_group:
            raise ValueError(f"layer_group must be a non-empty str, got {self.layer_group!r}")
        if not isinstance(self.kind, CacheKind):
            raise TypeError(f"kind must be a CacheKind, got {self.kind!r}")
        if not isinstance(self.region, SlotRegion):
            raise TypeError(f"region must be a SlotRegion, got {type(self.region).__name__}")
        slots = frozen_int64(self.slots, f"slots of group {self.layer_group!r}")
        ordinals = frozen_int64(self.ordinals, f"ordinals of group {self.layer_group!r}")
        if slots.shape != ordinals.shape:
            raise ValueError(
                f"group {self.layer_group!r}: {slots.size} slots but {ordinals.size} ordinals"
            )
        object.__setattr__(self, "slots", slots)
        object.__setattr__(self, "ordinals", ordinals)

    def __len__(self) -> int:
        return int(self.slots.size)

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        # Rebuilt through the constructor: numpy does not pickle the read-only flag, and the
        # cached facts below must describe the arrays the copy really holds.
        return (LayerGroupRows, (self.layer_group, self.kind, self.region, self.slots, self.ordinals))

    # Facts about the (read-only) arrays, computed on first use and kept: a backend checks a
    # view in describe() and again in publish()/fetch(), and the worker does both on one view.
    @functools.cached_property
    def slot_bounds(self) -> tuple[int, int] | None:
        """(lowest, highest) slot, or None when the group is empty."""
        return bounds(self.slots)

    @functools.cached_property
    def ordinals_are_positions(self) -> bool:
        """True when ordinals are 0..n-1 in order (so row i holds block i)."""
        return is_positions(self.ordinals)

    @functools.cached_property
    def ordinals_distinct(self) -> bool:
        return self.ordinals_are_positions or all_distinct(self.ordinals)

    @functools.cached_property
    def slots_distinct(self) -> bool:
        return all_distinct(self.slots)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, LayerGroupRows):
            return NotImplemented
        return (
            self.layer_group == other.layer_group
            and self.kind == other.kind
            and self.region == other.region
            and np.array_equal(self.slots, other.slots)
            and np.array_equal(self.ordinals, other.ordinals)
        )

    def __hash__(self) -> int:
        return hash((self.layer_group, self.kind, self.region, self.slots.tobytes(), self.ordinals.tobytes()))


@dataclass(frozen=True)
class View:
    """Which rows, of which regions, for which token blocks of one request.

    A snapshot: it stays valid after its lease ends; the lease only bounds how long the
    memory it locates is protected. ``layout`` is the pool's layout identity.

    With a ``geometry`` (an engine's own KV, see ``kvxfer.contract.geometry``) the view has
    exactly one group: its rows are the request's blocks in that geometry's block size,
    its slots the engine's block ids, and ``layout`` names the model's KV only (not the
    block size, order or heads, which the geometry says and the ends may differ in).
    """

    request: str
    tokens: TokenRange
    groups: tuple[LayerGroupRows, ...]
    layout: bytes = field(default=b"")
    geometry: KVGeometry | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.request, str) or not self.request:
            raise ValueError(f"View.request must be a non-empty str, got {self.request!r}")
        if not isinstance(self.tokens, TokenRange):
            raise TypeError(f"View.tokens must be a TokenRange, got {type(self.tokens).__name__}")
        groups: Any = self.groups
        if isinstance(groups, LayerGroupRows) or not hasattr(groups, "__iter__"):
            raise TypeError("View.groups must be a sequence of LayerGroupRows")
        # LayerGroupRows already holds read-only copies, so the tuple is the snapshot.
        copied = tuple(groups)
        for group in copied:
            if not isinstance(group, LayerGroupRows):
                raise TypeError(f"View.groups holds a {type(group).__name__}, not LayerGroupRows")
        names = [g.layer_group for g in copied]
        if len(set(names)) != len(names):
            raise ValueError(f"View of {self.request!r} names a layer group twice: {names}")
        if not isinstance(self.layout, bytes):
            raise TypeError("View.layout must be bytes")
        if self.geometry is not None:
            if not isinstance(self.geometry, KVGeometry):
                raise TypeError(f"View.geometry must be a KVGeometry or None, got {type(self.geometry).__name__}")
            if len(copied) != 1 or copied[0].kind is not CacheKind.PAGED:
                raise ValueError(f"View of {self.request!r}: a view with a geometry has one PAGED group of blocks")
        object.__setattr__(self, "groups", copied)

    @property
    def rows(self) -> int:
        return sum(len(g) for g in self.groups)

    def row_masks(self, value: bool = False) -> list[BoolArray]:
        """New writable bool arrays, one per group, filled with ``value``: on every call."""
        return [np.full(len(g), bool(value), dtype=np.bool_) for g in self.groups]
