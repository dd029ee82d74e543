"""The engine-layouts bench's arithmetic, in one process: the workload a point describes, the
per-piece baseline's descriptors (copied here piece by piece they land each rank's heads in
its block-major pool, the same bytes a transform moves), the IPC case's skip until the IPC
backend moves geometries, and the targets' judgement."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from kvxfer.bench import layouts, layouts_targets
from kvxfer.bench.cases import Skip
from kvxfer.bench.config import Point, preset
from kvxfer.bench.layouts_raw import pieces, rank_specs, source_spec, span_bytes, tables
from kvxfer.bench.results import BenchResult, Figure
from kvxfer.testing.kv_ranks import build_kv, fill_random, gather_tokens

K = 1 << 10


def test_the_preset_is_the_issue_workload_on_a_gpu_and_a_smaller_one_on_the_host() -> None:
    cfg = preset("layouts")
    points = {p.memory: p for p in cfg.throughput_points()}
    assert set(points) == {"device", "host"} and all(p.slots == "scattered" for p in points.values())
    gpu = layouts.Workload.of(points["device"], cfg.pool_factor)
    assert (gpu.tokens, gpu.layers, gpu.kv_heads, points["device"].total_bytes) == (4096, 32, 8, 512 << 20)
    assert gpu.rank_heads == [(0, 4), (4, 8)] and gpu.dst_blocks == 128 and gpu.dst_pool == 256
    cpu = layouts.Workload.of(points["host"], cfg.pool_factor)
    assert (cpu.tokens, cpu.layers, cpu.kv_heads, points["host"].total_bytes) == (1024, 8, 8, 32 << 20)
    with pytest.raises(Skip, match="64 KiB rows"):
        layouts.Workload.of(Point("push", "host", "scattered", 40 * K, 4, 2), 2)  # 5 heads


def test_tables_are_distinct_random_block_ids_and_every_case_draws_the_same() -> None:
    wl = layouts.Workload.of(Point("push", "host", "scattered", 64 * K, 64, 2), 2)
    s, d = wl.tables(7)
    assert s.size == 64 and np.unique(s).size == 64 and s.max() < 128 and not np.array_equal(s, np.sort(s))
    assert [t.size for t in d] == [32, 32] and not np.array_equal(d[0], d[1])
    s2, d2 = wl.tables(7)
    assert np.array_equal(s, s2) and all(np.array_equal(a, b) for a, b in zip(d, d2))
    tokens = wl.sampled_tokens(3)
    assert tokens.size == layouts.SAMPLED_TOKENS and np.unique(tokens).size == tokens.size
    assert tokens[0] == 0 and tokens[-1] == wl.tokens - 1


@pytest.mark.parametrize("slots", ["scattered", "contiguous"])
def test_per_piece_descriptors_land_each_ranks_heads_exactly(slots: str) -> None:
    """Copied piece by piece, the descriptors put each rank's heads of every token, layer, K
    and V where the baseline's HND pools keep them: the same KV a transform moves."""
    blocks, layers = 5, 3
    wl = layouts.Workload.of(Point("push", "host", slots, 64 * K, blocks, layers), 2)
    s_table, d_tables = tables(wl, 1)
    assert np.array_equal(s_table, wl.tables(1)[0])  # the kvxfer cases' prefill blocks
    assert all(np.unique(t).size == blocks and t.max() < wl.src_pool for t in d_tables)
    local, remote, piece = pieces(wl, s_table, d_tables)
    assert piece == 16 * K and [x.size for x in local] == [layers * 2 * blocks] * 2
    src = build_kv(source_spec(wl))
    ranks = [build_kv(spec) for spec in rank_specs(wl)]
    fill_random(src.tensors, 3)
    src_bytes = torch.cat([t.reshape(-1).view(torch.uint8) for t in src.tensors]).numpy()
    dst_bytes = np.zeros(span_bytes(wl), dtype=np.uint8)
    assert src_bytes.size == dst_bytes.size == sum(t.numel() * 2 for kv in ranks for t in kv.tensors)
    for lo, ro in zip(np.concatenate(local), np.concatenate(remote)):
        dst_bytes[ro:ro + piece] = src_bytes[lo:lo + piece]
    rank_bytes = dst_bytes.size // 2
    tokens = np.arange(wl.tokens)
    for r, kv in enumerate(ranks):
        mine = dst_bytes[r * rank_bytes:(r + 1) * rank_bytes]
        kv.tensors[0].reshape(-1).view(torch.uint8).copy_(torch.from_numpy(mine))
        got = gather_tokens(kv.geometry, kv.tensors, d_tables[r], tokens)
        want = gather_tokens(src.geometry, src.tensors, s_table, tokens, wl.rank_heads[r])
        assert np.array_equal(got, want), f"rank {r}"


def test_the_ipc_case_skips_until_the_ipc_backend_moves_geometries(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvxfer.backends.ipc import IpcBackend

    case = layouts.TransformCase(preset("layouts"), layouts.ipc_mover())
    point = Point("push", "device", "scattered", 64 * K, 4, 2)
    monkeypatch.setattr(IpcBackend, "GEOMETRY", False, raising=False)
    with pytest.raises(Skip, match="IpcBackend.GEOMETRY is not True"):
        case.throughput(point)
    with pytest.raises(Skip, match="moves device memory"):
        case.throughput(dataclasses.replace(point, memory="host"))
    monkeypatch.setattr(IpcBackend, "GEOMETRY", True)
    assert layouts.ipc_mover().missing() is None


def _figure(case: str, memory: str, seconds: float) -> Figure:
    key = {"memory": memory, "total_bytes": 1 << 30}
    if case != "layouts_copy":
        key = {"memory": memory, "direction": "push", "slots": "scattered", "row_bytes": 64 * K, "rows": 256,
               "groups": 64, "total_bytes": 1 << 30}
    return Figure("throughput", case, "x", key, "ok", metrics={"seconds_best": seconds, "seconds_median": seconds})


def test_targets_judge_device_figures_against_the_copy_and_per_piece() -> None:
    figures = (_figure("layouts_copy", "device", 1.0), _figure("layouts_ipc", "device", 1.25),
               _figure("layouts_nixl_packed", "device", 2.0), _figure("layouts_nixl_per_piece", "device", 30.0),
               _figure("layouts_copy", "host", 1.0), _figure("layouts_nixl_packed", "host", 2.0))
    result = BenchResult("now", {}, {}, {"name": "layouts"}, figures)
    rows = layouts_targets.evaluate(result)
    assert [(r.case, r.status, r.measured) for r in rows] == [
        ("layouts_ipc", "pass", "80.0% of layouts_copy"),
        ("layouts_nixl_packed", "fail", "15.0x layouts_nixl_per_piece")]
    host = [r for r in layouts_targets.ratios(result) if r["shape"].startswith("host")]
    assert [(r["case"], r["vs_copy"], r["vs_per_piece"]) for r in host] == [
        ("layouts_copy", None, None), ("layouts_nixl_packed", 0.5, None)]
