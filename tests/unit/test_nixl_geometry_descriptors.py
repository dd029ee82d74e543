"""The NIXL geometry path's descriptors, chunks and path choice, without NIXL: the descriptors
of a plan, applied as plain memmoves, put every source unit in its destination place; the
count made without building them matches; coalescing never spans two registered regions;
chunks keep to their budget and to run boundaries; and ``packed="auto"`` packs the layouts
whose descriptors are many."""

from __future__ import annotations

import ctypes
import time

import numpy as np
import pytest

from kvxfer.backends.common.attempt import TrackedAttempt
from kvxfer.backends.common.transfers import hint_groups
from kvxfer.backends.common.transform import Oriented, Rows, plan_transform
from kvxfer.backends.nixl.geometry_packed import GeometryPackedJob, landing_slots_ahead, packed_arena, plan_geometry_job
from kvxfer.backends.nixl.geometry_path import (
    GeometryJob,
    chunk_descriptors,
    count_descriptors,
    cut_chunks,
    segments,
    shape_of,
)
from kvxfer.backends.nixl.jobs import PassiveWait
from kvxfer.backends.nixl.packed import ARENA_EXTRA, Arena
from kvxfer.backends.nixl.plan import ChunkBytes
from kvxfer.backends.nixl.sender import SendPolicy
from kvxfer.contract import (
    BlockOrder,
    CacheKind,
    HeadOrder,
    Hint,
    KVGeometry,
    LayerGroupRows,
    MemoryKind,
    SlotRegion,
    TokenRange,
    TransferMode,
    View,
)
from kvxfer.lender.external import ExternalLender
from kvxfer.testing.nixl_geometry import build_kv, kv_tokens, local_bytes

TOKENS = 100
BASE = {"kind": "layers", "layers": 2, "kv_heads": 4, "head_dim": 8, "blocks": 12, "heads": [0, 4],
        "order": "nhd", "block_tokens": 16}


def spec(**changes: object) -> dict:
    return {**BASE, **changes}


CASES = {  # (source, destination, descriptors per chunk of one 16-token run's 4 planes at most)
    "same": (spec(), spec()),
    "bt16-to-bt32": (spec(), spec(block_tokens=32)),
    "nhd-to-hnd": (spec(), spec(order="hnd", block_tokens=32)),
    "hnd-to-hnd-narrowed": (spec(order="hnd"), spec(order="hnd", heads=[1, 3])),
    "tp-rank": (spec(), spec(heads=[2, 4])),
    "block-major-pools": (spec(kind="pool"), spec(kind="pool")),
    "block-major-pools-bt16-to-bt32": (spec(kind="pool"), spec(kind="pool", block_tokens=32)),
    "layer-major-to-block-major": (spec(block_tokens=64, blocks=4), spec(kind="pool")),
}


