"""`kvxfer pair` with rows damaged where they land at the decode worker (``--inject-corruption``):
integrity refuses them, the decode worker resumes at the first refused row and recomputes the
rest, and every request stays token-identical to colocated generation; between TP groups too
(TP 1 -> TP 2: engine geometries, where each destination block's digest is summed from the
source segments the publisher sent)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvxfer.testing.processes import assert_nothing_left


@pytest.mark.parametrize("tp", [[], ["--prefill-tp", "1", "--decode-tp", "2"]], ids=["pool-rows", "tp1-to-tp2"])
def test_pair_with_corrupted_rows_recomputes_them_and_stays_token_identical(tmp_path: Path, tp: list[str]) -> None:
    report_path = tmp_path / "report.json"
    proc = subprocess.run(
        [sys.executable, "-m", "kvxfer.cli", "pair", "--requests", "8", "--min-len", "40", "--max-len", "250",
         "--max-new-tokens", "8", "--inject-corruption", "0.2", "--on-failure", "recompute", "--warmup", "0",
         *tp, "--json", str(report_path), "--log-dir", str(tmp_path / "logs"), "--quiet"],
        capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(report_path.read_text())
    assert report["requests"] == report["matched"] == 8 and report["failed"] == 0
    assert report["config"]["inject_corruption"] == 0.2 and report["config"]["integrity"] == "on"
    refused = report["integrity_rows_refused"]["transfer"]
    assert refused > 0, "the injected corruption damaged no row"
    assert report["paths"].get("resumed", 0) > 0
    resumed = [r for r in report["results"] if r["path"] == "resumed"]
    assert all("recomputed" in " ".join(r["events"]) for r in resumed)
    assert f"integrity    {refused} transferred and 0 stored rows refused" in proc.stdout
    decode = (tmp_path / "logs" / "decode0.metrics").read_text()
    assert f'kvxfer_integrity_rows_failed_total{{source="transfer"}} {float(refused)}\n' in decode
    assert "kvxfer_open_leases 0.0\n" in decode and "kvxfer_quarantined_slots 0.0\n" in decode
    assert_nothing_left(report["config"]["processes"])
