"""An engine's own KV tensors, described as a ``KVGeometry`` with no copy.

An engine hands kvxfer what it has::

    kv = EngineKV.per_layer(tensors, kv_heads=8, heads=(0, 4))             # vLLM: [2, blocks, bt, H, D] per layer
    kv = EngineKV.per_layer(tensors, kv_heads=8, head_order=HeadOrder.HND)  # [2, blocks, H, bt, D]
    kv = EngineKV.split(k_tensors, v_tensors, kv_heads=8)                   # K and V apart: [blocks, bt, H, D]
    kv = EngineKV.from_pool(pool)                                          # a kvxfer PagedKVPool, either order
    kv = EngineKV.from_planes(k_planes, v_planes, ...)                     # any strided [blocks, bt, H, D] views

Each layer's K and V *plane* is a (possibly strided) view ``[blocks, block_tokens, heads,
head_dim]`` (NHD) or ``[blocks, heads, block_tokens, head_dim]`` (HND) of one of the
tensors; all planes must share their strides, and head_dim must be contiguous. The tensors
themselves are the registered regions. Anything else is refused with a LayoutMismatch that
names the tensor and the shape or stride that does not fit.

``layout`` is the model's KV identity (scope, layers, KV heads, head_dim, dtype): two ends
must agree on it, while block size, order and heads are the geometry's to differ in.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvxfer.contract import BlockOrder, HeadOrder, KVGeometry, LayoutMismatch, MemoryKind, SlotRegion
from kvxfer.pool import PagedKVPool
from kvxfer.pool.spec import Layout

KV_IDENTITY_VERSION = 1


def kv_identity(scope: bytes, layers: int, kv_heads: int, head_dim: int, dtype: str) -> bytes:
    """What the bytes of a head's KV mean, whatever layout holds them: 33 bytes."""
    text = f"kvxfer-kv/{KV_IDENTITY_VERSION}|scope={scope.hex()}|layers={layers}|heads={kv_heads}|dim={head_dim}|dtype={dtype}"
    return bytes([KV_IDENTITY_VERSION]) + hashlib.sha256(text.encode()).digest()