def _views(src_spec: dict, dst_spec: dict, spread: bool = False):
    """Random block tables; ``spread``: every other block (no two of a request adjacent)."""
    src, dst = build_kv(src_spec, seed=5), build_kv(dst_spec)
    rng = np.random.default_rng(1)

    def table(s: dict) -> np.ndarray:
        n = -(-TOKENS // s["block_tokens"])
        if spread:  # even blocks, then odd ones
            return np.concatenate([np.arange(0, s["blocks"], 2), np.arange(1, s["blocks"], 2)])[:n]
        return rng.permutation(s["blocks"])[:n]

    s_table, d_table = table(src_spec), table(dst_spec)
    read = ExternalLender(src).lend_read("r", s_table, (0, TOKENS)).view()
    write = ExternalLender(dst).lend_write("r", d_table, (0, TOKENS)).view()
    return src, dst, read, write, s_table, d_table


@pytest.mark.parametrize("coalesce", [True, False])
@pytest.mark.parametrize("case", list(CASES))
def test_descriptors_move_every_unit_into_its_place(case: str, coalesce: bool) -> None:
    src_spec, dst_spec = CASES[case]
    src, dst, read, write, s_table, d_table = _views(src_spec, dst_spec)
    plan = plan_transform(read.geometry, Rows.of_view(read), write.geometry, Rows.of_view(write))
    end = segments(plan)
    shape = shape_of(plan, end)
    chunks = cut_chunks(plan, end, 3000, hard=False)
    made = 0
    for first, stop in chunks:
        s, d, n = chunk_descriptors(plan, shape, first, stop, coalesce=coalesce)
        made += s.size
        for a, b, k in zip(s.tolist(), d.tolist(), n.tolist()):
            ctypes.memmove(b, a, k)
    assert made == count_descriptors(shape, chunks, coalesce=coalesce)
    first = dst_spec["heads"][0] - src_spec["heads"][0]
    want = kv_tokens(src.geometry, local_bytes(src), s_table, TOKENS)[:, :, first:first + dst.geometry.head_count]
    assert np.array_equal(kv_tokens(dst.geometry, local_bytes(dst), d_table, TOKENS), want)


def test_descriptor_counts_follow_the_layouts() -> None:
    def count(case: str) -> int:
        _, _, read, write, _, _ = _views(*CASES[case], spread=True)
        plan = plan_transform(read.geometry, Rows.of_view(read), write.geometry, Rows.of_view(write))
        return count_descriptors(shape_of(plan, segments(plan)), [(0, segments(plan))], coalesce=True)

    runs, planes = 7, 4  # 100 tokens in 16-token blocks, 2 layers of K and V
    assert count("same") == runs * planes  # a segment each (blocks are scattered)
    assert count("nhd-to-hnd") == TOKENS * planes * 4  # one per unit
    # HND both: a whole block's heads [1, 3) are one span at both ends (head-major); the last
    # run's 4 tokens are one descriptor per head.
    assert count("hnd-to-hnd-narrowed") == (runs - 1) * planes + planes * 2
    assert count("tp-rank") == TOKENS * planes  # one per token: its two heads are contiguous at both ends
    # Block-major pools: a block's planes follow each other, so a whole-block run is one
    # descriptor (the last run, 4 tokens of a block, is one per plane); not so where the
    # destination's blocks are larger (a run is half of each of its planes).
    assert count("block-major-pools") == (runs - 1) + planes
    assert count("block-major-pools-bt16-to-bt32") == runs * planes


def test_coalescing_stops_at_a_region_boundary() -> None:
    unit, bt = 16, 4
    plane = bt * unit  # one block of one head
    memory = {side: np.zeros(4 * plane, dtype=np.uint8) for side in ("src", "dst")}

    def geometry(buffer: np.ndarray, name: str) -> KVGeometry:
        base = int(buffer.ctypes.data)
        # K fills region a, V region b right after it: adjacent memory, two registrations.
        regions = (SlotRegion(f"{name}a", base, 1, plane, MemoryKind.HOST),
                   SlotRegion(f"{name}b", base + plane, 1, plane, MemoryKind.HOST))
        return KVGeometry(order=BlockOrder.LAYER_MAJOR, head_order=HeadOrder.NHD, layers=1, kv_heads=1, heads=(0, 1),
                          head_dim=8, dtype="float16", element_bytes=2, block_tokens=bt, blocks=1, regions=regions,
                          planes=((0, 0), (1, 0)), block_stride=plane, token_stride=unit, head_stride=unit)

    src, dst = geometry(memory["src"], "s"), geometry(memory["dst"], "d")
    rows = Rows(np.zeros(1, dtype=np.int64), np.zeros(1, dtype=np.int64), 0, bt)
    plan = plan_transform(src, rows, dst, rows)
    shape = shape_of(plan, segments(plan))
    s, _, n = chunk_descriptors(plan, shape, 0, segments(plan), coalesce=True)
    assert s.size == 2 and n.tolist() == [plane, plane]  # not one descriptor over both regions
    assert count_descriptors(shape, [(0, segments(plan))], coalesce=True) == 2


def test_chunks_keep_to_runs_and_budget() -> None:
    _, _, read, write, _, _ = _views(*CASES["bt16-to-bt32"])
    plan = plan_transform(read.geometry, Rows.of_view(read), write.geometry, Rows.of_view(write))
    end, run_bytes = segments(plan), 16 * 4 * 4 * 16
    soft = cut_chunks(plan, end, 2 * run_bytes + 1, hard=False)
    assert [b - a for a, b in soft] == [8, 8, 8, 4]  # two runs of 4 planes each, the last run alone
    assert all(a % plan.planes == 0 for a, _ in soft)
    over = cut_chunks(plan, end, run_bytes // 2, hard=False)  # a run over budget: a chunk alone
    assert [b - a for a, b in over] == [4] * 7
    hard = cut_chunks(plan, end, run_bytes // 2, hard=True)  # cut between its planes
    assert [b - a for a, b in hard] == [2] * 12 + [4]  # the last run (4 tokens) fits whole
    assert hard[0] == (0, 2) and hard[-1] == (24, 28)


def _job(case: str, packed: str, *, min_descriptors: int | None = None, fail_after: int | None = None,
         fetching: bool = False):
    _, _, read, write, _, _ = _views(*CASES[case])
    arena = Arena(8 * 4096, 4096, MemoryKind.HOST)
    transform = Oriented(plan_transform(read.geometry, Rows.of_view(read), write.geometry, Rows.of_view(write)),
                         local_is_src=True)
    hint = Hint(backend="nixl", mode=TransferMode.PUSH, agent="peer", request="r", transfer_id="t",
                layout=write.layout, groups=hint_groups(write), extras=((ARENA_EXTRA, arena.info.pack()),),
                geometry=write.geometry, tokens=write.tokens)
    policy = SendPolicy(packed=packed, min_descriptors=min_descriptors, chunk_bytes=ChunkBytes(), coalesce=True,
                        post_inline=None, window=4, pause_s=0.0, deadline_s=10.0, fail_after_rows=fail_after)
    attempt = TrackedAttempt(None, lambda a: None, "test")
    job = plan_geometry_job(policy, attempt, read, hint, transform, time.monotonic() + 10, ready=True,
                            fetching=fetching, arena=arena)
    return job, policy, transform, hint, arena, write


def test_auto_packs_the_layouts_with_many_descriptors() -> None:
    job, *_ = _job("nhd-to-hnd", "auto", min_descriptors=64)  # 1,600 descriptors in one host chunk
    assert isinstance(job, GeometryPackedJob)
    assert [(c.first, c.end) for c in job.chunks][:2] == [(0, 4), (4, 8)]  # a 16-token run per 4 KiB slot
    job, *_ = _job("same", "auto", min_descriptors=64)  # 28 descriptors
    assert isinstance(job, GeometryJob) and not isinstance(job, GeometryPackedJob)
    job, *_ = _job("nhd-to-hnd", "auto")  # the host threshold: 2,048 per chunk
    assert not isinstance(job, GeometryPackedJob)
    job, *_ = _job("same", "always")
    assert isinstance(job, GeometryPackedJob)
    job, *_ = _job("same", "never")
    assert not isinstance(job, GeometryPackedJob)
    job, *_ = _job("same", "always", fetching=True)  # pull stays unpacked
    assert not isinstance(job, GeometryPackedJob) and job.op == "READ"


def test_a_segment_larger_than_a_slot_goes_unpacked() -> None:
    _, policy, transform, hint, _, _ = _job("same", "always")
    small = Arena(2 * 512, 512, MemoryKind.HOST)  # a 16-token segment of 4 heads is 1 KiB
    assert packed_arena(policy, transform, segments(transform.plan), hint, small) is None


def test_fault_injection_counts_runs_and_masks_prove_whole_runs() -> None:
    job, *_ = _job("bt16-to-bt32", "never", fail_after=3)
    assert job.injected == "injected fault after 3 runs"
    assert job.chunks[-1].end == 3 * 4
    job.done.extend(range(len(job.chunks)))
    local, peer = job.masks()
    assert local[0].tolist() == [True, True, True, False, False, False, False]
    assert peer[0].tolist() == [True, False, False, False]


def test_landing_slots_ahead_for_a_geometry_fetch() -> None:
    job, _, transform, hint, arena, write = _job("nhd-to-hnd", "always")
    fetching = Oriented(transform.plan, local_is_src=False)
    wait = PassiveWait(TrackedAttempt(None, lambda a: None, "w"), write, hint, "own", 0.0, transform=fetching)
    assert landing_slots_ahead(wait, arena, packed="auto", min_descriptors=64) == 4
    assert landing_slots_ahead(wait, arena, packed="auto", min_descriptors=None) == 0  # host threshold
    assert landing_slots_ahead(wait, arena, packed="never", min_descriptors=64) == 0
    assert landing_slots_ahead(wait, None, packed="auto", min_descriptors=64) == 0


def test_rows_views_are_untouched_by_the_geometry_choice() -> None:
    region = SlotRegion("R", 1 << 20, 64, 16, MemoryKind.HOST)
    rows = LayerGroupRows("g", CacheKind.PAGED, region, np.arange(4, dtype=np.int64), np.arange(4, dtype=np.int64))
    view = View("r", TokenRange(0, 64), (rows,), b"L")
    hint = Hint(backend="nixl", mode=TransferMode.PUSH, agent="peer", request="r", transfer_id="t", layout=b"L",
                groups=hint_groups(view))
    wait = PassiveWait(TrackedAttempt(None, lambda a: None, "w"), view, hint, "own", 0.0)
    assert landing_slots_ahead(wait, Arena(8 * 4096, 4096, MemoryKind.HOST), packed="auto", min_descriptors=None) == 0
