"""`kvxfer pair` end to end: real worker and router processes over NIXL, 20 prompts of mixed
lengths, token-identical to colocated generation; nothing left running after success or Ctrl-C."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvxfer.backends.ucx.transport import ucxx_unavailable
from kvxfer.testing.processes import assert_nothing_left


def test_pair_twenty_mixed_prompts_token_identical(tmp_path: Path) -> None:
    report_path = tmp_path / "report.json"
    proc = subprocess.run(
        [sys.executable, "-m", "kvxfer.cli", "pair", "--requests", "20", "--min-len", "3", "--max-len", "150",
         "--max-new-tokens", "16", "--json", str(report_path), "--log-dir", str(tmp_path / "logs"), "--quiet"],
        capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(report_path.read_text())
    assert report["requests"] == report["matched"] == 20 and report["failed"] == 0
    lengths = sorted(r["prompt_tokens"] for r in report["results"])
    assert lengths[0] == 3 and lengths[-1] == 150 and len(set(lengths)) == 20
    assert all(r["tokens"] == r["expected"] and len(r["tokens"]) == 16 for r in report["results"])
    assert report["transfers"] == 20 and report["rows"] > 0
    # Every transfer delivered; rows not delivered are blocks the decode worker already had
    # cached (the warm-up request repeats the first prompt), never missing ones.
    assert all(r["transfer"]["status"] == "delivered" for r in report["results"])
    assert report["rows"] + report["rows_cached_at_decode"] == report["rows_requested"]
    assert report["ttft_s"]["p50"] > 0 and report["transfer_s"]["p99"] >= report["transfer_s"]["p50"] > 0
    assert "token-identical to colocated generation" in proc.stdout
    logs = tmp_path / "logs"
    router = (logs / "router.metrics").read_text()
    assert 'kvxfer_router_requests_total{path="disaggregated",result="ok"} 21.0\n' in router  # 20 + the warm-up
    decode = (logs / "decode0.metrics").read_text()
    assert 'kvxfer_transfers_total{status="delivered"} 21.0\n' in decode
    assert "kvxfer_open_leases 0.0\n" in decode and "kvxfer_quarantined_slots 0.0\n" in decode
    assert report["config"]["integrity"] == "on"  # the default: every row checked, none refused
    assert 'kvxfer_integrity_rows_failed_total{source="transfer"} 0.0\n' in decode
    assert 'kvxfer_generated_tokens_total 315.0\n' in decode  # 21 requests x 15 tokens after the first
    assert_nothing_left(report["config"]["processes"])


def test_pair_ctrl_c_stops_every_process(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvxfer.cli", "pair", "--requests", "24", "--max-new-tokens", "32", "--warmup", "0",
         "--log-dir", str(logs), "--quiet"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        # A shell that ran the suite in the background hands SIGINT down as ignored, and Python
        # then installs no KeyboardInterrupt handler: give the child the terminal's default.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.default_int_handler))
    try:
        deadline = time.monotonic() + 180
        while not (logs / "processes.json").exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.1)
        processes = json.loads((logs / "processes.json").read_text())
        time.sleep(0.5)  # mid-workload
        os.kill(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err
    assert "interrupted" in err
    assert_nothing_left(processes)


def test_pair_over_the_ucx_backend_push_and_pull_token_identical(tmp_path: Path) -> None:
    """`kvxfer pair --backend ucx`: the same workload over ucxx's UCX, push then pull."""
    if (missing := ucxx_unavailable()) is not None:  # not importorskip: importing ucxx changes os.environ
        pytest.skip(missing)
    for mode in ("push", "pull"):
        report_path = tmp_path / f"{mode}.json"
        proc = subprocess.run(
            [sys.executable, "-m", "kvxfer.cli", "pair", "--backend", "ucx", "--mode", mode, "--requests", "8",
             "--json", str(report_path), "--log-dir", str(tmp_path / f"logs-{mode}"), "--quiet"],
            capture_output=True, text=True, timeout=240)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        report = json.loads(report_path.read_text())
        assert report["config"]["backend"] == "ucx" and report["config"]["mode"] == mode
        assert report["requests"] == report["matched"] == 8 and report["failed"] == 0
        assert all(r["transfer"]["status"] == "delivered" for r in report["results"])
        assert report["rows"] + report["rows_cached_at_decode"] == report["rows_requested"]
        decode = (tmp_path / f"logs-{mode}" / "decode0.metrics").read_text()
        assert "kvxfer_open_leases 0.0\n" in decode and "kvxfer_quarantined_slots 0.0\n" in decode
        assert_nothing_left(report["config"]["processes"])
