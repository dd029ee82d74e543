"""Tensor parallelism by KV heads: which rank holds which heads, and a TP group's pools.

A TP group of ``tp`` ranks splits the model's ``kv_heads`` KV heads. With ``tp <= kv_heads``
rank ``r`` holds heads ``[r * kv_heads // tp, (r + 1) * kv_heads // tp)``; with more ranks
than heads every rank holds exactly one head, replicated as vLLM does: rank ``r`` holds head
``r * kv_heads // tp``, so ``tp // kv_heads`` neighbouring ranks share each head when
``tp`` is a multiple of ``kv_heads``::

    from kvxfer.engine import LlamaModel, ModelConfig, ShardedKVCache, kv_head_range
    kv_head_range(8, 4, 1)                    # (2, 4)
    kv_head_range(2, 4, 3)                    # (1, 2): ranks 2 and 3 both hold head 1
    cache = ShardedKVCache.create(cfg, tp=2, num_blocks=64, block_tokens=32, layout=Layout.LAYER_MAJOR)
    cache.allocate("r", 40)
    token = model.next_token(cache, "r", prompt, 0)     # K/V of each rank's heads in its pool

Each rank owns a ``PagedKVPool`` whose group holds only its heads and whose layout identity
names its shard (``tp=(tp, rank)``), so a transfer never mixes two ranks' bytes. Block size
and layout are the group's choice, not the model's: the two ends of a transfer may page
differently. The group allocates, grows, commits and frees a request in every rank's pool
together (same token length; the block ids may differ per rank).

This is the KV side of tensor parallelism, run in one process: the projections and the
MLP are computed once, in full, and only the K/V (and so attention's reads) is sharded.
The model computes attention one KV head at a time in every mode (see
``LlamaModel._attention``), so a TP group produces exactly the colocated run's tokens and
its ranks hold exactly the matching head slices of the colocated pool's bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvxfer.engine.config import ModelConfig
from kvxfer.pool import Layout, PagedKVPool, PoolExhausted


def _positive(name: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def kv_head_range(kv_heads: int, tp: int, rank: int) -> tuple[int, int]:
    """The KV heads ``[start, end)`` that rank ``rank`` of a ``tp``-way group holds.

    ``tp <= kv_heads``: a contiguous share (sizes differ by at most one when ``tp`` does not
    divide ``kv_heads``). ``tp > kv_heads``: one head, ``rank * kv_heads // tp``, replicated.
    """
    _positive("kv_heads", kv_heads)
    _positive("tp", tp)
    if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < tp:
        raise ValueError(f"rank must be an int in [0, {tp}), got {rank!r}")
    if tp <= kv_heads:
        return rank * kv_heads // tp, (rank + 1) * kv_heads // tp
    head = rank * kv_heads // tp
    return head, head + 1


@dataclass(frozen=True)
class KVShard:
    """One rank's share of the KV heads: heads ``[start, end)`` of ``kv_heads``."""

    kv_heads: int
    tp: int
    rank: int
    start: int
    end: int

    def __post_init__(self) -> None:
        want = kv_head_range(self.kv_heads, self.tp, self.rank)
        if (self.start, self.end) != want:
            raise ValueError(f"rank {self.rank} of {self.tp} holds KV heads {want} of {self.kv_heads}, "
                             f"not ({self.start}, {self.end})")

    @classmethod
    def of(cls, kv_heads: int, tp: int, rank: int) -> KVShard:
        start, end = kv_head_range(kv_heads, tp, rank)
        return cls(kv_heads, tp, rank, start, end)

    @property
    def heads(self) -> int:
        """How many KV heads the rank holds (its pool's ``kv_heads``)."""
        return self.end - self.start

    @property
    def replicated(self) -> bool:
        """True when other ranks hold the same head (more ranks than KV heads)."""
        return self.tp > self.kv_heads

    def holds(self, head: int) -> bool:
        return self.start <= head < self.end

    def local(self, head: int) -> int:
        """The index of KV head ``head`` in this rank's pool."""
        if not self.holds(head):
            raise ValueError(f"rank {self.rank} of {self.tp} holds KV heads [{self.start}, {self.end}), not {head}")
        return head - self.start


def kv_shards(kv_heads: int, tp: int) -> tuple[KVShard, ...]:
    """Every rank's shard, by rank."""
    return tuple(KVShard.of(kv_heads, _positive("tp", tp), rank) for rank in range(tp))


