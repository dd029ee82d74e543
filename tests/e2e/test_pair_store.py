"""kvxfer pair --store: round 1 puts, round 2 (another instance, fresh workers) takes every
looked-up prompt block from the store; all completions token-identical."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest


def _pair(tmp: Path, *flags: str) -> dict:  # type: ignore[type-arg]
    out = tmp / "report.json"
    done = subprocess.run([sys.executable, "-m", "kvxfer.cli", "pair", "--requests", "5", "--max-new-tokens", "6",
                           "--quiet", "--json", str(out), "--log-dir", str(tmp / "logs"), *flags],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "store        round 2:" in done.stdout, done.stdout
    return json.loads(out.read_text())  # type: ignore[no-any-return]


@pytest.mark.parametrize(("store", "layerwise"), [("memory", 1), ("mooncake", 1), ("memory", 2)])
def test_the_second_round_takes_the_prompts_from_the_store(store: str, layerwise: int, tmp_path: Path) -> None:
    """With --layerwise 2 the prefill workers stream two layer groups and put each group's
    rows under names of their own; round 2 still takes every looked-up row from the store."""
    if store == "mooncake":
        pytest.importorskip("mooncake.store", reason="the store extra (Mooncake) is not installed")
    report = _pair(tmp_path, "--store", store, "--layerwise", str(layerwise))
    assert report["config"]["layerwise"] == layerwise
    assert report["matched"] == report["requests"] == 10
    first, second = report["store_rounds"]
    assert first["store_rows"]["put_hit"] > 0
    asked = second["store_rows"]["get_hit"] + second["store_rows"]["get_miss"]
    assert asked > 0 and second["store_rows"]["get_hit"] == asked, second
    assert (tmp_path / "logs" / "round2" / "decode0.metrics").exists()


def test_store_flags_that_cannot_work_are_one_line(tmp_path: Path) -> None:
    for flags, words in ((["--store-path", str(tmp_path)], "--store-path needs --store"),
                         (["--store", "memory", "--lender", "staging"], "use --lender inplace"),
                         (["--store", "memory", "--decode-tp", "2"], "does not use a KV store")):
        done = subprocess.run([sys.executable, "-m", "kvxfer.cli", "pair", *flags], capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 2 and words in done.stderr and "Traceback" not in done.stderr, done.stderr
