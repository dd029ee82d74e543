"""`kvxfer pair --mode pull` probes the real NIXL lanes first and never runs a TCP pull silently."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def _pair(tmp_path: Path, *extra: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "kvxfer.cli", "pair", "--mode", "pull", "--requests", "2", "--warmup", "0",
           "--max-new-tokens", "4", "--quiet", "--log-dir", str(tmp_path / "logs"), *extra]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=240, env={**os.environ, **(env or {})})


def test_tcp_pull_lane_is_refused_before_any_worker_starts(tmp_path: Path) -> None:
    # UCX restricted to TCP: the probe sees it, and the fail policy stops before any worker.
    done = _pair(tmp_path, "--pull-on-tcp", "fail", env={"UCX_TLS": "tcp,self"})
    assert done.returncode == 2, done.stderr
    assert "pull (READ) lane is TCP" in done.stderr
    assert not (tmp_path / "logs" / "processes.json").exists()


def test_pull_on_a_shared_memory_lane_runs_and_reports_its_lanes(tmp_path: Path) -> None:
    report = tmp_path / "report.json"
    done = _pair(tmp_path, "--json", str(report))
    assert done.returncode == 0, done.stderr
    config = json.loads(report.read_text())["config"]
    assert config["mode"] == config["mode_requested"] == "pull"
    assert config["lanes"]["pull"] and not any(t.startswith("tcp") for t in config["lanes"]["pull"])
