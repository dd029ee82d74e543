"""NIXL and ucxx in one process. NIXL's wheel bundles its own UCX (1.23: libraries renamed by
auditwheel, in nixl_cu*.libs, loaded when the first NIXL agent starts); ucxx uses the libucx
wheel's UCX (1.21, loaded RTLD_LOCAL when the first UcxBackend starts). They are two copies
with separate symbols, and both work side by side: NixlBackend and UcxBackend pairs in one
process move rows byte for byte, push and pull, each end publishing and fetching, one after
the other and both at once, whichever UCX was loaded first.

The load order is checked in fresh processes (``sys.executable -c``, under a timeout: a crash
or a hang there fails the test, not pytest): ucxx first, then NIXL, and NIXL first, then ucxx.
pytest's own process loads them in whatever order its earlier tests did.
"""

from __future__ import annotations

import ctypes
import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvxfer.contract import CacheKind, Delivered, LayerGroupRows, TokenRange, TransferMode, View
from kvxfer.testing.conformance import Pair, check_round_trip_exact
from kvxfer.testing.nixl_pairs import nixl_pair
from kvxfer.testing.ucx_pairs import ucx_pair

if importlib.util.find_spec("ucxx") is None:  # found, not imported: importing it loads its UCX
    pytest.skip("the ucx backend needs ucxx (pip install 'kvxfer[ucx]')", allow_module_level=True)

FACTORIES: dict[str, Callable[[TransferMode], Pair]] = {"nixl": nixl_pair, "ucx": ucx_pair}
RUN_TIMEOUT = 60.0
MARK = "@@kvxfer-coexist "
CHILD = "import runpy, sys; runpy.run_path(sys.argv[1])['both_in_one_process'](sys.argv[2])"
STEPS = ["loaded", "moved", "loaded", "moved", "moved again", "together", "closed"]

Report = Callable[..., None]


def _print(step: str, **fields: Any) -> None:
    print(MARK + json.dumps({"step": step, **fields}), flush=True)


def ucp_libraries() -> dict[str, str]:
    """The copies of libucp mapped into this process: path -> the UCX version it reports."""
    paths = sorted({line.split()[-1] for line in Path("/proc/self/maps").read_text().splitlines()
                    if "/libucp" in line.split()[-1]})
    found = {}
    for path in paths:
        lib = ctypes.CDLL(path, os.RTLD_NOLOAD)  # the copy already mapped, not a new one
        lib.ucp_get_version_string.restype = ctypes.c_char_p
        found[path] = lib.ucp_get_version_string().decode()
    return found


def _owner(path: str) -> str:
    """Which package a libucp belongs to: NIXL's bundled copy or the libucx wheel's (ucxx)."""
    return "nixl" if "nixl" in Path(path).parent.name else "ucx" if "libucx" in path else "?"


def _together(pairs: dict[str, Pair]) -> dict[str, bool]:
    """One push on each pair, both submitted before either is waited on: name -> bytes arrived."""
    started = {}
    for seed, (name, pair) in enumerate(pairs.items()):
        rng = np.random.default_rng(seed)
        lg, pg, payload = [], [], {}
        for i, (lr, pr) in enumerate(zip(pair.local_regions, pair.peer.regions)):
            n = min(24, lr.slots, pr.slots)
            ordinals = np.arange(n, dtype=np.int64)
            lg.append(LayerGroupRows(f"g{i}", CacheKind.PAGED, lr, rng.permutation(lr.slots)[:n].astype(np.int64),
                                     ordinals))
            pg.append(LayerGroupRows(f"g{i}", CacheKind.PAGED, pr, rng.permutation(pr.slots)[:n].astype(np.int64),
                                     ordinals))
            payload[f"g{i}"] = rng.integers(0, 256, n * lr.slot_bytes, dtype=np.uint8).tobytes()
        tokens = TokenRange(0, 24 * 16)
        local_view, peer_view = View(f"both-{name}", tokens, tuple(lg), b"co"), View(f"both-{name}", tokens, tuple(pg), b"co")
        for g in local_view.groups:
            pair.local_memory.write(g.region.name, g.slots, payload[g.layer_group])
        local_hint, peer_hint = pair.local.describe(local_view), pair.peer.describe(peer_view)
        handle = pair.peer.start("fetch", peer_view, local_hint)
        started[name] = (pair.local.publish(local_view, peer_hint), handle, peer_view, payload)
    arrived = {}
    for name, (attempt, handle, peer_view, payload) in started.items():
        pair = pairs[name]
        assert attempt.wait(15.0), f"{name}: no outcome"
        peer_outcome, _ = pair.peer.result(handle, 15.0)
        assert isinstance(attempt.poll(), Delivered) and isinstance(peer_outcome, Delivered), (
            name, attempt.poll(), peer_outcome)
        arrived[name] = all(pair.peer.read(g.region.name, g.slots) == payload[g.layer_group] for g in peer_view.groups)
    return arrived


