"""The frozen description of one layer group, and the two tensor layouts a pool offers."""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from kvxfer.contract import CacheKind


class Layout(enum.Enum):
    """How a group's tensor is ordered.

    BLOCK_MAJOR (default): ``[blocks, layers, 2, block_tokens, kv_heads, head_dim]``; one
    block of the group (all layers, K and V) is one contiguous slot, so one row is one
    descriptor. LAYER_MAJOR: ``[layers, blocks, 2, block_tokens, kv_heads, head_dim]``;
    one region per layer, as peers register it (interop and benchmark baselines).
    """

    BLOCK_MAJOR = "block_major"
    LAYER_MAJOR = "layer_major"


@dataclass(frozen=True)
class LayerGroupSpec:
    """Layers that share one page geometry.

    PAGED groups hold ``block_tokens`` tokens per block. A STATE group holds one slot per
    request (a recurrent state); its slot has the same shape formula, so choose
    ``block_tokens``/``kv_heads``/``head_dim`` to fit the state (K and V halves are just
    storage there). ``window`` (tokens) marks a sliding-window group: resuming at ``p``
    needs only tokens ``[p - window, p)`` plus the first ``sink_blocks`` blocks.
    """

    name: str
    layers: int
    block_tokens: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype = torch.float16
    kind: CacheKind = CacheKind.PAGED
    window: int | None = None
    sink_blocks: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name or "/" in self.name:
            raise ValueError(f"LayerGroupSpec.name must be a non-empty str without '/', got {self.name!r}")
        for field in ("layers", "block_tokens", "kv_heads", "head_dim"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"group {self.name!r}: {field} must be a positive int, got {value!r}")
        if not isinstance(self.dtype, torch.dtype):
            raise TypeError(f"group {self.name!r}: dtype must be a torch.dtype, got {self.dtype!r}")
        if not isinstance(self.kind, CacheKind):
            raise TypeError(f"group {self.name!r}: kind must be a CacheKind, got {self.kind!r}")
        if self.window is not None and (not isinstance(self.window, int) or self.window <= 0):
            raise ValueError(f"group {self.name!r}: window must be a positive token count or None")
        if not isinstance(self.sink_blocks, int) or self.sink_blocks < 0:
            raise ValueError(f"group {self.name!r}: sink_blocks must be a non-negative int")
        if self.kind is CacheKind.STATE and (self.window is not None or self.sink_blocks):
            raise ValueError(f"group {self.name!r}: a STATE group has no window or sink blocks")

    @property
    def element_bytes(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def layer_block_bytes(self) -> int:
        """Bytes of one block of one layer, K and V."""
        return 2 * self.block_tokens * self.kv_heads * self.head_dim * self.element_bytes

    @property
    def row_bytes(self) -> int:
        """Bytes of one row in the block-major layout: one block, all layers, K and V."""
        return self.layers * self.layer_block_bytes

    def blocks_for(self, tokens: int) -> int:
        """Blocks a request of ``tokens`` tokens holds in this group (STATE: always 1)."""
        if self.kind is CacheKind.STATE:
            return 1
        return -(-tokens // self.block_tokens)
