"""Destination-row digests between engine geometries (``kvxfer.backends.common.plan_digest``):
summed from the segments of a transform plan, with no row assembled, they equal the digest of
the destination row's canonical bytes assembled unit by unit, whether summed from the source
(the publisher) or from where the bytes landed (the fetcher), for random layouts, block sizes,
head slices, token ranges and unit sizes off 8-byte words; the numpy fallback equals the
compiled one; and a change to any landed byte of a row changes that row's digest only."""

from __future__ import annotations

import ctypes

import numpy as np
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from kvxfer import native
from kvxfer.backends.common import plan_digest
from kvxfer.backends.common.integrity import DIGEST_K, numpy_row_digests
from kvxfer.backends.common.transform import Rows, TransformPlan, copy_runs, plan_transform
from kvxfer.contract import HeadOrder, MemoryKind
from kvxfer.lender.engine_kv import EngineKV
from kvxfer.pool import LayerGroupSpec, Layout, PagedKVPool

DTYPES = {1: torch.uint8, 2: torch.float16, 4: torch.float32}


def engine(kind: str, layers: int, kv_heads: int, heads: tuple[int, int], dim: int, elem: int, bt: int,
           blocks: int, seed: int | None) -> EngineKV:
    held = heads[1] - heads[0]
    dtype = DTYPES[elem]
    if kind.startswith("pool"):
        group = LayerGroupSpec("g", layers=layers, block_tokens=bt, kv_heads=held, head_dim=dim, dtype=dtype)
        layout = Layout.BLOCK_MAJOR if kind == "pool-block" else Layout.LAYER_MAJOR
        kv = EngineKV.from_pool(PagedKVPool([group], blocks, layout=layout), heads=heads, kv_heads=kv_heads)
    else:
        order = HeadOrder(kind)
        shape = (2, blocks, bt, held, dim) if order is HeadOrder.NHD else (2, blocks, held, bt, dim)
        kv = EngineKV.per_layer([torch.zeros(shape, dtype=dtype) for _ in range(layers)], kv_heads=kv_heads,
                                heads=heads, head_order=order)
    if seed is not None:
        g = torch.Generator().manual_seed(seed)
        for t in kv.tensors:
            t.view(torch.uint8).copy_(torch.randint(0, 256, t.view(torch.uint8).shape, generator=g,
                                                    dtype=torch.uint8))
    return kv


def canonical_rows(plan: TransformPlan, rows: Rows) -> list[bytes]:
    """Each destination row's canonical bytes, unit by unit, as the docstring defines them:
    plane, then each token of the block the view asks for, then each head the destination holds."""
    g, out = plan.dst, []
    for slot, ordinal in zip(rows.slots.tolist(), rows.ordinals.tolist()):
        lo = max(ordinal * g.block_tokens, rows.start) - ordinal * g.block_tokens
        hi = min((ordinal + 1) * g.block_tokens, rows.end) - ordinal * g.block_tokens
        units = []
        for p in range(plan.planes):
            for t in range(lo, hi):
                for h in range(g.head_count):
                    at = g.plane_address(p) + slot * g.block_stride + t * g.token_stride + h * g.head_stride
                    units.append(ctypes.string_at(at, g.unit_bytes))
        out.append(b"".join(units))
    return out


def digest_of(data: bytes) -> int:
    """The ordinary row digest of one row's bytes (integrity's numpy definition)."""
    if not data:
        return 0
    buf = np.frombuffer(data, dtype=np.uint8).copy()
    return int(numpy_row_digests(buf.ctypes.data, len(data), np.zeros(1, dtype=np.int64))[0])


@st.composite
def transfers(draw: st.DrawFn) -> dict[str, object]:
    layers = draw(st.integers(1, 3))
    kv_heads = draw(st.integers(1, 4))
    elem = draw(st.sampled_from([1, 2, 4]))
    dim = draw(st.sampled_from([1, 3, 4, 8]))  # unit_bytes 1 .. 32, most off whole words
    src_heads = (0, kv_heads)
    first = draw(st.integers(0, kv_heads - 1))
    dst_heads = (first, draw(st.integers(first + 1, kv_heads)))
    src_kind = draw(st.sampled_from(["nhd", "hnd", "pool-block", "pool-layer"]))
    dst_kind = draw(st.sampled_from(["nhd", "hnd", "pool-block", "pool-layer"]))
    src_bt, dst_bt = draw(st.sampled_from([2, 3, 4, 8])), draw(st.sampled_from([2, 3, 4, 8]))
    tokens = draw(st.integers(1, 30))
    start = draw(st.integers(0, tokens - 1))
    # The destination asks for the source's tokens, or for more (then the rows with tokens
    # the source lacks are never proven, and not compared).
    dst_start = start if draw(st.booleans()) else draw(st.integers(0, start))
    return {"layers": layers, "kv_heads": kv_heads, "elem": elem, "dim": dim, "src_heads": src_heads,
            "dst_heads": dst_heads, "src_kind": src_kind, "dst_kind": dst_kind, "src_bt": src_bt, "dst_bt": dst_bt,
            "range": (start, tokens), "dst_range": (dst_start, tokens), "seed": draw(st.integers(0, 2**16))}


