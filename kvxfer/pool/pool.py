"""PagedKVPool: a torch paged KV cache (CUDA or CPU) with per-request block tables.

See the package docstring (``kvxfer.pool``) for the API a model and an engine use.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from kvxfer.contract import CacheKind, KvxferError, MemoryKind, SlotRegion
from kvxfer.pool.allocator import BlockAllocator, PoolExhausted
from kvxfer.pool.identity import block_names, layout_identity
from kvxfer.pool.spec import LayerGroupSpec, Layout

_EMPTY = np.zeros(0, dtype=np.int64)


class UnknownRequest(KvxferError):
    """The pool holds no request of that name (never allocated, or freed)."""


class PoolListener(Protocol):
    """Lifecycle hooks a lender registers with ``PagedKVPool.add_listener``."""

    def on_free(self, request: str) -> None: ...

    def on_shrink(self, request: str, tokens: int) -> None: ...

    def on_reuse_reset(self, scope: bytes) -> None: ...


@dataclass(frozen=True)
class RowRegion:
    """One registrable tensor of the pool: ``rows[b]`` is the slot of block ``b``.

    Block-major pools have one per group (``layer`` None, name = group name); layer-major
    pools one per group and layer (name ``"{group}@{layer}"``).
    """

    name: str
    group: str
    layer: int | None
    rows: torch.Tensor
    slot_bytes: int

    def slot_region(self, pool_name: str) -> SlotRegion:
        t = self.rows
        kind = MemoryKind.DEVICE if t.is_cuda else MemoryKind.HOST
        return SlotRegion(
            name=f"{pool_name}/{self.name}", address=int(t.data_ptr()), slot_bytes=self.slot_bytes,
            slots=int(t.shape[0]), memory_kind=kind, device_id=(t.device.index or 0) if t.is_cuda else 0,
        )


@dataclass(eq=False)
class _Rows:
    """One request's blocks in one group: ``blocks[i]`` holds ordinal ``i``; ``filled[i]`` is
    the token end up to which that block holds valid KV (``i * block_tokens`` = nothing).
    STATE groups hold one block; ``filled[0]`` is the position its state is at, -1 if none."""

    blocks: np.ndarray = field(default_factory=lambda: _EMPTY.copy())
    filled: np.ndarray = field(default_factory=lambda: _EMPTY.copy())


@dataclass(eq=False)
class _Request:
    name: str
    tokens: int
    rows: dict[str, _Rows]
    shrinks: list[tuple[int, int]] = field(default_factory=list)  # (epoch, new end)
    epoch: int = 0


class PagedKVPool:
    """Paged KV cache: one tensor per layer group, block tables per request."""

    def __init__(
        self,
        groups: Sequence[LayerGroupSpec],
        num_blocks: int | Mapping[str, int],
        *,
        device: str | torch.device = "cpu",
        layout: Layout = Layout.BLOCK_MAJOR,
        scope: bytes = b"",
        tp: tuple[int, int] = (1, 0),
        name: str = "kv",
    ) -> None:
        specs = tuple(groups)
        if not specs or not all(isinstance(g, LayerGroupSpec) for g in specs):
            raise ValueError("a pool needs at least one LayerGroupSpec")
        names = [g.name for g in specs]
        if len(set(names)) != len(names):
            raise ValueError(f"layer group names repeat: {names}")
        if not isinstance(layout, Layout):
            raise TypeError(f"layout must be a Layout, got {layout!r}")
        self.name = name
        self.device = torch.device(device)
        self.layout = layout
        self.tp = tp
        self._specs = {g.name: g for g in specs}
        self._order = tuple(specs)
        self._scope = scope
        self._identity = layout_identity(specs, layout, tp, scope)
        counts = {g.name: (num_blocks if isinstance(num_blocks, int) else num_blocks[g.name]) for g in specs}
        self._alloc = {g: BlockAllocator(g, n) for g, n in counts.items()}
        self._storage: dict[str, torch.Tensor] = {}
        regions: list[RowRegion] = []
        for g in specs:
            shape_tail = (2, g.block_tokens, g.kv_heads, g.head_dim)
            if layout is Layout.BLOCK_MAJOR:
                t = torch.zeros((counts[g.name], g.layers, *shape_tail), dtype=g.dtype, device=self.device)
                regions.append(RowRegion(g.name, g.name, None, t, g.row_bytes))
            else:
                t = torch.zeros((g.layers, counts[g.name], *shape_tail), dtype=g.dtype, device=self.device)
                regions.extend(RowRegion(f"{g.name}@{i}", g.name, i, t[i], g.layer_block_bytes)
                               for i in range(g.layers))
            self._storage[g.name] = t
        self._row_regions = tuple(regions)
        self._requests: dict[str, _Request] = {}
        self._listeners: list[PoolListener] = []
        self._reuse_reset = False

    # --- description --------------------------------------------------------------------
    @property
    def groups(self) -> tuple[LayerGroupSpec, ...]:
        return self._order

    def group(self, name: str) -> LayerGroupSpec:
        try:
            return self._specs[name]
        except KeyError:
            raise KeyError(f"pool {self.name!r} has no layer group {name!r}; it has {list(self._specs)}") from None

    @property
    def identity(self) -> bytes:
        """The layout identity (see ``kvxfer.pool.identity``); views carry it as ``layout``."""
        return self._identity

    @property
    def scope(self) -> bytes:
        return self._scope

    @property
    def reuse_was_reset(self) -> bool:
        """True once ``reset_reuse`` ran: lenders refuse to lend from this pool for good."""
        return self._reuse_reset

    def storage(self, group: str) -> torch.Tensor:
        self.group(group)
        return self._storage[group]

    def row_regions(self) -> tuple[RowRegion, ...]:
        return self._row_regions

    def slot_regions(self) -> tuple[SlotRegion, ...]:
        """The pool's tensors as SlotRegions (DEVICE on CUDA, HOST on CPU), for ``register``."""
        return tuple(r.slot_region(self.name) for r in self._row_regions)

    def layer_kv(self, group: str, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(K, V) views of one layer, each ``[blocks, block_tokens, kv_heads, head_dim]``.

        Index the first dimension with a block table; writes go straight into the pool.
        """
        spec = self.group(group)
        if not 0 <= layer < spec.layers:
            raise IndexError(f"group {group!r} has {spec.layers} layers, no layer {layer}")
        t = self._storage[group]
        per_layer = t[:, layer] if self.layout is Layout.BLOCK_MAJOR else t[layer]
        return per_layer[:, 0], per_layer[:, 1]

    def allocator(self, group: str) -> BlockAllocator:
        self.group(group)
        return self._alloc[group]

    # --- requests -------------------------------------------------------------------------
    def has(self, request: str) -> bool:
        return request in self._requests

    @property
    def requests(self) -> tuple[str, ...]:
        return tuple(self._requests)

    def _get(self, request: str) -> _Request:
        req = self._requests.get(request)
        if req is None:
            raise UnknownRequest(f"pool {self.name!r} holds no request {request!r} (never allocated, or freed)")
        return req

    def length(self, request: str) -> int:
        """Tokens the request has room for (its allocated length)."""
        return self._get(request).tokens

    def block_table(self, request: str, group: str) -> np.ndarray:
        """The request's blocks in ``group``, by ordinal: a read-only int64 copy."""
        self.group(group)
        out = self._get(request).rows[group].blocks.copy()
        out.flags.writeable = False
        return out

    def block_table_tensor(self, request: str, group: str) -> torch.Tensor:
        """The block table as an int64 tensor on the pool's device (for indexing ``layer_kv``)."""
        self.group(group)
        return torch.from_numpy(self._get(request).rows[group].blocks.copy()).to(self.device)

    def filled(self, request: str, group: str) -> np.ndarray:
        """Per ordinal, the token end up to which the block holds valid KV (read-only copy)."""
        self.group(group)
        out = self._get(request).rows[group].filled.copy()
        out.flags.writeable = False
        return out

    def allocate(self, request: str, tokens: int, token_ids: Any = None) -> int:
        """Create ``request`` with room for ``tokens`` tokens; returns the reused prefix tokens.

        With ``token_ids`` (at least the prompt), full blocks whose chained name is cached
        are shared instead of allocated and count as filled. Reuse is per group; the
        returned figure is the prefix valid in every group (STATE groups reuse nothing, so
        a pool with one returns 0). All or nothing: PoolExhausted leaves the pool unchanged.
        """
        if not isinstance(request, str) or not request:
            raise ValueError(f"request must be a non-empty str, got {request!r}")
        if request in self._requests:
            raise ValueError(f"request {request!r} is already allocated in pool {self.name!r}")
        tokens = _tokens(tokens)
        shared: dict[str, np.ndarray] = {}
        for spec in self._order:
            shared[spec.name] = _EMPTY
            if token_ids is not None and spec.kind is CacheKind.PAGED:
                ids = np.asarray(token_ids, dtype=np.int64)[:tokens]
                alloc = self._alloc[spec.name]
                hits = []
                for key in block_names(self._identity, spec.name, spec.block_tokens, ids):
                    block = alloc.lookup(key)
                    if block is None:
                        break
                    hits.append(block)
                shared[spec.name] = np.asarray(hits, dtype=np.int64)
        for spec in self._order:  # check every group before touching any
            need = spec.blocks_for(tokens) - shared[spec.name].size
            have = self._alloc[spec.name].available(shared[spec.name])
            if need > have:
                raise PoolExhausted(f"group {spec.name!r}: request {request!r} needs {need} new blocks, {have} available")
        rows: dict[str, _Rows] = {}
        reused = tokens
        for spec in self._order:
            alloc = self._alloc[spec.name]
            hit = shared[spec.name]
            alloc.share(hit)
            fresh = alloc.take(spec.blocks_for(tokens) - hit.size)
            blocks = np.concatenate((hit, fresh))
            if spec.kind is CacheKind.STATE:
                filled = np.full(1, -1, dtype=np.int64)
                reused = 0
            else:
                filled = np.arange(blocks.size, dtype=np.int64) * spec.block_tokens
                filled[: hit.size] += spec.block_tokens
                reused = min(reused, hit.size * spec.block_tokens)
            rows[spec.name] = _Rows(blocks, filled)
        self._requests[request] = _Request(request, tokens, rows)
        return reused

    def grow(self, request: str, tokens: int) -> None:
        """Make room for ``tokens`` tokens in total (never shrinks). All or nothing."""
        req = self._get(request)
        tokens = _tokens(tokens)
        if tokens <= req.tokens:
            return
        needs = {s.name: s.blocks_for(tokens) - req.rows[s.name].blocks.size for s in self._order}
        for spec in self._order:
            if needs[spec.name] > self._alloc[spec.name].available():
                raise PoolExhausted(f"group {spec.name!r}: growing {request!r} to {tokens} tokens needs "
                                    f"{needs[spec.name]} blocks, {self._alloc[spec.name].available()} available")
        for spec in self._order:
            if needs[spec.name] <= 0:
                continue
            rows = req.rows[spec.name]
            fresh = self._alloc[spec.name].take(needs[spec.name])
            start = rows.blocks.size
            rows.blocks = np.concatenate((rows.blocks, fresh))
            rows.filled = np.concatenate(
                (rows.filled, np.arange(start, start + fresh.size, dtype=np.int64) * spec.block_tokens))
        req.tokens = tokens

    def shrink(self, request: str, tokens: int) -> None:
        """Cut the request to ``tokens`` tokens. KV past the new end is void for good (even
        rows a lease later reports arrived); blocks past it are freed once no lease pins them,
        and a block the new end cuts into loses its prefix name (its tail gets rewritten)."""
        req = self._get(request)
        tokens = _tokens(tokens)
        if tokens > req.tokens:
            raise ValueError(f"shrink of {request!r} to {tokens} tokens: it holds only {req.tokens}")
        req.epoch += 1
        req.shrinks.append((req.epoch, tokens))
        for spec in self._order:
            rows = req.rows[spec.name]
            if spec.kind is CacheKind.STATE:
                if rows.filled[0] > tokens:
                    rows.filled[0] = -1
                continue
            keep = spec.blocks_for(tokens)
            cut = rows.blocks[keep:]
            if tokens % spec.block_tokens:
                # The last kept block is now partial and its tail will be rewritten: its name
                # (a full block of the old tokens) must not let another request share it.
                self._alloc[spec.name].unname(rows.blocks[keep - 1: keep])
            rows.blocks = rows.blocks[:keep].copy()
            base = np.arange(keep, dtype=np.int64) * spec.block_tokens
            rows.filled = np.maximum(base, np.minimum(rows.filled[:keep], tokens))
            self._alloc[spec.name].drop(cut)
        req.tokens = tokens
        for listener in list(self._listeners):
            listener.on_shrink(request, tokens)

    def free(self, request: str) -> None:
        """Drop the request; its blocks return once no other request or lease holds them."""
        req = self._get(request)
        for listener in list(self._listeners):
            listener.on_free(request)
        del self._requests[request]
        for spec in self._order:
            self._alloc[spec.name].drop(req.rows[spec.name].blocks)

    def commit(self, request: str, end: int, token_ids: Any = None, groups: Any = None) -> None:
        """Record that KV for tokens ``[0, end)`` is written (STATE groups: the state is at
        ``end``). With ``token_ids``, full filled blocks become shareable prefixes. ``groups``
        (names): only those groups, as a forward that has written some layers' KV so far."""
        req = self._get(request)
        end = _tokens(end)
        if end > req.tokens:
            raise ValueError(f"commit of {request!r} to {end} tokens: it holds only {req.tokens}")
        chosen = self._order if groups is None else [self.group(g) for g in groups]
        for spec in chosen:
            rows = req.rows[spec.name]
            if spec.kind is CacheKind.STATE:
                rows.filled[0] = end
                continue
            n = spec.blocks_for(end)
            upto = np.minimum((np.arange(n, dtype=np.int64) + 1) * spec.block_tokens, end)
            rows.filled[:n] = np.maximum(rows.filled[:n], upto)
            if token_ids is not None:
                self._name_blocks(req, spec, np.asarray(token_ids, dtype=np.int64)[:end])

    def _name_blocks(self, req: _Request, spec: LayerGroupSpec, ids: np.ndarray) -> None:
        rows = req.rows[spec.name]
        alloc = self._alloc[spec.name]
        full = (np.arange(rows.blocks.size) + 1) * spec.block_tokens
        for i, key in enumerate(block_names(self._identity, spec.name, spec.block_tokens, ids)):
            if i >= rows.blocks.size or rows.filled[i] < full[i]:
                break
            alloc.name(int(rows.blocks[i]), key)

    def record_arrival(self, request: str, group: str, ordinals: np.ndarray, ends: np.ndarray) -> None:
        """Lender hook: blocks ``ordinals`` of ``group`` now hold valid KV up to ``ends``."""
        rows = self._get(request).rows[group]
        if self._specs[group].kind is CacheKind.STATE:
            if ordinals.size:
                rows.filled[0] = int(ends[-1])
            return
        ok = ordinals < rows.blocks.size
        o = ordinals[ok]
        rows.filled[o] = np.maximum(rows.filled[o], ends[ok])

    def shrink_epoch(self, request: str) -> int:
        return self._get(request).epoch

    def shrink_cap(self, request: str, since_epoch: int) -> int | None:
        """The lowest end the request was shrunk to after ``since_epoch`` (None if never)."""
        ends = [end for epoch, end in self._get(request).shrinks if epoch > since_epoch]
        return min(ends) if ends else None

    # --- the model's side ------------------------------------------------------------------
    def slots_for(self, request: str, group: str, positions: Any) -> tuple[np.ndarray, np.ndarray]:
        """(block, offset) int64 arrays for token ``positions`` of a PAGED group."""
        spec = self.group(group)
        if spec.kind is not CacheKind.PAGED:
            raise ValueError(f"group {group!r} is {spec.kind.name}: it has no token positions")
        pos = np.asarray(positions, dtype=np.int64)
        req = self._get(request)
        if pos.size and (pos.min() < 0 or pos.max() >= req.tokens):
            raise IndexError(f"positions outside [0, {req.tokens}) of request {request!r}")
        blocks = req.rows[group].blocks[pos // spec.block_tokens]
        return blocks, pos % spec.block_tokens

    def write_kv(self, request: str, group: str, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write K and V (``[n, kv_heads, head_dim]``) for tokens ``[start, start + n)``.

        Refuses blocks shared with another request (copy on write is not offered) and
        blocks pinned by a lease; a block it writes loses its prefix name (its bytes change).
        Call ``commit`` once every layer of the tokens is written.
        """
        n = int(k.shape[0])
        kt, vt = self.layer_kv(group, layer)
        want = (n, *kt.shape[2:])  # torch would broadcast a smaller shape into every token silently
        if tuple(k.shape) != want or tuple(v.shape) != want:
            raise ValueError(f"write_kv: k and v must be [n, kv_heads, head_dim] = {list(want)} for group {group!r}, "
                             f"got k {list(k.shape)} and v {list(v.shape)}")
        blocks, offsets = self.slots_for(request, group, np.arange(start, start + n))
        alloc = self._alloc[group]
        what = f"request {request!r}: tokens [{start}, {start + n}) of group {group!r}"
        if (alloc.pins[blocks] > 0).any():
            raise ValueError(f"{what} lie in blocks a lease holds")
        alloc.claim_for_write(np.unique(blocks), what)
        b = torch.from_numpy(blocks).to(kt.device)
        o = torch.from_numpy(offsets).to(kt.device)
        kt[b, o] = k.to(device=kt.device, dtype=kt.dtype)
        vt[b, o] = v.to(device=vt.device, dtype=vt.dtype)

    def read_kv(self, request: str, group: str, layer: int, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V (``[end - start, kv_heads, head_dim]``, copies) for tokens ``[start, end)``."""
        blocks, offsets = self.slots_for(request, group, np.arange(start, end))
        kt, vt = self.layer_kv(group, layer)
        b = torch.from_numpy(blocks).to(kt.device)
        o = torch.from_numpy(offsets).to(kt.device)
        return kt[b, o], vt[b, o]

    def state(self, request: str, group: str) -> torch.Tensor:
        """The request's STATE slot, ``[layers, 2, block_tokens, kv_heads, head_dim]`` (a view)."""
        spec = self.group(group)
        if spec.kind is not CacheKind.STATE:
            raise ValueError(f"group {group!r} is PAGED, not STATE")
        block = int(self._get(request).rows[group].blocks[0])
        t = self._storage[group]
        return t[block] if self.layout is Layout.BLOCK_MAJOR else t[:, block]

    # --- lifecycle ---------------------------------------------------------------------------
    def add_listener(self, listener: PoolListener) -> None:
        self._listeners.append(listener)

    def remove_listener(self, listener: PoolListener) -> None:
        if listener in self._listeners:
            self._listeners.remove(listener)

    def reset_reuse(self, scope: bytes | None = None) -> None:
        """Forget every shared prefix (weights or adapters changed); ``scope`` replaces the
        caller's scope, so the layout identity changes. Listeners (lenders) are told, and no
        lender lends from this pool again (one built later refuses too)."""
        for alloc in self._alloc.values():
            alloc.reset_names()
        self._reuse_reset = True
        if scope is not None:
            self._scope = scope
            self._identity = layout_identity(self._order, self.layout, self.tp, scope)
        for listener in list(self._listeners):
            listener.on_reuse_reset(self._scope)

    def stats(self) -> dict[str, dict[str, int]]:
        return {
            g: {"blocks": a.num_blocks, "free": a.free_count, "cached": a.cached_count,
                "pinned": int((a.pins > 0).sum()), "retained": int(a.retained.sum())}
            for g, a in self._alloc.items()
        }


def _tokens(value: Any) -> int:
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 0:
        raise ValueError(f"token count must be a non-negative int, got {value!r}")
    return int(value)
