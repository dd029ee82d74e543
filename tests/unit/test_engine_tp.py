"""Tensor parallelism by KV heads: head ranges, the TP group's pools, and the invariant that
a TP run is token-identical to the colocated one and holds exactly its KV bytes, head by head,
whatever block size and layout the group pages with."""

from __future__ import annotations

import functools

import pytest
import torch

from kvxfer.engine import (
    GROUP,
    KVShard,
    LlamaModel,
    ModelConfig,
    ShardedKVCache,
    colocated_generate,
    decode,
    kv_head_range,
    kv_shards,
    synthetic_prompts,
    tokens_needed,
    tp_generate,
)
from kvxfer.pool import Layout, PagedKVPool, PoolExhausted

torch.set_num_threads(1)
CFG = ModelConfig(vocab_size=128, hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, intermediate=96,
                  block_tokens=16)
NEW = 6
# Lengths around the 16- and 32-token block edges, so partial and exactly full last blocks occur.
PROMPTS = [*synthetic_prompts(3, 5, 40, CFG.vocab_size, seed=11), synthetic_prompts(1, 32, 32, CFG.vocab_size)[0]]
GROUPS = [(tp, bt, layout) for tp in (1, 2, 4) for bt in (16, 32) for layout in Layout]


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


@functools.cache
def model() -> LlamaModel:
    return LlamaModel(CFG)


@functools.cache
def oracle(i: int) -> tuple[int, ...]:
    return tuple(colocated_generate(model(), PROMPTS[i], NEW))


def run(kv: PagedKVPool | ShardedKVCache, prompt: list[int]) -> list[int]:
    """Prefill then decode, leaving the request's K/V in ``kv`` (a pool or a TP group)."""
    kv.allocate("r", tokens_needed(len(prompt), NEW))
    first = model().next_token(kv, "r", prompt, 0)
    return [first, *decode(model(), kv, "r", first, len(prompt), NEW)]


# --- head ranges ------------------------------------------------------------------------------

def test_kv_head_range_splits_and_replicates() -> None:
    assert [kv_head_range(8, 4, r) for r in range(4)] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert [kv_head_range(2, 1, 0)] == [(0, 2)]
    assert [kv_head_range(2, 2, r) for r in range(2)] == [(0, 1), (1, 2)]
    assert [kv_head_range(2, 4, r) for r in range(4)] == [(0, 1), (0, 1), (1, 2), (1, 2)]  # replicated
    assert [kv_head_range(3, 2, r) for r in range(2)] == [(0, 1), (1, 3)]  # uneven, every head once
    assert [kv_head_range(1, 4, r) for r in range(4)] == [(0, 1)] * 4
    for bad in ((2, 2, 2), (2, 0, 0), (0, 1, 0), (2, 2, -1)):
        with pytest.raises(ValueError):
            kv_head_range(*bad)


def test_shards_describe_the_ranks() -> None:
    shards = kv_shards(2, 4)
    assert [s.rank for s in shards] == [0, 1, 2, 3] and all(s.heads == 1 and s.replicated for s in shards)
    assert shards[3].holds(1) and not shards[3].holds(0) and shards[3].local(1) == 0
    assert KVShard.of(8, 4, 1) == KVShard(8, 4, 1, 2, 4) and not KVShard.of(8, 4, 1).replicated
    with pytest.raises(ValueError, match="holds KV heads"):
        KVShard(8, 4, 1, 0, 2)
    with pytest.raises(ValueError, match="not 0"):
        shards[3].local(0)


# --- the group's pools --------------------------------------------------------------------------

def test_each_rank_pool_holds_its_heads_under_its_own_identity() -> None:
    cache = ShardedKVCache.create(CFG, 4, 8, block_tokens=32, layout=Layout.LAYER_MAJOR)
    assert cache.tp == 4 and cache.holders == (0, 2)
    for rank, pool in enumerate(cache.pools):
        spec = pool.group(GROUP)
        assert pool.tp == (4, rank) and spec.kv_heads == 1 and spec.block_tokens == 32
        assert pool.layout is Layout.LAYER_MAJOR and pool.scope == CFG.scope()
    assert len({p.identity for p in cache.pools}) == 4
    assert CFG.make_pool(8).identity not in {p.identity for p in cache.pools}
    two = ShardedKVCache.create(CFG, 2, 8)
    assert [p.group(GROUP).kv_heads for p in two.pools] == [1, 1] and two.holders == (0, 1)
    assert ShardedKVCache.create(CFG, 1, 8).pool(0).identity == CFG.make_pool(8).identity


def test_group_refuses_pools_that_do_not_fit_their_rank() -> None:
    with pytest.raises(ValueError, match=r"tp=\(1, 0\)"):
        ShardedKVCache([CFG.make_pool(4, kv_heads=1), CFG.make_pool(4, kv_heads=1, tp=(2, 1))], CFG.kv_heads)
    with pytest.raises(ValueError, match="holds 2 KV heads"):
        ShardedKVCache([CFG.make_pool(4, tp=(2, 0)), CFG.make_pool(4, kv_heads=1, tp=(2, 1))], CFG.kv_heads)
    rank0 = CFG.make_pool(4, kv_heads=1, tp=(2, 0))
    pool = CFG.make_pool(4)
    pool.allocate("r", 3)
    with pytest.raises(ValueError, match=r"tp=\(2, 0\)"):  # one rank's pool is not a whole model's
        model().forward(rank0, "r", [1, 2, 3], 0)
    with pytest.raises(ValueError, match="shards 2 KV heads, the model has 4"):
        LlamaModel(CFG.with_(kv_heads=4)).forward(ShardedKVCache.create(CFG, 2, 4), "r", [1], 0)


