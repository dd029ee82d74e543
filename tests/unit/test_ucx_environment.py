"""Importing ucxx sets UCX_* variables in os.environ; NIXL's own UCX in the same process, and
every process started from it, would read them (a NIXL pull probed after an import of ucxx
took TCP instead of CMA). The ucx backend keeps them, and its own settings, out of the environment."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvxfer.backends.ucx.transport import ucxx_unavailable

if (missing := ucxx_unavailable()) is not None:  # not importorskip: importing ucxx changes os.environ
    pytest.skip(missing, allow_module_level=True)

SCRIPT = """
import json, os
before = {k: v for k, v in os.environ.items() if k.startswith("UCX_")}
from kvxfer.backends.ucx import UcxBackend
from kvxfer.backends.ucx.transport import load_ucxx
backend = UcxBackend()
left = backend.shutdown()
after = {k: v for k, v in os.environ.items() if k.startswith("UCX_")}
print(json.dumps({"changed": {k: v for k, v in after.items() if before.get(k) != v},
                  "removed": sorted(set(before) - set(after)), "given": load_ucxx()[2], "left": len(left)}))
"""


def test_the_ucx_backend_leaves_the_ucx_environment_as_it_was() -> None:
    env = {"PATH": "/usr/bin:/bin", "HOME": "/tmp", "UCX_TLS": "all"}
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["left"] == 0
    # Nothing at all: ucxx's options, UCX's quieting and the host's UCX settings
    # (kvxfer.ucx_env) went to the backend's UCX alone.
    assert report["changed"] == {} and report["removed"] == []
    assert report["given"].get("RNDV_THRESH") == "8192", report["given"]
    assert report["given"].get("WARN_UNUSED_ENV_VARS") == "n", report["given"]
