"""`kvxfer pair --engine transformers --model smollm2` end to end: two `kvxfer serve --engine
transformers` workers (SmolLM2 loaded by transformers itself from the GGUF), the router, NIXL:
every completion token-identical to transformers' own colocated `generate_batch`, every
process gone after; and `kvxfer serve` without the flag never imports transformers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from kvxfer.testing.processes import assert_nothing_left


def test_pair_transformers_is_token_identical_to_generate_batch(tmp_path: Path) -> None:
    report_path = tmp_path / "report.json"
    proc = subprocess.run(
        [sys.executable, "-m", "kvxfer.cli", "pair", "--engine", "transformers", "--model", "smollm2",
         "--requests", "4", "--concurrency", "4", "--max-new-tokens", "4", "--warmup", "0", "--blocks", "64",
         "--json", str(report_path), "--log-dir", str(tmp_path / "logs"), "--quiet"],
        capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(report_path.read_text())
    assert report["config"]["engine"] == "transformers"
    assert report["requests"] == report["matched"] == 4 and report["failed"] == 0
    results = report["results"]
    assert len({r["prompt_tokens"] for r in results}) > 1  # mixed lengths
    assert all(r["transfer"]["status"] == "delivered" and r["path"] == "disaggregated" for r in results), results
    assert_nothing_left(report["config"]["processes"])


def test_serving_without_the_engine_flag_never_imports_transformers() -> None:
    code = ("import sys, kvxfer.worker.serve, kvxfer.worker.core, kvxfer.worker.app, kvxfer.pair, kvxfer.router.serve; "
            "print('transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stdout + out.stderr