class ShardedKVCache:
    """The KV cache of a TP group: one ``PagedKVPool`` per rank, each holding its rank's KV
    heads; requests are allocated, grown, committed and freed in all of them together.

    A single pool (TP 1) is the group ``ShardedKVCache([pool], kv_heads)``; that is how
    ``LlamaModel.forward`` reads any cache. Not thread-safe, like the pools.
    """

    def __init__(self, pools: Sequence[PagedKVPool], kv_heads: int) -> None:
        pools = tuple(pools)
        if not pools or not all(isinstance(p, PagedKVPool) for p in pools):
            raise ValueError("a ShardedKVCache needs one PagedKVPool per rank")
        self.kv_heads = _positive("kv_heads", kv_heads)
        self.shards = kv_shards(kv_heads, len(pools))
        self.pools = pools
        for shard, pool in zip(self.shards, pools):
            self._check_pool(shard, pool)
        # Replicated heads are read from the first rank that holds them.
        self.holders = tuple(next(s.rank for s in self.shards if s.holds(h)) for h in range(kv_heads))
        # Layer l lives in group where[l] at local index l - first of that group: one group of
        # every layer, or the contiguous groups of layer-wise streaming (ModelConfig.make_pool).
        self.layer_groups = tuple(g.name for g in pools[0].groups)
        self._where = tuple((g.name, layer) for g in pools[0].groups for layer in range(g.layers))

    def _check_pool(self, shard: KVShard, pool: PagedKVPool) -> None:
        where = f"pool {pool.name!r} (rank {shard.rank} of {shard.tp})"
        names = [g.name for g in pool.groups]
        if names != [g.name for g in self.pools[0].groups]:
            raise ValueError(f"{where} has layer groups {names}, rank 0 {[g.name for g in self.pools[0].groups]}")
        spec, first = pool.groups[0], self.pools[0].groups[0]
        if pool.tp != (shard.tp, shard.rank):
            raise ValueError(f"{where} has tp={pool.tp}; build it with tp=({shard.tp}, {shard.rank})")
        if spec.kv_heads != shard.heads:
            raise ValueError(f"{where} holds {spec.kv_heads} KV heads; the rank holds {shard.heads} "
                             f"(heads [{shard.start}, {shard.end}) of {shard.kv_heads})")
        if (spec.layers, spec.head_dim, spec.dtype) != (first.layers, first.head_dim, first.dtype):
            raise ValueError(f"{where}: layers, head_dim and dtype must match rank 0's")
        if pool.device != self.pools[0].device:
            raise ValueError(f"{where} is on {pool.device}, rank 0 on {self.pools[0].device}")

    @classmethod
    def create(cls, config: ModelConfig, tp: int, num_blocks: int, *, block_tokens: int | None = None,
               layout: Layout = Layout.BLOCK_MAJOR, device: str | torch.device = "cpu",
               name: str = "kv") -> ShardedKVCache:
        """One pool per rank, made by ``config`` with the rank's head count and ``tp=(tp, rank)``.

        ``block_tokens`` (default: the config's) and ``layout`` are the group's: every rank
        pages the same way, but the other end of a transfer may choose otherwise.
        """
        pools = [config.make_pool(num_blocks, device=str(device), name=f"{name}-tp{s.rank}", kv_heads=s.heads,
                                  block_tokens=block_tokens, layout=layout, tp=(tp, s.rank))
                 for s in kv_shards(config.kv_heads, tp)]
        return cls(pools, config.kv_heads)

    @classmethod
    def of(cls, cache: PagedKVPool | ShardedKVCache, kv_heads: int) -> ShardedKVCache:
        """``cache`` itself, or a single pool as a group of one (it must hold all ``kv_heads``)."""
        if isinstance(cache, ShardedKVCache):
            if cache.kv_heads != kv_heads:
                raise ValueError(f"the TP group shards {cache.kv_heads} KV heads, the model has {kv_heads}")
            return cache
        return cls([cache], kv_heads)

    # --- description ------------------------------------------------------------------------
    @property
    def tp(self) -> int:
        return len(self.pools)

    @property
    def device(self) -> torch.device:
        return self.pools[0].device

    def pool(self, rank: int) -> PagedKVPool:
        return self.pools[rank]

    def shard(self, rank: int) -> KVShard:
        return self.shards[rank]

    def holder(self, head: int) -> int:
        """The rank attention reads KV head ``head`` from (the first that holds it)."""
        return self.holders[head]

    # --- requests, in every rank together -------------------------------------------------------
    def has(self, request: str) -> bool:
        return all(p.has(request) for p in self.pools)

    def length(self, request: str) -> int:
        """Tokens the request has room for (the same on every rank)."""
        lengths = {p.length(request) for p in self.pools}
        if len(lengths) != 1:
            raise RuntimeError(f"request {request!r} has different lengths on the ranks: {sorted(lengths)}")
        return lengths.pop()

    def allocate(self, request: str, tokens: int, token_ids: Any = None) -> int:
        """Room for ``tokens`` tokens on every rank. All or nothing: a rank that runs out
        (``PoolExhausted``) frees the request again on the ranks before it. A group shares no
        prompt prefixes (``token_ids`` must be None), so no token is reused: returns 0."""
        if token_ids is not None:
            raise ValueError("a TP group shares no prompt prefixes: allocate without token_ids")
        done: list[PagedKVPool] = []
        try:
            for pool in self.pools:
                pool.allocate(request, tokens)
                done.append(pool)
        except BaseException:
            for pool in done:
                pool.free(request)
            raise
        return 0

    def grow(self, request: str, tokens: int) -> None:
        """Room for ``tokens`` tokens in total on every rank (never shrinks). All or nothing."""
        for rank, pool in enumerate(self.pools):
            for spec in pool.groups:
                need = spec.blocks_for(tokens) - pool.block_table(request, spec.name).size
                have = pool.allocator(spec.name).available()
                if need > have:
                    raise PoolExhausted(f"rank {rank}: growing {request!r} to {tokens} tokens needs {need} blocks "
                                        f"of group {spec.name!r}, {have} available")
        for pool in self.pools:
            pool.grow(request, tokens)

    def commit(self, request: str, end: int, token_ids: Any = None) -> None:
        if token_ids is not None:
            raise ValueError("a TP group shares no prompt prefixes: commit without token_ids")
        for pool in self.pools:
            pool.commit(request, end)

    def commit_group(self, request: str, group: str, end: int) -> None:
        """Record that ``group``'s KV for tokens ``[0, end)`` is written on every rank (its
        layers done, later ones still computing)."""
        for pool in self.pools:
            pool.commit(request, end, groups=(group,))

    def group_of(self, layer: int) -> tuple[str, int]:
        """The group holding model layer ``layer``, and the layer's index within it."""
        return self._where[layer]

    def stats(self) -> dict[str, dict[str, int]]:
        """Each rank pool's block counts, its groups named ``r{rank}/{group}``."""
        return {f"r{rank}/{group}": counts for rank, pool in enumerate(self.pools)
                for group, counts in pool.stats().items()}

    def free(self, request: str) -> None:
        for pool in self.pools:
            pool.free(request)

    # --- the model's side --------------------------------------------------------------------
    def write_kv(self, request: str, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write K and V of all heads (``[n, kv_heads, head_dim]``): each rank gets its heads."""
        group, local = self._where[layer]
        for shard, pool in zip(self.shards, self.pools):
            pool.write_kv(request, group, local, start, k[:, shard.start:shard.end], v[:, shard.start:shard.end])

    def reader(self, request: str, end: int) -> HeadReader:
        """Reads tokens ``[0, end)`` of ``request`` back, head by head, layer by layer."""
        tables = {}
        for rank in sorted(set(self.holders)):
            pool = self.pools[rank]
            # Every group of a pool pages alike; each keeps its own blocks.
            for group in self.layer_groups:
                blocks = pool.group(group).blocks_for(end)
                tables[(rank, group)] = pool.block_table_tensor(request, group)[:blocks]
        return HeadReader(self, tables, end)


@dataclass(frozen=True)
class HeadReader:
    """One forward's view of a request's K/V: its block tables, read once, per reading rank."""

    cache: ShardedKVCache
    tables: dict[tuple[int, str], torch.Tensor]  # (rank, group): the request's blocks there
    end: int

    def heads(self, layer: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(K, V) of every KV head in head order, each a contiguous ``[end, head_dim]`` copy
        read from the head's holder. Contiguous, so a head's attention sees the same memory
        layout whichever rank, and however many heads, its bytes came from."""
        per_rank = {}
        group, local = self.cache.group_of(layer)
        for (rank, name), table in self.tables.items():
            if name != group:
                continue
            pool = self.cache.pools[rank]
            kt, vt = pool.layer_kv(group, local)
            shape = (-1, *kt.shape[2:])  # [tokens, rank's kv_heads, head_dim]
            per_rank[rank] = kt[table].reshape(shape)[: self.end], vt[table].reshape(shape)[: self.end]
        out = []
        for head, rank in enumerate(self.cache.holders):
            keys, values = per_rank[rank]
            j = self.cache.shards[rank].local(head)
            out.append((keys[:, j].contiguous(), values[:, j].contiguous()))
        return out
