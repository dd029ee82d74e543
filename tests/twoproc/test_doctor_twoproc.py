"""kvxfer doctor end to end over host memory: two real processes, transports read from UCX,
figures and the JSON report; no probe process is left behind."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
from pathlib import Path

from kvxfer.testing.leftovers import marked_processes

# This module's doctor runs carry a mark of their own: tests running beside it (other workers'
# doctors) start probes too, and only ours must be gone.
_MARK = secrets.token_hex(8)
_ENV = {**os.environ, "KVXFER_DOCTOR_TEST": _MARK}


def _probe_processes() -> list[str]:
    ours = marked_processes(f"KVXFER_DOCTOR_TEST={_MARK}".encode())
    return [cmd for cmd in ours.values() if "kvxfer.doctor.probe" in cmd]


def test_doctor_reports_host_lanes_and_figures(tmp_path: Path) -> None:
    report_path = tmp_path / "doctor.json"
    run = subprocess.run(
        [sys.executable, "-m", "kvxfer.cli", "doctor", "--bytes", str(8 << 20), "--reps", "1", "--no-device",
         "--json", str(report_path)],
        capture_output=True, text=True, timeout=120, env=_ENV)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "[doctor] host: push (WRITE)" in run.stderr  # progress is shown as it goes
    report = json.loads(report_path.read_text())
    assert report["versions"]["nixl"] and report["versions"]["ucx"][0].isdigit()
    host = report["memory"]["host"]
    assert host["lanes"]["push"] and host["lanes"]["pull"], host["lanes"]  # UCX said which transports
    for lane in ("push", "pull"):
        assert all(f["best_gbps"] > 0 for f in host["figures"]["lanes"][lane].values())
    assert host["figures"]["rows"]["scattered_per_row_prepped"]["best_gbps"] > 0
    assert "NIXL 1.5.1" in run.stdout and "push (write) lane:" in run.stdout
    assert _probe_processes() == []


def test_doctor_strict_exits_1_when_a_lane_falls_back_to_tcp(tmp_path: Path) -> None:
    """With UCX held to TCP both host lanes fall back; --strict makes that the exit status
    (a script or CI step can gate on it), and without it the report still says so, exit 0."""
    env = {**_ENV, "UCX_TLS": "tcp"}
    base = [sys.executable, "-m", "kvxfer.cli", "doctor", "--bytes", str(1 << 20), "--reps", "1", "--no-device"]
    strict = subprocess.run(base + ["--strict"], capture_output=True, text=True, timeout=120, env=env)
    assert strict.returncode == 1, strict.stderr[-2000:]
    assert "lane falls back to TCP" in strict.stdout
    plain = subprocess.run(base, capture_output=True, text=True, timeout=120, env=env)
    assert plain.returncode == 0 and "lane falls back to TCP" in plain.stdout
    assert _probe_processes() == []
