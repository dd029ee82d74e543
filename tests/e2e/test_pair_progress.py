"""`kvxfer pair` shows its phases on stderr, in order, with their counts: reference outputs
(colocated generation), workers coming up, requests sent; stdout keeps the report alone, and
`--quiet` prints none of the progress."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

# A one-layer model and two short completions: the test is about the lines, not the model.
SMALL = ["--layers", "1", "--hidden", "32", "--heads", "2", "--kv-heads", "1", "--head-dim", "16",
         "--intermediate", "64", "--vocab", "64", "--requests", "2", "--min-len", "4", "--max-len", "40",
         "--max-new-tokens", "4"]
PHASES = ("computing reference outputs", "starting workers", "sending requests")


def _pair(tmp_path: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([sys.executable, "-m", "kvxfer.cli", "pair", *SMALL, "--json", str(tmp_path / "r.json"),
                           "--log-dir", str(tmp_path / "logs"), *extra], capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    assert json.loads((tmp_path / "r.json").read_text())["matched"] == 2
    assert done.stdout.startswith("kvxfer pair: nixl (push, inplace lender, integrity on)")  # the report, as before
    return done


def test_the_phases_show_on_stderr_in_order_with_their_counts(tmp_path: Path) -> None:
    done = _pair(tmp_path)
    err, lines = done.stderr, done.stderr.splitlines()
    firsts = [next(i for i, line in enumerate(lines) if phase in line) for phase in PHASES]
    assert firsts == sorted(firsts), err
    for count in ("computing reference outputs 2/2", "starting workers 2/2 up", "sending requests 2/2 done, 0 failed"):
        assert any(line.startswith(f"kvxfer pair: {count}") for line in lines), err
    # Which workers are up, as each announces it; then the router.
    assert any("prefill0 ready" in line for line in lines) and any("decode0 ready" in line for line in lines), err
    assert any(line.startswith("kvxfer pair: router up at http://") for line in lines), err
    # Not a terminal: plain lines at the milestones, no carriage returns, a handful per phase.
    assert "\r" not in err and len(lines) <= 16, err
    assert not any(phase in done.stdout for phase in PHASES)


def test_quiet_prints_no_progress(tmp_path: Path) -> None:
    done = _pair(tmp_path, "--quiet")
    assert not any(phase in done.stderr for phase in (*PHASES, "router up", "warm-up")), done.stderr
    assert "2 token-identical to colocated generation" in done.stdout
