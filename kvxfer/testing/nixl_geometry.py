"""Engine KV (``EngineKV``) in a child process, for two-process tests of geometry transfers.

A geometry is described by a JSON-able spec, so that both processes can build it::

    {"kind": "layers" | "pool", "layers": 2, "kv_heads": 4, "head_dim": 8, "heads": [0, 4],
     "blocks": 12, "block_tokens": 16, "order": "nhd" | "hnd", "pool_layout": "block_major", "name": "kv"}

``"layers"``: one tensor per layer, ``[2, blocks, bt, H, D]`` (NHD) or ``[2, blocks, H, bt, D]``
(HND); ``"pool"``: a ``PagedKVPool`` of one group (NHD) in ``pool_layout``. float16, host.

The child (``SubprocessPeer("kvxfer.testing.nixl_geometry:child_engine", {...})``) registers its
tensors with a NixlBackend and serves them as row memory (``TensorMemory``: a region's slots are
its elements). The parent rebuilds the child's geometry with ``peer_kv`` (same spec, the child's
addresses) to lend views of the child's blocks, and reads any geometry's KV back by token with
``kv_tokens``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from kvxfer.backends.common.transform import rebased
from kvxfer.backends.nixl import NixlBackend
from kvxfer.contract import HeadOrder, KVGeometry, SlotRegion, TransferMode
from kvxfer.lender.engine_kv import EngineKV
from kvxfer.pool import LayerGroupSpec, Layout, PagedKVPool
from kvxfer.testing.memory import RowMemory
from kvxfer.testing.nixl_pairs import fault_injector


def build_kv(spec: dict[str, Any], seed: int | None = None) -> EngineKV:
    """The spec's tensors (random when ``seed`` is given, else zeros) as an EngineKV."""
    heads = (int(spec["heads"][0]), int(spec["heads"][1]))
    held, bt, blocks, dim = heads[1] - heads[0], int(spec["block_tokens"]), int(spec["blocks"]), int(spec["head_dim"])
    name = str(spec.get("name", "kv"))
    if spec["kind"] == "pool":
        group = LayerGroupSpec("g", layers=int(spec["layers"]), block_tokens=bt, kv_heads=held, head_dim=dim)
        pool = PagedKVPool([group], blocks, layout=Layout(spec.get("pool_layout", "block_major")), name=name)
        kv = EngineKV.from_pool(pool, heads=heads, kv_heads=int(spec["kv_heads"]))
    else:
        order = HeadOrder(spec.get("order", "nhd"))
        shape = (2, blocks, bt, held, dim) if order is HeadOrder.NHD else (2, blocks, held, bt, dim)
        tensors = [torch.zeros(shape, dtype=torch.float16) for _ in range(int(spec["layers"]))]
        kv = EngineKV.per_layer(tensors, kv_heads=int(spec["kv_heads"]), heads=heads, head_order=order, name=name)
    if seed is not None:
        g = torch.Generator().manual_seed(seed)
        for t in kv.tensors:
            t.copy_(torch.randn(t.shape, generator=g).to(t.dtype))
    return kv


def peer_kv(spec: dict[str, Any], regions: tuple[SlotRegion, ...]) -> EngineKV:
    """The child's EngineKV as the parent sees it: the spec's geometry at the child's addresses
    (``regions``: the child's, by name). No tensors: the memory is the child's."""
    local = build_kv(spec)
    by_name = {r.name: r.address for r in regions}
    geometry = rebased(local.geometry, [by_name[r.name] for r in local.geometry.regions])
    return EngineKV(geometry, local.layout, ())


def kv_tokens(geometry: KVGeometry, memory: dict[str, np.ndarray], table: Any, tokens: int) -> np.ndarray:
    """``[planes, tokens, heads, unit_bytes]`` uint8 of a request whose logical block i is
    ``table[i]``, read through ``geometry`` from ``memory`` (region name -> its bytes)."""
    bt, unit = geometry.block_tokens, geometry.unit_bytes
    t = np.arange(tokens, dtype=np.int64)
    token_off = np.asarray(table, dtype=np.int64)[t // bt] * geometry.block_stride + (t % bt) * geometry.token_stride
    off = token_off[:, None] + np.arange(geometry.head_count, dtype=np.int64)[None, :] * geometry.head_stride
    out = []
    for region, offset in geometry.planes:
        flat = memory[geometry.regions[region].name]
        at = offset + off[..., None] + np.arange(unit, dtype=np.int64)
        out.append(flat[at])
    return np.stack(out)


def local_bytes(kv: EngineKV) -> dict[str, np.ndarray]:
    """Region name -> the bytes of this process's tensors (views, no copy)."""
    return {r.name: t.contiguous().view(torch.uint8).reshape(-1).numpy() for r, t in zip(kv.regions, kv.tensors)}


class TensorMemory(RowMemory):
    """An EngineKV's tensors as row memory: a region's slots are its elements."""

    def __init__(self, kv: EngineKV) -> None:
        self.kv = kv
        self.regions = kv.regions
        self._flat = local_bytes(kv)

    def _rows(self, region: str) -> np.ndarray:
        slot = next(r.slot_bytes for r in self.regions if r.name == region)
        return self._flat[region].reshape(-1, slot)

    def write(self, region: str, slots: np.ndarray, data: bytes) -> None:
        rows = self._rows(region)
        rows[np.asarray(slots, dtype=np.int64)] = np.frombuffer(data, dtype=np.uint8).reshape(-1, rows.shape[1])

    def read(self, region: str, slots: np.ndarray) -> bytes:
        return self._rows(region)[np.asarray(slots, dtype=np.int64)].tobytes()


def read_all(memory: Callable[[str, np.ndarray], bytes], regions: tuple[SlotRegion, ...]) -> dict[str, np.ndarray]:
    """Every byte of ``regions`` through a ``read(region, slots)`` (a SubprocessPeer's)."""
    return {r.name: np.frombuffer(memory(r.name, np.arange(r.slots, dtype=np.int64)), dtype=np.uint8)
            for r in regions}


def child_engine(mode: str, spec: dict[str, Any], seed: int | None = None, deadline_s: float = 10.0,
                 **options: Any) -> tuple[NixlBackend, TensorMemory, Callable[[int | None], None]]:
    """Runs in the child of a SubprocessPeer: a NixlBackend with the spec's KV registered."""
    kv = build_kv(spec, seed)
    backend = NixlBackend(mode=TransferMode(mode), deadline_s=deadline_s, **options)
    backend.register(kv.regions)
    return backend, TensorMemory(kv), fault_injector(backend)
