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


RACE = """
import json, threading
from kvxfer.backends.ucx.transport import load_ucxx
barrier, got = threading.Barrier(4), []
def load():
    barrier.wait()
    got.append(load_ucxx())
threads = [threading.Thread(target=load) for _ in range(4)]
for t in threads:
    t.start()
for t in threads:
    t.join()
print(json.dumps({"options": [g[2] for g in got], "same": all(g is got[0] for g in got),
                  "loaded": load_ucxx() is got[0]}))
"""


def test_threads_loading_ucxx_at_once_all_get_the_options_ucxx_wanted() -> None:
    """The first load imports ucxx and takes the options it set; a second that began before the
    first ended found ucxx imported, saw no option set, and (before a lock made the load once
    only) replaced the first's result with one without them."""
    env = {"PATH": "/usr/bin:/bin", "HOME": "/tmp"}
    done = subprocess.run([sys.executable, "-c", RACE], capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["same"] and report["loaded"], report
    assert all(options.get("RNDV_THRESH") == "8192" for options in report["options"]), report["options"]
