"""The examples are part of the contract with users: each runs as its docstring says
(``.venv/bin/python examples/NAME.py``) and exits 0. Each is its own process, as a user runs
it, so that the examples run side by side with the rest of the suite."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
RUN = ("loopback_roundtrip", "lender_tour", "pair_local", "router_embed", "microbench", "two_process_nixl",
       "engine_kv_tour")
TIMEOUT_S = 240


def test_every_example_is_run() -> None:
    """A new example is added to RUN, or it is never checked."""
    assert sorted(p.stem for p in EXAMPLES.glob("*.py")) == sorted(RUN)


@pytest.mark.parametrize("name", RUN)
def test_example_runs_as_documented(name: str) -> None:
    done = subprocess.run([sys.executable, str(EXAMPLES / f"{name}.py")], cwd=EXAMPLES.parent, env=dict(os.environ),
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert done.returncode == 0, f"examples/{name}.py exited {done.returncode}:\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
    assert done.stdout.strip(), f"examples/{name}.py printed nothing"
