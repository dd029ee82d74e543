"""Importing kvxfer changes nothing in the process: an engine that embeds it keeps its own
environment (its UCX settings above all), logging, signal handlers and threads. Each check
runs in a fresh interpreter, so that nothing this test process imported hides an effect."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

PROBE = r"""
import json, logging, os, signal, sys, threading

def state():
    handlers = {}
    for sig in signal.valid_signals():
        try:
            handlers[int(sig)] = repr(signal.getsignal(sig))
        except (OSError, ValueError):
            pass
    return {"environ": dict(os.environ), "threads": sorted(t.name for t in threading.enumerate()),
            "tasks": len(os.listdir("/proc/self/task")), "signals": handlers,
            "root": [logging.root.level, [repr(h) for h in logging.root.handlers], logging.root.manager.disable],
            "excepthook": repr(sys.excepthook)}

def changes(before, after):
    out = {}
    for key in before:
        if key == "environ":
            env = {k: after[key].get(k) for k in set(before[key]) | set(after[key]) if before[key].get(k) != after[key].get(k)}
            if env:
                out[key] = env
        elif before[key] != after[key]:
            out[key] = [before[key], after[key]]
    return out
"""

CONTRACT = PROBE + r"""
ours = set(sys.modules)
import numpy  # its own thread pool (OpenBLAS) is numpy's doing, not kvxfer's
before = state()
import kvxfer.contract
print(json.dumps({"changes": changes(before, state()), "modules": sorted(set(sys.modules) - ours)}))
"""

WALK = PROBE + r"""
import importlib, importlib.abc, pkgutil

EXTRAS = {"ucxx", "libucxx", "mooncake", "ray", "gguf", "tokenizers", "jinja2", "matplotlib", "openai", "transformers"}

class NoExtras(importlib.abc.MetaPathFinder):
    # The optional extras are installed here: refuse them, as an install without extras would.
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in EXTRAS:
            raise ModuleNotFoundError(f"no module named {name!r} (an extra)", name=name)
        return None

sys.meta_path.insert(0, NoExtras())
# kvxfer's required dependencies first: what importing them does is theirs, not kvxfer's.
for name in ("numpy", "msgpack", "torch", "nixl._api", "aiohttp", "aiohttp.web", "prometheus_client", "etcd3gw"):
    importlib.import_module(name)
before = state()
imported, needs_extra = [], {}
import kvxfer
for info in pkgutil.walk_packages(kvxfer.__path__, "kvxfer."):
    if info.name.endswith("__main__"):
        continue
    try:
        importlib.import_module(info.name)
    except ModuleNotFoundError as exc:
        if (exc.name or "").split(".")[0] not in EXTRAS:
            raise
        needs_extra[info.name] = exc.name
        continue
    imported.append(info.name)
print(json.dumps({"changes": changes(before, state()), "imported": imported, "needs_extra": needs_extra}))
"""


def _run(code: str) -> dict[str, object]:
    # A clean environment, as a fresh engine process would have it (no UCX_* of ours).
    env = {k: v for k, v in os.environ.items() if not k.startswith(("UCX_", "KVXFER_"))}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def test_importing_the_contract_changes_nothing_and_pulls_in_only_numpy_and_the_standard_library() -> None:
    report = _run(CONTRACT)
    assert report["changes"] == {}, report["changes"]
    modules = report["modules"]
    assert isinstance(modules, list)
    ours = sorted(m for m in modules if m.split(".")[0] == "kvxfer")
    assert all(m == "kvxfer" or m.startswith("kvxfer.contract") for m in ours), ours
    allowed = set(sys.stdlib_module_names) | {"numpy", "kvxfer"}
    others = sorted({m.split(".")[0] for m in modules} - allowed - {"_distutils_hack"})
    assert others == [], others


@pytest.mark.slow  # about 10 s: torch, aiohttp and every module of kvxfer
def test_importing_every_module_changes_nothing() -> None:
    report = _run(WALK)
    assert report["changes"] == {}, report["changes"]
    imported = report["imported"]
    assert isinstance(imported, list)
    # The walk really reached the serving stack and the backends, not just the contract.
    for name in ("kvxfer.worker.serve", "kvxfer.router.serve", "kvxfer.backends.nixl.agent", "kvxfer.doctor",
                 "kvxfer.native", "kvxfer.ucx_env"):
        assert name in imported, (name, report["needs_extra"])
    assert "kvxfer.launch.launcher" in report["needs_extra"]  # Ray is an extra