def both_in_one_process(order: str, report: Report = _print) -> None:
    """Start the backends in ``order`` ("ucx,nixl" or "nixl,ucx"), keeping a pair of each alive:
    rows move byte for byte through each once it is loaded, through the first again once the
    second is, and through both at once; every pair shuts down with nothing left."""
    first, second = order.split(",")
    kept: dict[str, Pair] = {}
    try:
        for name in (first, second):
            kept[name] = FACTORIES[name](TransferMode.PUSH)  # its UCX is loaded by now
            report("loaded", backend=name, ucp=ucp_libraries())
            for mode in TransferMode:
                check_round_trip_exact(FACTORIES[name], mode)  # push and pull, each end publishing and fetching
            report("moved", backend=name)
        for mode in TransferMode:
            check_round_trip_exact(FACTORIES[first], mode)
        report("moved again", backend=first)
        report("together", arrived=_together(kept))
    finally:
        left = {name: len(pair.local.shutdown()) + pair.peer.shutdown() for name, pair in kept.items()}
    report("closed", left=left)


def test_nixl_and_ucx_in_this_process() -> None:
    steps: list[dict[str, Any]] = []
    both_in_one_process("nixl,ucx", lambda step, **fields: steps.append({"step": step, **fields}))
    assert [s["step"] for s in steps] == STEPS
    assert steps[STEPS.index("together")]["arrived"] == {"nixl": True, "ucx": True}
    assert steps[-1]["left"] == {"nixl": 0, "ucx": 0}
    libraries = ucp_libraries()
    assert sorted(_owner(p) for p in libraries) == ["nixl", "ucx"], libraries


@pytest.mark.parametrize("order", ["ucx,nixl", "nixl,ucx"])
def test_load_order_in_a_fresh_process(order: str) -> None:
    command = [sys.executable, "-c", CHILD, __file__, order]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=RUN_TIMEOUT, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{order}: the process hung (killed after {RUN_TIMEOUT:g}s); stdout: {exc.stdout!r}")
    steps = [json.loads(line[len(MARK):]) for line in done.stdout.splitlines() if line.startswith(MARK)]
    tail = "\n".join(done.stderr.splitlines()[-30:])
    assert done.returncode == 0, f"{order}: exit status {done.returncode}; steps {[s['step'] for s in steps]}\n{tail}"
    assert [s["step"] for s in steps] == STEPS, tail
    first, second = order.split(",")
    after_first, after_both = steps[0]["ucp"], steps[2]["ucp"]
    # The first backend moved its rows with only its own UCX loaded; then both were.
    assert [_owner(p) for p in after_first] == [first], after_first
    assert sorted(_owner(p) for p in after_both) == sorted([first, second]), after_both
    assert steps[STEPS.index("together")]["arrived"] == {first: True, second: True}
    assert steps[-1]["left"] == {first: 0, second: 0}
