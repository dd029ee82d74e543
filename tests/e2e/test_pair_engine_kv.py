"""`kvxfer pair` with ends of different TP, block size and layout, over NIXL on the CPU:
token-identical completions, every prompt block moved (nothing recomputed), and the flags
a TP group cannot keep refused before any process starts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvxfer.testing.processes import assert_nothing_left

CASES = {
    "tp1-layer16-to-tp2-block32": ["--prefill-tp", "1", "--prefill-kv-block-tokens", "16", "--prefill-kv-layout",
                                   "layer_major", "--decode-tp", "2", "--decode-kv-block-tokens", "32"],
    "tp2-to-tp1": ["--prefill-tp", "2", "--decode-tp", "1", "--decode-kv-layout", "layer_major"],
}


@pytest.mark.parametrize("mode", ["push", "pull"])
@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_pair_between_tp_groups_is_token_identical(tmp_path: Path, case: str, mode: str) -> None:
    report_path = tmp_path / "report.json"
    proc = subprocess.run(
        [sys.executable, "-m", "kvxfer.cli", "pair", "--requests", "6", "--min-len", "5", "--max-len", "120",
         "--max-new-tokens", "6", "--mode", mode, *CASES[case], "--json", str(report_path),
         "--log-dir", str(tmp_path / "logs"), "--quiet"],
        capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(report_path.read_text())
    assert report["requests"] == report["matched"] == 6 and report["failed"] == 0
    assert all(r["transfer"]["status"] == "delivered" and r["path"] == "disaggregated" for r in report["results"])
    assert report["rows"] == report["rows_requested"] > 0
    assert "engine geometries" in proc.stdout
    assert_nothing_left(report["config"]["processes"])


@pytest.mark.parametrize(("flags", "needle"), [
    (["--decode-tp", "3"], "--decode-tp 3 must divide"),
    (["--decode-tp", "2", "--backend", "ucx"], "moves pool rows only"),
    (["--decode-tp", "2", "--lender", "staging"], "lend in place"),
])
def test_pair_refuses_what_a_tp_group_cannot_keep(flags: list[str], needle: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "kvxfer.cli", "pair", *flags], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2 and needle in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
