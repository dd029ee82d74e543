"""An engine geometry and its token range on the wire: the optional ``geometry`` map of a hint.

Map (str keys, every key required)::

    order: "layer_major" | "block_major"    head_order: "nhd" | "hnd"    dtype: str
    layers, kv_heads, head_dim, element_bytes, block_tokens, blocks,
    block_stride, token_stride, head_stride: uint
    heads, tokens: [first: uint, end: uint]
    regions: array of (at most Limits.groups: a tensor per layer, or per layer and K/V) [name: str, address, slot_bytes, slots: uint, memory_kind: "host" | "device", device_id: uint]
    planes: bin (little-endian int64 pairs: region index, byte offset; K then V of each layer)

The contract's own checks then run (planes inside their regions, heads in range): a peer's
geometry is trusted for nothing it could not have made honestly.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvxfer.contract import BlockOrder, HeadOrder, KVGeometry, MemoryKind, SlotRegion, TokenRange
from kvxfer.wire.arrays import int64_from_bytes, int64_to_bytes
from kvxfer.wire.errors import WireError
from kvxfer.wire.fields import Fields, check_str, describe
from kvxfer.wire.limits import Limits

_KEYS = frozenset({"order", "head_order", "dtype", "layers", "kv_heads", "head_dim", "element_bytes", "block_tokens",
                   "blocks", "block_stride", "token_stride", "head_stride", "heads", "tokens", "regions", "planes"})
_UINTS = ("layers", "kv_heads", "head_dim", "element_bytes", "block_tokens", "blocks", "block_stride", "token_stride",
          "head_stride")
MAX_LAYERS = 4096


def encode_geometry(geometry: KVGeometry, tokens: TokenRange, limits: Limits) -> dict[str, Any]:
    if len(geometry.regions) > limits.groups:
        raise WireError(f"hint geometry: {len(geometry.regions)} regions, the limit is {limits.groups}")
    for region in geometry.regions:
        check_str(region.name, "hint geometry: region name", limits.string_bytes)
    body: dict[str, Any] = {name: getattr(geometry, name) for name in _UINTS}
    body.update({
        "order": geometry.order.value, "head_order": geometry.head_order.value, "dtype": geometry.dtype,
        "heads": list(geometry.heads), "tokens": [tokens.start, tokens.end],
        "regions": [[r.name, r.address, r.slot_bytes, r.slots, r.memory_kind.value, r.device_id]
                    for r in geometry.regions],
        "planes": int64_to_bytes(_flat(geometry.planes)),
    })
    return body


def decode_geometry(value: Any, limits: Limits) -> tuple[KVGeometry, TokenRange]:
    f = Fields(value, "hint geometry", _KEYS)
    numbers = {name: f.uint(name) for name in _UINTS}
    if numbers["layers"] > MAX_LAYERS:
        raise WireError(f"hint geometry: {numbers['layers']} layers, the limit is {MAX_LAYERS}")
    heads, tokens = _pair(f.array("heads", 2), "heads"), _pair(f.array("tokens", 2), "tokens")
    regions = tuple(_region(item, i, limits) for i, item in enumerate(f.array("regions", limits.groups)))
    flat = int64_from_bytes(f.binary("planes", 16 * 2 * MAX_LAYERS), "hint geometry: field planes", 4 * MAX_LAYERS)
    if flat.size % 2:
        raise WireError("hint geometry: field planes must hold (region, offset) pairs")
    planes = tuple((int(flat[i]), int(flat[i + 1])) for i in range(0, flat.size, 2))
    try:
        geometry = KVGeometry(order=f.choice("order", BlockOrder), head_order=f.choice("head_order", HeadOrder),
                              dtype=f.text("dtype", 64), heads=heads, regions=regions, planes=planes, **numbers)
        return geometry, TokenRange(*tokens)
    except (TypeError, ValueError) as exc:
        raise WireError(f"hint geometry: {exc}") from None


def _flat(planes: tuple[tuple[int, int], ...]) -> Any:
    return np.asarray(planes, dtype=np.int64).reshape(-1)


def _pair(items: list[Any], name: str) -> tuple[int, int]:
    if len(items) != 2 or any(type(v) is not int or v < 0 for v in items):
        raise WireError(f"hint geometry: field {name} must be [first, end] of non-negative ints, got {describe(items)}")
    return items[0], items[1]


def _region(item: Any, index: int, limits: Limits) -> SlotRegion:
    where = f"hint geometry: region {index}"
    if type(item) is not list or len(item) != 6:
        raise WireError(f"{where} must be [name, address, slot_bytes, slots, memory_kind, device_id], "
                        f"got {describe(item)}")
    name, address, slot_bytes, slots, kind, device = item
    if type(name) is not str:
        raise WireError(f"{where}: name must be str, got {describe(name)}")
    check_str(name, f"{where}: name", limits.string_bytes)
    if any(type(v) is not int or v < 0 for v in (address, slot_bytes, slots, device)):
        raise WireError(f"{where}: address, slot_bytes, slots and device_id must be non-negative ints")
    kinds = {k.value: k for k in MemoryKind}
    if kind not in kinds:
        raise WireError(f"{where}: memory_kind must be one of {list(kinds)}, got {describe(kind)}")
    try:
        return SlotRegion(name, address, slot_bytes, slots, kinds[kind], device)
    except (TypeError, ValueError) as exc:
        raise WireError(f"{where}: {exc}") from None