@dataclass(frozen=True)
class EngineKV:
    """An engine's KV memory: its geometry, the tensors that hold it, and its KV identity."""

    geometry: KVGeometry
    layout: bytes
    tensors: tuple[torch.Tensor, ...]

    @property
    def regions(self) -> tuple[SlotRegion, ...]:
        return self.geometry.regions

    # --- builders -----------------------------------------------------------------------------
    @staticmethod
    def per_layer(tensors: Sequence[torch.Tensor], *, kv_heads: int, heads: tuple[int, int] | None = None,
                  head_order: HeadOrder = HeadOrder.NHD, scope: bytes = b"", name: str = "engine") -> EngineKV:
        """One tensor per layer, K and V stacked first: ``[2, blocks, bt, H, D]`` (NHD) or
        ``[2, blocks, H, bt, D]`` (HND)."""
        tensors = tuple(tensors)
        for i, t in enumerate(tensors):
            _check_rank(t, 5, f"layer tensor {i}", "[2, blocks, ...]")
            if t.shape[0] != 2:
                raise LayoutMismatch(f"layer tensor {i} has shape {tuple(t.shape)}: the first dimension must be 2 (K, V)")
        return EngineKV.from_planes([t[0] for t in tensors], [t[1] for t in tensors], tensors=tensors,
                                    kv_heads=kv_heads, heads=heads, head_order=head_order,
                                    order=BlockOrder.LAYER_MAJOR, scope=scope, name=name)

    @staticmethod
    def split(k_tensors: Sequence[torch.Tensor], v_tensors: Sequence[torch.Tensor], *, kv_heads: int,
              heads: tuple[int, int] | None = None, head_order: HeadOrder = HeadOrder.NHD, scope: bytes = b"",
              name: str = "engine") -> EngineKV:
        """K and V in separate tensors per layer, each ``[blocks, bt, H, D]`` (or HND)."""
        k, v = tuple(k_tensors), tuple(v_tensors)
        if len(k) != len(v):
            raise LayoutMismatch(f"{len(k)} K tensors but {len(v)} V tensors")
        return EngineKV.from_planes(k, v, tensors=k + v, kv_heads=kv_heads, heads=heads, head_order=head_order,
                                    order=BlockOrder.LAYER_MAJOR, scope=scope, name=name)

    @staticmethod
    def from_pool(pool: PagedKVPool, group: str | None = None, *, heads: tuple[int, int] | None = None,
                  kv_heads: int | None = None) -> EngineKV:
        """A kvxfer pool's group (``[blocks, L, 2, bt, H, D]`` or ``[L, blocks, 2, bt, H, D]``).
        ``heads``/``kv_heads`` say which of the model's heads the pool holds (default: all)."""
        spec = pool.groups[0] if group is None else pool.group(group)
        t = pool.storage(spec.name)
        block_major = pool.layout is Layout.BLOCK_MAJOR
        k = [t[:, layer, 0] if block_major else t[layer, :, 0] for layer in range(spec.layers)]
        v = [t[:, layer, 1] if block_major else t[layer, :, 1] for layer in range(spec.layers)]
        total = spec.kv_heads if kv_heads is None else kv_heads
        return EngineKV.from_planes(k, v, tensors=(t,), kv_heads=total, heads=heads, head_order=HeadOrder.NHD,
                                    order=BlockOrder.BLOCK_MAJOR if block_major else BlockOrder.LAYER_MAJOR,
                                    scope=pool.scope, name=pool.name)

    @staticmethod
    def from_planes(k_planes: Sequence[torch.Tensor], v_planes: Sequence[torch.Tensor], *,
                    tensors: Sequence[torch.Tensor], kv_heads: int, heads: tuple[int, int] | None,
                    head_order: HeadOrder, order: BlockOrder, scope: bytes = b"", name: str = "engine") -> EngineKV:
        """The general builder: every plane a view of one of ``tensors`` (the regions)."""
        planes = [p for pair in zip(k_planes, v_planes) for p in pair]
        if not planes:
            raise LayoutMismatch("no layers: an engine's KV needs at least one K and one V plane")
        tensors = tuple(tensors)
        first = planes[0]
        _check_rank(first, 4, "plane 0", "[blocks, block_tokens, heads, head_dim]" if head_order is HeadOrder.NHD
                    else "[blocks, heads, block_tokens, head_dim]")
        blocks, a, b, head_dim = (int(x) for x in first.shape)
        block_tokens, held = (a, b) if head_order is HeadOrder.NHD else (b, a)
        for i, p in enumerate(planes):
            if tuple(p.shape) != tuple(first.shape) or p.stride() != first.stride() or p.dtype != first.dtype:
                raise LayoutMismatch(f"plane {i} ({'KV'[i % 2]} of layer {i // 2}) is {tuple(p.shape)} with strides "
                                     f"{p.stride()} ({p.dtype}); plane 0 is {tuple(first.shape)}, {first.stride()} "
                                     f"({first.dtype}): every plane must share shape, strides and dtype")
            if p.device != first.device:
                raise LayoutMismatch(f"plane {i} is on {p.device}, plane 0 on {first.device}")
        if first.stride(3) != 1:
            raise LayoutMismatch(f"head_dim must be contiguous (stride 1), got strides {first.stride()}")
        span = (0, kv_heads) if heads is None else (int(heads[0]), int(heads[1]))
        if span[1] - span[0] != held:
            raise LayoutMismatch(f"the planes hold {held} heads but heads {span} names {span[1] - span[0]}")
        elem = first.element_size()
        block_s, x_s, y_s = (first.stride(i) * elem for i in range(3))
        token_s, head_s = (x_s, y_s) if head_order is HeadOrder.NHD else (y_s, x_s)
        regions = tuple(_region(t, f"{name}/{i}") for i, t in enumerate(tensors))
        where = [_locate(p, tensors, i) for i, p in enumerate(planes)]
        dtype = str(first.dtype).removeprefix("torch.")
        try:
            geometry = KVGeometry(order=order, head_order=head_order, layers=len(planes) // 2, kv_heads=kv_heads,
                                  heads=span, head_dim=head_dim, dtype=dtype, element_bytes=elem,
                                  block_tokens=block_tokens, blocks=blocks, regions=regions, planes=tuple(where),
                                  block_stride=block_s, token_stride=token_s, head_stride=head_s)
        except ValueError as exc:
            raise LayoutMismatch(str(exc)) from None
        return EngineKV(geometry, kv_identity(scope, geometry.layers, kv_heads, head_dim, dtype), tensors)


def _check_rank(t: object, rank: int, what: str, shape: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise LayoutMismatch(f"{what} is a {type(t).__name__}, not a torch.Tensor")
    if t.dim() != rank:
        raise LayoutMismatch(f"{what} has shape {tuple(t.shape)}; expected {shape}")


def _region(t: torch.Tensor, name: str) -> SlotRegion:
    if not t.is_contiguous():
        raise LayoutMismatch(f"tensor {name!r} is not contiguous: register the tensor that owns the memory")
    nbytes = t.numel() * t.element_size()
    kind = MemoryKind.DEVICE if t.is_cuda else MemoryKind.HOST
    return SlotRegion(name=name, address=int(t.data_ptr()), slot_bytes=t.element_size(),
                      slots=nbytes // t.element_size(), memory_kind=kind,
                      device_id=(t.device.index or 0) if t.is_cuda else 0)


def _locate(plane: torch.Tensor, tensors: tuple[torch.Tensor, ...], index: int) -> tuple[int, int]:
    """(tensor index, byte offset) of the tensor ``plane`` is a view of."""
    address = int(plane.data_ptr())
    for i, t in enumerate(tensors):
        start = int(t.data_ptr())
        if start <= address < start + t.numel() * t.element_size():
            return i, address - start
    raise LayoutMismatch(f"plane {index} ({'KV'[index % 2]} of layer {index // 2}) lies in none of the tensors given")
