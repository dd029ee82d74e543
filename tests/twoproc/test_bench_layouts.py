"""kvxfer bench's engine-layouts cases (``--preset layouts``) run end to end on CPU at a tiny size,
through the CLI's own entry: every case's figure is measured or skipped with its reason, the
kvxfer figures' bytes were checked at both decode ranks, the per-piece baseline posted one
descriptor per layer, K/V, block and rank, the ratios to the copy and to per-piece NIXL are
there, and no child is left. No figure's value is asserted (bench/results/ holds measured ones)."""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path

import pytest

from kvxfer.bench import cli, layouts_targets, results
from kvxfer.bench.config import LAYOUT_CASES
from kvxfer.testing.kv_ranks import PROCESS_NAME

pytest.importorskip("nixl._api", reason="the layouts cases need the nixl package")

BLOCKS, LAYERS = 4, 2  # 64 tokens, 2 layers: 512 KiB of KV


def test_layouts_preset_runs_through_the_cli_verified_and_reaped(tmp_path: Path) -> None:
    out = tmp_path / "layouts.json"
    rc = cli.main(["--preset", "layouts", "--memory", "host", "--rows", str(BLOCKS), "--groups", str(LAYERS),
                   "--warmup", "1", "--reps", "3", "--budget", "0.2", "--no-progress", "--json", str(out)])
    result = results.load(out)
    by_case = {f.case: f for f in result.figures}
    assert rc == 0, [(f.id, f.reason) for f in result.figures if f.status == "error"]
    assert set(by_case) == set(LAYOUT_CASES) and len(result.figures) == len(LAYOUT_CASES)
    for name in ("layouts_copy", "layouts_nixl_packed", "layouts_nixl_per_piece", "layouts_nixl_unpacked"):
        f = by_case[name]
        assert f.ok, (name, f.reason)
        assert f.facts["verified"] is True and (f.get("gbps_best") or 0) > 0 and f.metrics["reps"] >= 3
        assert f.key["total_bytes"] == 64 * 1024 * BLOCKS * LAYERS
    ipc = by_case["layouts_ipc"]
    assert ipc.status == "skipped" and ("CUDA" in ipc.reason or "IpcBackend.GEOMETRY" in ipc.reason), ipc.reason

    for name, path in (("layouts_nixl_packed", "packed"), ("layouts_nixl_unpacked", "unpacked")):
        facts = by_case[name].facts
        assert facts["path"] == path and facts["processes"] == 2 and facts["transfers_per_request"] == 2
        assert facts["rank_heads"] == [[0, 4], [4, 8]] and facts["verified_tokens_per_rank"] == BLOCKS * 16
        received = [stats["packed_received"] for stats in facts["decode_stats"]]  # each rank's own backend
        assert all(n > 0 for n in received) if path == "packed" else received == [0, 0]

    piece = by_case["layouts_nixl_per_piece"].facts
    assert piece["descriptors"] == LAYERS * 2 * BLOCKS * 2 == piece["descriptors_expected"]
    assert piece["descriptors_per_rank"] == [LAYERS * 2 * BLOCKS] * 2 and piece["descriptor_bytes"] == 16 * 4 * 256

    ratios = {r["case"]: r for r in layouts_targets.ratios(result)}
    assert ratios["layouts_nixl_packed"]["vs_copy"] > 0 and ratios["layouts_nixl_packed"]["vs_per_piece"] > 0
    assert ratios["layouts_nixl_per_piece"]["vs_per_piece"] is None  # not against itself
    rows = layouts_targets.evaluate(result)
    assert [r.status for r in rows] == ["not measured"] * 2  # both targets are judged on device memory
    assert "vs layouts_copy" in layouts_targets.markdown(result)
    assert not [p for p in mp.active_children() if p.name in (PROCESS_NAME, "kvxfer-bench-nixl-target")]