def test_requests_live_in_every_rank_together() -> None:
    cache = ShardedKVCache.create(CFG, 2, 4, block_tokens=4)
    cache.pool(1).allocate("filler", 4)  # rank 1 has one block fewer, and other block ids
    cache.allocate("a", 9)
    assert cache.has("a") and cache.length("a") == 9
    assert list(cache.pool(0).block_table("a", GROUP)) != list(cache.pool(1).block_table("a", GROUP))
    with pytest.raises(PoolExhausted):  # rank 0 could, rank 1 cannot: neither keeps it
        cache.allocate("b", 4)
    assert not cache.pool(0).has("b") and not cache.pool(1).has("b")
    with pytest.raises(PoolExhausted, match="rank 1"):
        cache.grow("a", 13)
    assert cache.length("a") == 9 and cache.pool(0).block_table("a", GROUP).size == 3
    cache.pool(1).free("filler")
    cache.grow("a", 13)
    assert cache.length("a") == 13
    cache.free("a")
    assert not cache.pool(0).has("a") and not cache.pool(1).has("a")


# --- the invariant: TP is the colocated run, token for token and byte for byte -----------------------

def test_colocated_generation_is_deterministic() -> None:
    for i, prompt in enumerate(PROMPTS):
        assert colocated_generate(model(), prompt, NEW) == list(oracle(i))
    pools = [CFG.make_pool(4), CFG.make_pool(4)]
    logits = []
    for pool in pools:
        pool.allocate("r", len(PROMPTS[0]))
        logits.append(model().forward(pool, "r", PROMPTS[0], 0))
    assert same_bytes(*logits)


@pytest.mark.parametrize(("tp", "block_tokens", "layout"), GROUPS)
def test_tp_generation_is_token_identical_to_colocated(tp: int, block_tokens: int, layout: Layout) -> None:
    for i, prompt in enumerate(PROMPTS):
        got = tp_generate(model(), prompt, NEW, tp, block_tokens=block_tokens, layout=layout)
        assert got == list(oracle(i)), f"prompt {i} (length {len(prompt)})"


@pytest.mark.parametrize(("tp", "block_tokens", "layout"), GROUPS)
def test_each_rank_holds_exactly_its_head_slice_of_the_colocated_kv(tp: int, block_tokens: int,
                                                                   layout: Layout) -> None:
    prompt = PROMPTS[1]
    end = tokens_needed(len(prompt), NEW)
    colo = CFG.make_pool(-(-end // CFG.block_tokens))
    want_tokens = run(colo, prompt)
    cache = ShardedKVCache.create(CFG, tp, 8, block_tokens=block_tokens, layout=layout)
    cache.pool(tp - 1).allocate("filler", 5)  # the last rank's blocks sit elsewhere
    assert run(cache, prompt) == want_tokens
    for layer in range(CFG.layers):
        k_all, v_all = colo.read_kv("r", GROUP, layer, 0, end)  # gathered in token order
        for shard, pool in zip(cache.shards, cache.pools):
            k, v = pool.read_kv("r", GROUP, layer, 0, end)
            assert same_bytes(k, k_all[:, shard.start:shard.end]), f"K, layer {layer}, rank {shard.rank}"
            assert same_bytes(v, v_all[:, shard.start:shard.end]), f"V, layer {layer}, rank {shard.rank}"


def test_a_replicated_head_is_the_same_bytes_on_every_rank_holding_it() -> None:
    cache = ShardedKVCache.create(CFG, 4, 8, block_tokens=32, layout=Layout.LAYER_MAJOR)
    prompt = PROMPTS[2]
    run(cache, prompt)
    end = tokens_needed(len(prompt), NEW)
    for a, b in ((0, 1), (2, 3)):
        assert cache.shard(a).start == cache.shard(b).start
        # Same allocations in fresh pools: the whole tensors match, unused blocks included.
        assert same_bytes(cache.pool(a).storage(GROUP), cache.pool(b).storage(GROUP))
        for layer in range(CFG.layers):
            for x, y in zip(cache.pool(a).read_kv("r", GROUP, layer, 0, end),
                            cache.pool(b).read_kv("r", GROUP, layer, 0, end)):
                assert same_bytes(x, y)
    assert not same_bytes(cache.pool(0).storage(GROUP), cache.pool(2).storage(GROUP))


def test_tp_prefill_resumes_and_decodes_like_colocated() -> None:
    """Chunked prefill over a group whose pools grow, as a decode side that resumes does."""
    prompt = PROMPTS[3]
    cache = ShardedKVCache.create(CFG, 2, 8, block_tokens=32)
    cache.allocate("r", 20)
    model().forward(cache, "r", prompt[:20], 0)
    cache.grow("r", tokens_needed(len(prompt), NEW))
    first = model().next_token(cache, "r", prompt[20:], 20)
    assert [first, *decode(model(), cache, "r", first, len(prompt), NEW)] == list(oracle(3))
    with pytest.raises(ValueError, match="tp=4 but the cache is a group of 2"):
        tp_generate(model(), prompt, NEW, 4, cache=cache)
