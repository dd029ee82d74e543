"""How one end keeps its KV: the geometry that lets two different layouts meet.

A serving engine keeps KV its own way: one tensor per layer or per layer group, K and V
together or apart, tokens before heads (NHD) or heads before tokens (HND), its own block
size, and (under tensor parallelism) only a slice of the KV heads. ``KVGeometry`` says all
of that for one end as numbers a mover can use directly: where each layer's K and V planes
start (a region and an offset in it), and three strides, so that the unit of KV for
(layer, K or V, block b, token t of the block, head h) lies at

    plane + b * block_stride + t * token_stride + (h - heads[0]) * head_stride

and is ``head_dim * element_bytes`` contiguous bytes. Every standard layout is such a
geometry; ``order`` and ``head_order`` name which one for people and error messages.

A view or a hint with a geometry has one row group whose rows are the request's blocks in
this end's block size (``slots``: the engine's block ids; ``ordinals``: the logical block
numbers). Two ends move KV between geometries when they agree on the model's KV (layers,
KV heads, head_dim, dtype) and hold heads in common; ``check_compatible`` refuses anything
else by name, before a byte moves.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass

from kvxfer.contract.errors import InvalidSubmission
from kvxfer.contract.memory import SlotRegion


class BlockOrder(enum.Enum):
    """LAYER_MAJOR: a tensor (or two) per layer, blocks inside. BLOCK_MAJOR: a block holds
    every layer, so one block of the request is one contiguous span."""

    LAYER_MAJOR = "layer_major"
    BLOCK_MAJOR = "block_major"


class HeadOrder(enum.Enum):
    """NHD: a block is [tokens, heads, head_dim]. HND: [heads, tokens, head_dim]."""

    NHD = "nhd"
    HND = "hnd"


class LayoutMismatch(InvalidSubmission):
    """Two ends' KV geometries cannot meet (dtype, head_dim, layers, KV heads, no common
    head), or a geometry does not fit its memory: refused before anything moves."""


@dataclass(frozen=True)
class KVGeometry:
    """One end's KV layout in memory (see the module docstring)."""

    order: BlockOrder
    head_order: HeadOrder
    layers: int
    kv_heads: int                       # the model's KV heads (all ranks)
    heads: tuple[int, int]              # [first, end) of the heads this end holds
    head_dim: int
    dtype: str                          # "float16", "bfloat16", ...: the element type by name
    element_bytes: int
    block_tokens: int
    blocks: int                         # block ids lie in [0, blocks)
    regions: tuple[SlotRegion, ...]     # the memory the planes lie in
    planes: tuple[tuple[int, int], ...]  # 2 * layers (region index, byte offset): K then V per layer
    block_stride: int
    token_stride: int
    head_stride: int

    def __post_init__(self) -> None:
        if not isinstance(self.order, BlockOrder) or not isinstance(self.head_order, HeadOrder):
            raise TypeError("KVGeometry: order must be a BlockOrder and head_order a HeadOrder")
        _check_ints(self, ("layers", "kv_heads", "head_dim", "element_bytes", "block_tokens", "blocks"), low=1)
        _check_ints(self, ("block_stride", "token_stride", "head_stride"), low=0)
        if not isinstance(self.dtype, str) or not self.dtype:
            raise ValueError(f"KVGeometry.dtype must be a dtype name, got {self.dtype!r}")
        if len(tuple(self.heads)) != 2:
            raise ValueError(f"KVGeometry.heads must be a (first, end) pair, got {self.heads!r}")
        first, end = (int(h) for h in self.heads)
        object.__setattr__(self, "heads", (first, end))
        if not 0 <= first < end <= self.kv_heads:
            raise ValueError(f"KVGeometry.heads {self.heads} must be a non-empty range within [0, {self.kv_heads})")
        regions = tuple(self.regions)
        if not regions or not all(isinstance(r, SlotRegion) for r in regions):
            raise TypeError("KVGeometry.regions must be a non-empty sequence of SlotRegion")
        if len({(r.memory_kind, r.device_id) for r in regions}) != 1:
            raise ValueError("KVGeometry.regions must all be one memory (one kind, one device)")
        planes = tuple((int(r), int(o)) for r, o in self.planes)
        if len(planes) != 2 * self.layers:
            raise ValueError(f"KVGeometry: {len(planes)} planes for {self.layers} layers (need K and V of each)")
        object.__setattr__(self, "regions", regions)
        object.__setattr__(self, "planes", planes)
        self._check_planes()

    def _check_planes(self) -> None:
        """Every plane, to its last unit, lies inside its region."""
        extent = self.plane_extent
        for i, (region, offset) in enumerate(self.planes):
            if not 0 <= region < len(self.regions):
                raise ValueError(f"KVGeometry: plane {i} names region {region} of {len(self.regions)}")
            if offset < 0 or offset + extent > self.regions[region].nbytes:
                raise ValueError(
                    f"KVGeometry: plane {i} ({'KV'[i % 2]} of layer {i // 2}) spans bytes "
                    f"[{offset}, {offset + extent}) of region {self.regions[region].name!r}, "
                    f"which holds {self.regions[region].nbytes}")

    @property
    def unit_bytes(self) -> int:
        """Bytes of one head of one token: the unit every layout keeps contiguous."""
        return self.head_dim * self.element_bytes

    @property
    def head_count(self) -> int:
        return self.heads[1] - self.heads[0]

    @property
    def plane_extent(self) -> int:
        """Bytes from a plane's start to the end of its last unit."""
        return ((self.blocks - 1) * self.block_stride + (self.block_tokens - 1) * self.token_stride
                + (self.head_count - 1) * self.head_stride + self.unit_bytes)

    @property
    def block_bytes(self) -> int:
        """KV bytes of one block of this end: every layer, K and V, its heads."""
        return 2 * self.layers * self.block_tokens * self.head_count * self.unit_bytes

    def plane_address(self, plane: int) -> int:
        region, offset = self.planes[plane]
        return self.regions[region].address + offset

    def narrowed(self, first: int, end: int) -> KVGeometry:
        """The same memory seen as holding only heads [first, end), a subset of its heads."""
        if not self.heads[0] <= first < end <= self.heads[1]:
            raise LayoutMismatch(f"heads [{first}, {end}) are not within the geometry's [{self.heads[0]}, "
                                 f"{self.heads[1]})")
        shift = (first - self.heads[0]) * self.head_stride
        planes = tuple((region, offset + shift) for region, offset in self.planes)
        return dataclasses.replace(self, heads=(first, end), planes=planes)

    def describe(self) -> str:
        return (f"{self.order.value} {self.head_order.value.upper()}, {self.layers} layers, heads "
                f"[{self.heads[0]}, {self.heads[1]}) of {self.kv_heads}, head_dim {self.head_dim}, "
                f"{self.dtype}, {self.block_tokens}-token blocks")


def _check_ints(geometry: KVGeometry, names: tuple[str, ...], *, low: int) -> None:
    for name in names:
        value = getattr(geometry, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"KVGeometry.{name} must be an int of at least {low}, got {value!r}")


def common_heads(a: KVGeometry, b: KVGeometry) -> tuple[int, int]:
    """The heads both ends hold; LayoutMismatch when they hold none in common."""
    first, end = max(a.heads[0], b.heads[0]), min(a.heads[1], b.heads[1])
    if first >= end:
        raise LayoutMismatch(f"no KV head in common: one end holds heads [{a.heads[0]}, {a.heads[1]}), "
                             f"the other [{b.heads[0]}, {b.heads[1]})")
    return first, end


def check_compatible(local: KVGeometry, peer: KVGeometry) -> tuple[int, int]:
    """Refuse two geometries whose KV cannot meet, naming the first difference; the heads
    they have in common otherwise."""
    for name in ("dtype", "head_dim", "layers", "kv_heads", "element_bytes"):
        mine, theirs = getattr(local, name), getattr(peer, name)
        if mine != theirs:
            raise LayoutMismatch(f"KV layouts differ in {name}: local {mine}, peer {theirs}")
    return common_heads(local, peer)
