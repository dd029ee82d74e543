"""Engine KV moved between two different geometries by the reference backend, end to end:
the engine's own tensors at both ends, a publish and a fetch, bytes and masks checked."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvxfer.backends.common.corruption import Corruptor
from kvxfer.backends.common.integrity import MISMATCH
from kvxfer.backends.loopback import LoopbackBackend, LoopbackFabric
from kvxfer.contract import Delivered, Failed, HeadOrder, InvalidSubmission, LayoutMismatch, TransferMode
from kvxfer.lender.engine_kv import EngineKV
from kvxfer.lender.external import ExternalLender
from kvxfer.pool import PagedKVPool
from kvxfer.pool.spec import LayerGroupSpec, Layout

LAYERS, KV_HEADS, DIM, TOKENS = 2, 4, 8, 90


def per_layer(blocks: int, bt: int, heads: int, order: HeadOrder, seed: int | None) -> list[torch.Tensor]:
    shape = (2, blocks, bt, heads, DIM) if order is HeadOrder.NHD else (2, blocks, heads, bt, DIM)
    g = torch.Generator().manual_seed(seed or 0)
    return [torch.randn(shape, generator=g).half() if seed is not None else torch.zeros(shape, dtype=torch.half)
            for _ in range(LAYERS)]


def tokens_of(kv: EngineKV, table: np.ndarray, tokens: int) -> torch.Tensor:
    """[layers, 2, tokens, heads, dim] of one request, whatever the geometry (read plane by plane)."""
    g = kv.geometry
    out = torch.zeros(LAYERS, 2, tokens, g.head_count, DIM, dtype=torch.half)
    flat = {i: t.view(-1).view(torch.uint8) for i, t in enumerate(kv.tensors)}
    for p in range(2 * LAYERS):
        region, offset = g.planes[p]
        for tok in range(tokens):
            block = int(table[tok // g.block_tokens])
            for h in range(g.head_count):
                at = offset + block * g.block_stride + (tok % g.block_tokens) * g.token_stride + h * g.head_stride
                out[p // 2, p % 2, tok, h] = flat[region][at: at + g.unit_bytes].view(torch.half)
    return out


def two(mode: TransferMode, **kw: object) -> tuple[LoopbackBackend, LoopbackBackend]:
    fabric = LoopbackFabric()
    return LoopbackBackend(fabric, "prefill", mode, **kw), LoopbackBackend(fabric, "decode", mode, **kw)  # type: ignore[arg-type]


def move(mode: TransferMode, src: EngineKV, dst: EngineKV, src_table, dst_table, heads=None, **kw: object):
    prefill, decode = two(mode, **kw)
    try:
        prefill.register(src.regions)
        decode.register(dst.regions)
        read = ExternalLender(src).lend_read("r", src_table, (0, TOKENS))
        write = ExternalLender(dst).lend_write("r", dst_table, (0, TOKENS), heads=heads)
        hint_d = decode.describe(write.view(), prefill.peer)
        hint_p = prefill.describe(read.view(), decode.peer)
        published = prefill.publish(read.view(), hint_d)
        fetched = decode.fetch(write.view(), hint_p)
        assert published.wait(10) and fetched.wait(10)
        return published.poll(), fetched.poll()
    finally:
        prefill.shutdown()
        decode.shutdown()


def block_table(blocks: int, tokens: int, bt: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).permutation(blocks)[: -(-tokens // bt)].astype(np.int64)


@pytest.mark.parametrize("mode", list(TransferMode), ids=lambda m: m.value)
@pytest.mark.parametrize(("sbt", "sorder", "dbt", "dorder", "dheads"), [
    (16, HeadOrder.NHD, 32, HeadOrder.NHD, (0, 4)),   # block_tokens 16 -> 32
    (64, HeadOrder.NHD, 16, HeadOrder.HND, (0, 4)),   # 64 -> 16, NHD -> HND
    (16, HeadOrder.HND, 16, HeadOrder.NHD, (2, 4)),   # TP 1 -> rank 1 of 2
    (16, HeadOrder.NHD, 32, HeadOrder.NHD, (3, 4)),   # TP 1 -> rank 3 of 4
])
def test_engine_kv_moves_between_geometries(mode, sbt, sorder, dbt, dorder, dheads) -> None:
    src = EngineKV.per_layer(per_layer(12, sbt, KV_HEADS, sorder, seed=1), kv_heads=KV_HEADS, head_order=sorder)
    held = dheads[1] - dheads[0]
    dst = EngineKV.per_layer(per_layer(12, dbt, held, dorder, seed=None), kv_heads=KV_HEADS, heads=dheads,
                             head_order=dorder)
    s_table, d_table = block_table(12, TOKENS, sbt, 1), block_table(12, TOKENS, dbt, 2)
    published, fetched = move(mode, src, dst, s_table, d_table)
    assert isinstance(published, Delivered) and isinstance(fetched, Delivered)
    assert fetched.masks[0].all() and published.masks[0].all()
    want = tokens_of(src, s_table, TOKENS)[:, :, :, dheads[0]:dheads[1]]
    assert torch.equal(tokens_of(dst, d_table, TOKENS), want)


def test_layer_major_to_block_major_pool() -> None:
    src = EngineKV.per_layer(per_layer(12, 16, KV_HEADS, HeadOrder.NHD, seed=3), kv_heads=KV_HEADS)
    spec = LayerGroupSpec("kv", layers=LAYERS, block_tokens=32, kv_heads=2, head_dim=DIM)
    pool = PagedKVPool([spec], 8, layout=Layout.BLOCK_MAJOR, tp=(2, 0))
    dst = EngineKV.from_pool(pool, heads=(0, 2), kv_heads=KV_HEADS)
    s_table, d_table = block_table(12, TOKENS, 16, 4), block_table(8, TOKENS, 32, 5)
    _, fetched = move(TransferMode.PUSH, src, dst, s_table, d_table)
    assert isinstance(fetched, Delivered) and fetched.masks[0].all()
    assert torch.equal(tokens_of(dst, d_table, TOKENS), tokens_of(src, s_table, TOKENS)[:, :, :, 0:2])


@pytest.mark.parametrize("mode", list(TransferMode), ids=lambda m: m.value)
def test_a_fault_part_way_marks_only_whole_destination_blocks(mode) -> None:
    src = EngineKV.per_layer(per_layer(12, 16, KV_HEADS, HeadOrder.NHD, seed=6), kv_heads=KV_HEADS)
    dst = EngineKV.per_layer(per_layer(12, 32, KV_HEADS, HeadOrder.NHD, seed=None), kv_heads=KV_HEADS)
    s_table, d_table = block_table(12, TOKENS, 16, 6), block_table(12, TOKENS, 32, 7)
    published, fetched = move(mode, src, dst, s_table, d_table, fail_after_rows=3)  # 3 runs of 16 tokens
    assert isinstance(published, Failed) and isinstance(fetched, Failed)
    assert fetched.masks[0].tolist() == [True, False, False]  # block 1 got one of its two runs
    assert published.masks[0].tolist() == [True, True, True, False, False, False]
    got, want = tokens_of(dst, d_table, TOKENS), tokens_of(src, s_table, TOKENS)
    assert torch.equal(got[:, :, :32], want[:, :, :32])


def test_refusals_name_the_difference_and_touch_nothing() -> None:
    src = EngineKV.per_layer(per_layer(4, 16, 2, HeadOrder.NHD, seed=8), kv_heads=KV_HEADS, heads=(0, 2))
    dst_t = per_layer(4, 16, KV_HEADS, HeadOrder.NHD, seed=None)
    dst = EngineKV.per_layer(dst_t, kv_heads=KV_HEADS)
    prefill, decode = two(TransferMode.PUSH)
    try:
        prefill.register(src.regions)
        decode.register(dst.regions)
        read = ExternalLender(src).lend_read("r", np.arange(2), (0, 32))
        write = ExternalLender(dst).lend_write("r", np.arange(2), (0, 32))
        hint_d = decode.describe(write.view(), prefill.peer)
        with pytest.raises(LayoutMismatch, match="narrow"):
            prefill.publish(read.view(), hint_d)
        assert all(not t.any() for t in dst_t)
        with pytest.raises(InvalidSubmission, match="not registered"):
            other = EngineKV.per_layer(per_layer(4, 16, 2, HeadOrder.NHD, seed=9), kv_heads=KV_HEADS, heads=(0, 2))
            prefill.describe(ExternalLender(other).lend_read("r", np.arange(2), (0, 32)).view())
    finally:
        prefill.shutdown()
        decode.shutdown()


def _tp_rank_ends() -> tuple[EngineKV, EngineKV, np.ndarray, np.ndarray]:
    """TP 1 layer-major HND -> rank 1 of 2 in a block-major pool of 32-token blocks."""
    src = EngineKV.per_layer(per_layer(12, 16, KV_HEADS, HeadOrder.HND, seed=10), kv_heads=KV_HEADS,
                             head_order=HeadOrder.HND)
    spec = LayerGroupSpec("kv", layers=LAYERS, block_tokens=32, kv_heads=2, head_dim=DIM)
    dst = EngineKV.from_pool(PagedKVPool([spec], 8, layout=Layout.BLOCK_MAJOR, tp=(2, 1)), heads=(2, 4),
                             kv_heads=KV_HEADS)
    return src, dst, block_table(12, TOKENS, 16, 10), block_table(8, TOKENS, 32, 11)


def test_a_push_between_geometries_refuses_exactly_the_damaged_destination_blocks() -> None:
    """The publisher sums each destination block's digest from the source segments it copied;
    the fetcher checks its blocks with its own plan after the test hook damaged some."""
    corruptor = Corruptor(seed=5, p_bit=0.3, p_row=0.3)
    src, dst, s_table, d_table = _tp_rank_ends()
    published, fetched = move(TransferMode.PUSH, src, dst, s_table, d_table, corrupt_landed=corruptor)
    changed = corruptor.take()
    name = dst.geometry.regions[0].name
    damaged = np.array([(name, b) in changed for b in d_table.tolist()])
    assert 0 < damaged.sum() < damaged.size, changed
    assert fetched.masks[0].tolist() == (~damaged).tolist()
    assert isinstance(published, Delivered)  # as for pool rows: the fetcher checks after the publisher concluded
    assert isinstance(fetched, Failed) and fetched.reason.startswith(MISMATCH), fetched
    bt, got, want = 32, tokens_of(dst, d_table, TOKENS), tokens_of(src, s_table, TOKENS)[:, :, :, 2:4]
    for block in np.flatnonzero(~damaged).tolist():
        assert torch.equal(got[:, :, block * bt:(block + 1) * bt], want[:, :, block * bt:(block + 1) * bt])


def test_a_pull_between_geometries_is_not_checked() -> None:
    """The publisher's hint is made before it knows the fetcher's layout: no digest travels,
    the fetcher checks nothing (its hook is never called), and the pull is Delivered."""
    corruptor = Corruptor(seed=3, p_bit=1.0)
    src, dst, s_table, d_table = _tp_rank_ends()
    _, fetched = move(TransferMode.PULL, src, dst, s_table, d_table, corrupt_landed=corruptor)
    assert isinstance(fetched, Delivered) and fetched.masks[0].all()
    assert corruptor.rows_seen == 0
