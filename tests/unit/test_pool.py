"""PagedKVPool: allocation, block tables, K/V round trip, prefix reuse, pins, identity."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvxfer.contract import CacheKind, MemoryKind
from kvxfer.pool import (
    IDENTITY_BYTES,
    LayerGroupSpec,
    Layout,
    PagedKVPool,
    PoolExhausted,
    UnknownRequest,
    block_names,
    layout_identity,
)

FULL = LayerGroupSpec("full", layers=2, block_tokens=4, kv_heads=2, head_dim=8)
SWA = LayerGroupSpec("swa", layers=1, block_tokens=8, kv_heads=1, head_dim=8, window=16, sink_blocks=1)
STATE = LayerGroupSpec("ssm", layers=1, block_tokens=1, kv_heads=1, head_dim=16, kind=CacheKind.STATE)


def make(groups=(FULL,), blocks=32, **kw) -> PagedKVPool:
    return PagedKVPool(list(groups), blocks, **kw)


def test_geometry_and_regions_block_major() -> None:
    pool = make((FULL, SWA))
    regions = pool.slot_regions()
    assert [r.name for r in regions] == ["kv/full", "kv/swa"]
    assert regions[0].slot_bytes == 2 * 2 * 4 * 2 * 8 * 2  # layers * KV * bt * heads * dim * fp16
    assert regions[0].slots == 32 and regions[0].memory_kind is MemoryKind.HOST
    assert regions[0].address == pool.storage("full").data_ptr()
    # one row is one contiguous slot: slot b starts at address + b * slot_bytes
    t = pool.storage("full")
    assert t[3].data_ptr() == regions[0].address + 3 * regions[0].slot_bytes


def test_layer_major_has_one_region_per_layer() -> None:
    pool = make((FULL,), layout=Layout.LAYER_MAJOR)
    regions = pool.slot_regions()
    assert [r.name for r in regions] == ["kv/full@0", "kv/full@1"]
    assert regions[0].slot_bytes == FULL.layer_block_bytes
    assert regions[1].address == regions[0].address + regions[0].nbytes
    assert pool.identity != make((FULL,)).identity


def test_write_read_kv_round_trip_and_layer_views() -> None:
    for layout in Layout:
        pool = make((FULL,), layout=layout)
        pool.allocate("a", 10)
        k, v = torch.randn(10, 2, 8), torch.randn(10, 2, 8)
        pool.write_kv("a", "full", 1, 0, k, v)
        rk, rv = pool.read_kv("a", "full", 1, 0, 10)
        assert torch.equal(rk, k.half()) and torch.equal(rv, v.half())
        # the same bytes are visible through the layer view indexed by the block table
        K, _ = pool.layer_kv("full", 1)
        table = pool.block_table_tensor("a", "full")
        assert torch.equal(K[table].reshape(-1, 2, 8)[:10], k.half())
        assert torch.count_nonzero(pool.layer_kv("full", 0)[0]) == 0  # layer 0 untouched


def test_allocate_grow_shrink_free_accounting() -> None:
    pool = make(blocks=8)
    pool.allocate("a", 9)  # 3 blocks
    assert pool.block_table("a", "full").size == 3
    pool.grow("a", 16)
    assert pool.block_table("a", "full").size == 4 and pool.length("a") == 16
    pool.shrink("a", 5)
    assert pool.block_table("a", "full").size == 2 and pool.stats()["full"]["free"] == 6
    with pytest.raises(PoolExhausted, match="group 'full'"):
        pool.allocate("b", 40)
    assert not pool.has("b") and pool.stats()["full"]["free"] == 6  # all or nothing
    pool.free("a")
    assert pool.stats()["full"]["free"] == 8
    with pytest.raises(UnknownRequest, match="'a'"):
        pool.grow("a", 20)


def test_allocate_is_all_or_nothing_across_groups() -> None:
    pool = PagedKVPool([FULL, SWA], {"full": 16, "swa": 2})
    with pytest.raises(PoolExhausted, match="'swa'"):
        pool.allocate("a", 24)  # full fits (6 blocks), swa needs 3 of 2
    assert pool.stats()["full"]["free"] == 16


def test_commit_fills_whole_and_partial_blocks() -> None:
    pool = make()
    pool.allocate("a", 12)
    pool.commit("a", 6)
    assert pool.filled("a", "full").tolist() == [4, 6, 8]
    pool.shrink("a", 5)
    assert pool.filled("a", "full").tolist() == [4, 5]


def test_prefix_reuse_shares_full_blocks_with_refcounts() -> None:
    pool = make(blocks=8)
    ids = np.arange(100, 111)
    pool.allocate("a", 11)
    pool.commit("a", 11, ids)
    reused = pool.allocate("b", 11, ids)
    assert reused == 8  # two full blocks; the partial third is not shareable
    ta, tb = pool.block_table("a", "full"), pool.block_table("b", "full")
    assert ta[:2].tolist() == tb[:2].tolist() and ta[2] != tb[2]
    assert pool.filled("b", "full").tolist() == [4, 8, 8]
    alloc = pool.allocator("full")
    assert alloc.refcount[ta[:2]].tolist() == [2, 2]
    # the model may not write into shared blocks
    with pytest.raises(ValueError, match="shared"):
        pool.write_kv("b", "full", 0, 0, torch.zeros(1, 2, 8), torch.zeros(1, 2, 8))
    pool.free("a")
    pool.free("b")
    # named blocks stay cached and are reused by a third request; other tokens share nothing
    assert pool.stats()["full"]["cached"] == 2
    assert pool.allocate("c", 8, ids[:8]) == 8
    assert pool.allocate("d", 8, ids[:8] + 1) == 0


def test_cached_prefixes_are_evicted_when_blocks_run_out() -> None:
    pool = make(blocks=4)
    pool.allocate("a", 8)
    pool.commit("a", 8, np.arange(8))
    pool.free("a")
    assert pool.stats()["full"] == {"blocks": 4, "free": 2, "cached": 2, "pinned": 0, "retained": 0}
    pool.allocate("b", 16)  # needs all four: evicts both cached
    assert pool.stats()["full"]["cached"] == 0
    pool.free("b")
    assert pool.allocate("c", 8, np.arange(8)) == 0  # the names went with the eviction


def test_pinned_blocks_defer_free_and_eviction() -> None:
    pool = make(blocks=4)
    pool.allocate("a", 8)
    blocks = pool.block_table("a", "full")
    alloc = pool.allocator("full")
    alloc.pin(blocks, write=False)
    pool.free("a")
    assert pool.stats()["full"]["free"] == 2  # deferred
    with pytest.raises(PoolExhausted):
        pool.allocate("b", 16)
    alloc.unpin(blocks, write=False)
    assert pool.stats()["full"]["free"] == 4
    pool.allocate("b", 16)


def test_state_group_one_slot_per_request() -> None:
    pool = PagedKVPool([FULL, STATE], {"full": 8, "ssm": 2})
    pool.allocate("a", 7, np.arange(7))
    assert pool.block_table("a", "ssm").size == 1
    pool.grow("a", 20)
    assert pool.block_table("a", "ssm").size == 1
    pool.commit("a", 7)
    assert pool.filled("a", "ssm").tolist() == [7]
    pool.state("a", "ssm").fill_(1.0)
    pool.shrink("a", 5)
    assert pool.filled("a", "ssm").tolist() == [-1]  # state past the new end is void
    assert pool.allocate("b", 4, np.arange(4)) == 0  # STATE groups reuse nothing


def test_layout_identity_equal_for_equal_layouts_and_differs_otherwise() -> None:
    base = dict(groups=[FULL, SWA], layout=Layout.BLOCK_MAJOR, tp=(2, 0), scope=b"m/w1")
    ident = layout_identity(**base)  # type: ignore[arg-type]
    assert len(ident) == IDENTITY_BYTES
    # equal on "two processes": built independently from equal inputs
    spec_copy = LayerGroupSpec("full", layers=2, block_tokens=4, kv_heads=2, head_dim=8)
    assert layout_identity([spec_copy, SWA], Layout.BLOCK_MAJOR, (2, 0), b"m/w1") == ident
    variants = [
        dict(base, groups=[SWA, FULL]),
        dict(base, groups=[LayerGroupSpec("full", 2, 4, 2, 8, dtype=torch.bfloat16), SWA]),
        dict(base, groups=[LayerGroupSpec("full", 3, 4, 2, 8), SWA]),
        dict(base, groups=[FULL, LayerGroupSpec("swa", 1, 8, 1, 8, window=32, sink_blocks=1)]),
        dict(base, layout=Layout.LAYER_MAJOR),
        dict(base, tp=(2, 1)),
        dict(base, tp=(4, 0)),
        dict(base, scope=b"m/w2"),
    ]
    idents = {layout_identity(**v) for v in variants}  # type: ignore[arg-type]
    assert ident not in idents and len(idents) == len(variants)
    with pytest.raises(ValueError, match="tensor-parallel"):
        layout_identity([FULL], Layout.BLOCK_MAJOR, (2, 2), b"")


def test_block_names_fixed_width_chained_and_scoped() -> None:
    a = layout_identity([FULL], Layout.BLOCK_MAJOR, (1, 0), b"s1")
    b = layout_identity([FULL], Layout.BLOCK_MAJOR, (1, 0), b"s2")
    ids = np.arange(10)
    names = block_names(a, "full", 4, ids)
    assert len(names) == 2 and all(len(n) == 16 for n in names)
    assert block_names(a, "full", 4, ids) == names
    assert block_names(b, "full", 4, ids) != names  # scope changes every name
    other = ids.copy()
    other[1] = 99
    assert block_names(a, "full", 4, other)[1] != names[1]  # a change early renames later blocks


def test_reset_reuse_forgets_prefixes_and_changes_identity() -> None:
    pool = make(scope=b"w1")
    before = pool.identity
    pool.allocate("a", 8)
    pool.commit("a", 8, np.arange(8))
    pool.reset_reuse(b"w2")
    assert pool.identity != before
    assert pool.allocate("b", 8, np.arange(8)) == 0


def test_errors_name_what_is_wrong() -> None:
    with pytest.raises(ValueError, match="num_blocks"):
        make(blocks=0)
    with pytest.raises(ValueError, match="repeat"):
        make((FULL, FULL))
    with pytest.raises(ValueError, match="head_dim"):
        LayerGroupSpec("x", 1, 4, 1, 0)
    pool = make()
    pool.allocate("a", 4)
    with pytest.raises(ValueError, match="already allocated"):
        pool.allocate("a", 4)
    with pytest.raises(IndexError, match="positions outside"):
        pool.read_kv("a", "full", 0, 0, 5)
    with pytest.raises(KeyError, match="no layer group 'nope'"):
        pool.block_table("a", "nope")
    with pytest.raises(ValueError, match="holds only"):
        pool.commit("a", 5)


def test_shrink_into_a_named_block_unnames_it() -> None:
    pool = make(blocks=8)
    ids = np.arange(100, 112)
    pool.allocate("a", 12)
    pool.commit("a", 12, ids)  # three full blocks, all named
    pool.shrink("a", 10)  # block 2 keeps tokens 8..10; 10..12 are void and get rewritten
    pool.grow("a", 12)
    pool.write_kv("a", "full", 0, 10, torch.ones(2, 2, 8), torch.ones(2, 2, 8))
    # block 2 no longer holds the KV its old name stands for: a request with that prefix
    # must not share it (only the two untouched full blocks)
    assert pool.allocate("b", 12, ids) == 8
    assert pool.block_table("b", "full")[2] != pool.block_table("a", "full")[2]


def test_writing_into_a_named_block_once_exclusive_unnames_it() -> None:
    pool = make(blocks=8)
    ids = np.arange(100, 112)
    pool.allocate("a", 8)
    pool.commit("a", 8, ids)
    assert pool.allocate("b", 8, ids) == 8  # b shares both named blocks
    pool.shrink("b", 6)  # b rolls back into shared block 1: it cannot write it while a holds it
    with pytest.raises(ValueError, match="shared"):
        pool.write_kv("b", "full", 0, 4, torch.ones(2, 2, 8), torch.ones(2, 2, 8))
    pool.commit("a", 8, ids)  # a still stands behind block 1's name
    pool.free("a")  # now b alone holds block 1
    pool.grow("b", 8)
    pool.write_kv("b", "full", 0, 6, torch.ones(2, 2, 8), torch.ones(2, 2, 8))  # b's own tokens 6, 7
    # block 1 no longer holds what its name stands for: a third request shares block 0 only
    assert pool.allocate("c", 8, ids) == 4



def test_write_kv_refuses_k_or_v_of_the_wrong_shape() -> None:
    # torch would broadcast [n, 1, 1] into every head and dimension and write it silently.
    pool = make((FULL,))
    pool.allocate("a", 4)
    good = torch.randn(4, 2, 8)
    for k, v in ((torch.randn(4, 1, 1), good), (good, torch.randn(1, 1, 1)), (torch.randn(4, 2, 4), good)):
        with pytest.raises(ValueError, match=r"\[n, kv_heads, head_dim\] = \[4, 2, 8\]"):
            pool.write_kv("a", "full", 0, 0, k, v)
    assert torch.count_nonzero(pool.layer_kv("full", 0)[0]) == 0  # nothing written
    pool.write_kv("a", "full", 0, 0, good, good)
