"""The transform plan between two engine geometries: the bytes it moves and the rows it proves.

The plan is executed here by a plain per-unit ctypes loop (the reference), and the result
compared with torch slicing of the same tensors: each destination block holds exactly the
source's tokens for its heads, in its own layout.
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch

from kvxfer.backends.common.transform import Oriented, Rows, plan_transform
from kvxfer.contract import HeadOrder, LayoutMismatch
from kvxfer.lender.engine_kv import EngineKV
from kvxfer.lender.external import ExternalLender
from kvxfer.pool import PagedKVPool
from kvxfer.pool.spec import LayerGroupSpec, Layout

LAYERS, KV_HEADS, DIM = 3, 4, 8


def reference_copy(plan, first_run: int = 0, end_run: int | None = None) -> None:
    end_run = plan.runs if end_run is None else end_run
    unit = plan.dst.unit_bytes
    seg = plan.segment_range(first_run, end_run)
    for s, d, n in zip(plan.src_addr[seg].tolist(), plan.dst_addr[seg].tolist(), plan.tokens[seg].tolist()):
        for t in range(n):
            for h in range(plan.heads):
                ctypes.memmove(d + t * plan.dst.token_stride + h * plan.dst.head_stride,
                               s + t * plan.src.token_stride + h * plan.src.head_stride, unit)


def layer_tensors(blocks: int, bt: int, heads: int, order: HeadOrder, fill: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    shape = (2, blocks, bt, heads, DIM) if order is HeadOrder.NHD else (2, blocks, heads, bt, DIM)
    return [torch.randn(shape, generator=g).to(torch.float16) if fill else torch.zeros(shape, dtype=torch.float16)
            for _ in range(LAYERS)]


def token_kv(tensors, table, tokens: int, bt: int, order: HeadOrder) -> torch.Tensor:
    """[layers, 2, tokens, heads, dim] of a request, read through its block table."""
    out = []
    for t in tensors:
        blocks = t[:, torch.as_tensor(table)]
        if order is HeadOrder.HND:
            blocks = blocks.transpose(2, 3)
        out.append(blocks.reshape(2, -1, blocks.shape[3], DIM)[:, :tokens])
    return torch.stack(out)


CASES = [  # (src bt, src order, src heads, dst bt, dst order, dst heads)
    (16, HeadOrder.NHD, (0, 4), 32, HeadOrder.NHD, (0, 4)),
    (64, HeadOrder.NHD, (0, 4), 16, HeadOrder.HND, (0, 4)),
    (16, HeadOrder.HND, (0, 4), 32, HeadOrder.NHD, (2, 4)),   # TP 1 -> rank 1 of 2
    (16, HeadOrder.NHD, (2, 4), 16, HeadOrder.NHD, (2, 4)),   # rank 1 of 2 -> its own heads
    (32, HeadOrder.NHD, (0, 4), 16, HeadOrder.HND, (1, 2)),   # TP 1 -> rank 1 of 4
]


@pytest.mark.parametrize("case", CASES)
def test_plan_moves_each_head_of_each_token_into_its_place(case) -> None:
    sbt, sorder, sheads, dbt, dorder, dheads = case
    tokens = 100
    src_t = layer_tensors(12, sbt, sheads[1] - sheads[0], sorder, fill=True, seed=1)
    dst_t = layer_tensors(12, dbt, dheads[1] - dheads[0], dorder, fill=False)
    src = EngineKV.per_layer(src_t, kv_heads=KV_HEADS, heads=sheads, head_order=sorder)
    dst = EngineKV.per_layer(dst_t, kv_heads=KV_HEADS, heads=dheads, head_order=dorder)
    rng = np.random.default_rng(0)
    s_table = rng.permutation(12)[: -(-tokens // sbt)]
    d_table = rng.permutation(12)[: -(-tokens // dbt)]
    read = ExternalLender(src).lend_read("r", s_table, (0, tokens)).view()
    write = ExternalLender(dst).lend_write("r", d_table, (0, tokens)).view()
    plan = plan_transform(read.geometry, Rows.of_view(read), write.geometry, Rows.of_view(write))
    reference_copy(plan)
    got = token_kv(dst_t, d_table, tokens, dbt, dorder)
    want = token_kv(src_t, s_table, tokens, sbt, sorder)[:, :, :, dheads[0] - sheads[0]: dheads[1] - sheads[0]]
    assert torch.equal(got, want)
    src_mask, dst_mask = plan.masks(plan.runs)
    assert src_mask.all() and dst_mask.all()


def test_a_block_that_arrived_in_part_is_not_marked() -> None:
    src_t = layer_tensors(8, 16, 4, HeadOrder.NHD, fill=True)
    dst_t = layer_tensors(8, 32, 4, HeadOrder.NHD, fill=False)
    src = ExternalLender(EngineKV.per_layer(src_t, kv_heads=4)).lend_read("r", np.arange(4), (0, 64)).view()
    dst = ExternalLender(EngineKV.per_layer(dst_t, kv_heads=4)).lend_write("r", np.arange(2), (0, 64)).view()
    plan = plan_transform(src.geometry, Rows.of_view(src), dst.geometry, Rows.of_view(dst))
    assert plan.runs == 4  # four 16-token runs into two 32-token blocks
    src_mask, dst_mask = plan.masks(3)
    assert src_mask.tolist() == [True, True, True, False]
    assert dst_mask.tolist() == [True, False]  # block 1 holds one of its two runs
    _, dst_mask = plan.masks(np.array([False, True, True, True]))
    assert dst_mask.tolist() == [False, True]


def test_a_run_counts_only_once_every_segment_of_it_landed() -> None:
    src_t = layer_tensors(8, 16, 4, HeadOrder.NHD, fill=True)
    dst_t = layer_tensors(8, 32, 4, HeadOrder.NHD, fill=False)
    src = ExternalLender(EngineKV.per_layer(src_t, kv_heads=4)).lend_read("r", np.arange(4), (0, 64)).view()
    dst = ExternalLender(EngineKV.per_layer(dst_t, kv_heads=4)).lend_write("r", np.arange(2), (0, 64)).view()
    fetching = Oriented(plan_transform(src.geometry, Rows.of_view(src), dst.geometry, Rows.of_view(dst)), False)
    plan = fetching.plan
    landed = np.zeros(plan.runs * plan.planes, dtype=np.bool_)
    landed[: 2 * plan.planes] = True  # runs 0 and 1: all of block 0
    landed[2 * plan.planes: 4 * plan.planes - 1] = True  # runs 2 and 3 but the last plane of run 3
    assert plan.runs_landed(landed).tolist() == [True, True, True, False]
    local, peer = fetching.landed_masks(landed)
    assert [m.tolist() for m in local] == [[True, False]]  # the fetcher is the destination
    assert [m.tolist() for m in peer] == [[True, True, True, False]]
    assert not any(m.flags.writeable for m in (*local, *peer))


def test_rows_the_source_lacks_stay_false() -> None:
    src_t = layer_tensors(8, 16, 4, HeadOrder.NHD, fill=True)
    dst_t = layer_tensors(8, 16, 4, HeadOrder.NHD, fill=False)
    src = ExternalLender(EngineKV.per_layer(src_t, kv_heads=4)).lend_read("r", np.arange(2), (0, 32)).view()
    dst = ExternalLender(EngineKV.per_layer(dst_t, kv_heads=4)).lend_write("r", np.arange(4), (0, 50)).view()
    plan = plan_transform(src.geometry, Rows.of_view(src), dst.geometry, Rows.of_view(dst))
    _, dst_mask = plan.masks(plan.runs)
    assert dst_mask.tolist() == [True, True, False, False]


def test_pool_layouts_are_geometries_too() -> None:
    spec = LayerGroupSpec("g", layers=LAYERS, block_tokens=16, kv_heads=KV_HEADS, head_dim=DIM)
    for layout in Layout:
        pool = PagedKVPool([spec], 8, layout=layout)
        kv = EngineKV.from_pool(pool)
        k, _ = pool.layer_kv("g", 1)
        assert kv.geometry.plane_address(2) == k.data_ptr()
        assert kv.geometry.block_stride == k.stride(0) * 2


@pytest.mark.parametrize(("change", "needle"), [
    ({"kv_heads": 8}, "kv_heads"),
    ({"dtype": torch.bfloat16}, "dtype"),
])
def test_models_that_differ_are_refused_by_name(change, needle) -> None:
    src = EngineKV.per_layer(layer_tensors(4, 16, 4, HeadOrder.NHD, fill=True), kv_heads=4)
    dtype = change.get("dtype", torch.float16)
    tensors = [t.to(dtype) for t in layer_tensors(4, 16, 4, HeadOrder.NHD, fill=False)]
    dst = EngineKV.per_layer(tensors, kv_heads=change.get("kv_heads", 4), heads=(0, 4))
    s = ExternalLender(src).lend_read("r", np.arange(2), (0, 32)).view()
    d = ExternalLender(dst).lend_write("r", np.arange(2), (0, 32)).view()
    with pytest.raises(LayoutMismatch, match=needle):
        plan_transform(s.geometry, Rows.of_view(s), d.geometry, Rows.of_view(d))


def test_a_destination_holding_heads_the_source_lacks_is_refused() -> None:
    src = EngineKV.per_layer(layer_tensors(4, 16, 2, HeadOrder.NHD, fill=True), kv_heads=4, heads=(0, 2))
    dst = EngineKV.per_layer(layer_tensors(4, 16, 4, HeadOrder.NHD, fill=False), kv_heads=4)
    s = ExternalLender(src).lend_read("r", np.arange(2), (0, 32)).view()
    dst_lender = ExternalLender(dst)  # one lender per engine KV: the narrowed lease is its second
    whole = dst_lender.lend_write("r", np.arange(2), (0, 32))
    d = whole.view()
    with pytest.raises(LayoutMismatch, match="narrow the destination"):
        plan_transform(s.geometry, Rows.of_view(s), d.geometry, Rows.of_view(d))
    whole.release()  # nothing was submitted: the blocks may be lent for writing again
    narrowed = dst_lender.lend_write("r", np.arange(2), (0, 32), heads=(0, 2)).view()
    plan = plan_transform(s.geometry, Rows.of_view(s), narrowed.geometry, Rows.of_view(narrowed))
    assert plan.heads == 2


def test_unknown_shapes_and_bad_block_tables_are_refused() -> None:
    with pytest.raises(LayoutMismatch, match="first dimension must be 2"):
        EngineKV.per_layer([torch.zeros(3, 4, 16, 4, DIM)], kv_heads=4)
    with pytest.raises(LayoutMismatch, match="expected"):
        EngineKV.per_layer([torch.zeros(2, 4, 16, DIM)], kv_heads=4)
    with pytest.raises(LayoutMismatch, match="heads"):
        EngineKV.per_layer([torch.zeros(2, 4, 16, 4, DIM)], kv_heads=8)
    kv = EngineKV.per_layer(layer_tensors(4, 16, 4, HeadOrder.NHD, fill=False), kv_heads=4)
    from kvxfer.lender import LeaseError
    with pytest.raises(LeaseError, match="outside"):
        ExternalLender(kv).lend_write("r", np.array([0, 9]), (0, 32))
    with pytest.raises(LeaseError, match="block table has"):
        ExternalLender(kv).lend_write("r", np.array([0]), (0, 32))