def make(t: dict[str, object]) -> tuple[TransformPlan, Rows, EngineKV, EngineKV]:
    rng = np.random.default_rng(t["seed"])
    start, end = t["range"]  # type: ignore[misc]
    d_start, _ = t["dst_range"]  # type: ignore[misc]
    ends = []
    for side, lo in (("src", start), ("dst", d_start)):
        bt = t[f"{side}_bt"]
        n = -(-end // bt)  # type: ignore[operator]
        blocks = n + 2
        kv = engine(t[f"{side}_kind"], t["layers"], t["kv_heads"], t[f"{side}_heads"], t["dim"], t["elem"],  # type: ignore[arg-type]
                    bt, blocks, t["seed"] if side == "src" else None)  # type: ignore[arg-type]
        table = rng.permutation(blocks)[:n].astype(np.int64)
        first = lo // bt  # type: ignore[operator]
        rows = Rows(table[first:], np.arange(first, n, dtype=np.int64), lo, end)  # type: ignore[arg-type]
        ends.append((kv, rows))
    (src, s_rows), (dst, d_rows) = ends
    d_geo = dst.geometry
    s_geo = src.geometry
    plan = plan_transform(s_geo, s_rows, d_geo, d_rows)
    return plan, d_rows, src, dst


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(transfers())
def test_composed_digests_equal_the_digest_of_the_assembled_destination_row(t: dict[str, object]) -> None:
    plan, d_rows, src, dst = make(t)  # the tensors stay alive while their addresses are read
    copy_runs(plan, 0, plan.runs, memory=MemoryKind.HOST)
    _, proven = plan.masks(plan.runs)
    everything = np.arange(plan.runs * plan.planes, dtype=np.int64)
    at_source = plan_digest.row_digests(plan, everything, at_source=True, k=DIGEST_K)
    landed = plan_digest.row_digests(plan, everything, at_source=False, k=DIGEST_K)
    assembled = np.array([digest_of(b) for b in canonical_rows(plan, d_rows)], dtype=np.uint64)
    if t["dst_range"] == t["range"]:
        assert proven.all()
    assert at_source[proven].tolist() == assembled[proven].tolist()
    assert landed[proven].tolist() == assembled[proven].tolist()
    # The fallback, byte by byte, equals the compiled shares.
    where = plan_digest.placement(plan, everything)
    unit = plan.dst.unit_bytes
    for at_src, addr, g in ((True, plan.src_addr, plan.src), (False, plan.dst_addr, plan.dst)):
        compiled = plan_digest.segment_shares(plan, everything, at_source=at_src, k=DIGEST_K)
        fallback = plan_digest.numpy_shares(addr, plan.tokens, where.offset, where.row_bytes, heads=plan.heads,
                                            unit_bytes=unit, strides=(g.token_stride, g.head_stride),
                                            canon=(plan.heads * unit, unit), k=DIGEST_K)
        assert compiled.tolist() == fallback.tolist()
    assert src.tensors and dst.tensors


@settings(max_examples=60, deadline=None)
@given(transfers(), st.data())
def test_a_flipped_landed_bit_changes_its_rows_digest_and_no_other(t: dict[str, object], data: st.DataObject) -> None:
    plan, _, src, dst = make(t)
    copy_runs(plan, 0, plan.runs, memory=MemoryKind.HOST)
    _, proven = plan.masks(plan.runs)
    rows = np.flatnonzero(proven)
    assume(rows.size > 0)
    everything = np.arange(plan.runs * plan.planes, dtype=np.int64)
    before = plan_digest.row_digests(plan, everything, at_source=False, k=DIGEST_K)
    row = data.draw(st.sampled_from(rows.tolist()))
    g = plan.dst
    seg = data.draw(st.sampled_from(np.flatnonzero(np.repeat(plan.run_dst_row, plan.planes) == row).tolist()))
    tok = data.draw(st.integers(0, int(plan.tokens[seg]) - 1))
    head = data.draw(st.integers(0, plan.heads - 1))
    bit = data.draw(st.integers(0, 8 * g.unit_bytes - 1))
    at = int(plan.dst_addr[seg]) + tok * g.token_stride + head * g.head_stride + bit // 8
    byte = ctypes.c_uint8.from_address(at)
    byte.value ^= 1 << (bit % 8)
    after = plan_digest.row_digests(plan, everything, at_source=False, k=DIGEST_K)
    assert np.flatnonzero(before != after).tolist() == [row]
    assert src.tensors and dst.tensors  # alive until here: the plan's addresses are theirs


def test_the_compiled_segment_digest_is_built() -> None:
    assert native.has_segment_digests(), native.info().reason
