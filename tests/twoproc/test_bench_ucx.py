"""kvxfer bench's ``ucx_2p`` case (UcxBackend, peer in a second process) run end to end on
CPU: figures measured and verified byte for byte, the children reaped, the target row
beside ``nixl_2p``, and a clean skip where ucxx does not import. No figure's value is
asserted (timing inside tests proves nothing); bench/results/ holds the measured ones."""

from __future__ import annotations

import dataclasses
import multiprocessing
import sys

import pytest

import kvxfer.backends.ucx.transport as transport
from kvxfer.backends.ucx.transport import ucxx_unavailable
from kvxfer.bench import cases, evaluate, preset, render_text, run
from kvxfer.bench.cases import Requirement
from kvxfer.bench.config import Repetition, ThroughputSweep
from kvxfer.testing.subprocess_peer import live_children


def _config(names: tuple[str, ...], sweep: ThroughputSweep):  # type: ignore[no-untyped-def]
    return dataclasses.replace(preset("tiny"), cases=names, throughput=(sweep,), latency=None, overhead=None,
                               repetition=Repetition(warmup=1, reps=3, budget_s=0.2))


def test_ucx_2p_sweep_is_measured_verified_and_reaped() -> None:
    if (missing := ucxx_unavailable()) is not None:  # not importorskip: importing ucxx changes os.environ
        pytest.skip(missing)
    sweep = ThroughputSweep(row_bytes=(4096, 64 << 10), rows=(16,), directions=("push", "pull"),
                            memory=("host", "device"), slots=("contiguous", "scattered"))
    result = run(_config(("ucx_2p",), sweep))
    host = [f for f in result.figures if f.key["memory"] == "host"]
    assert len(host) == 8 and all(f.ok for f in host), [(f.id, f.reason) for f in host if not f.ok]
    for f in host:
        assert f.facts["verified"] is True and f.facts["processes"] == 2
        assert f.facts["transport"] == "UCX tag messages (ucxx)" and f.facts["ucxx"] and f.facts["window"] > 0
        assert f.metrics["reps"] >= 3 and 0 < f.metrics["seconds_best"] <= f.metrics["seconds_median"]
        assert (f.get("gbps_best") or 0) > 0
    import torch

    if not torch.cuda.is_available():  # device rows: skipped, and why
        device = [f for f in result.figures if f.key["memory"] == "device"]
        assert device and {(f.status, f.reason) for f in device} == {("skipped", "device memory: no CUDA device")}
    assert multiprocessing.active_children() == [] and live_children() == []


def test_ucx_2p_is_judged_against_nixl_2p_in_the_same_run() -> None:
    if (missing := ucxx_unavailable()) is not None:  # not importorskip: importing ucxx changes os.environ
        pytest.skip(missing)
    pytest.importorskip("nixl._api", reason="nixl_2p needs the nixl package")
    sweep = ThroughputSweep(row_bytes=(64 << 10,), rows=(16,), directions=("push",), slots=("scattered",))
    result = run(_config(("nixl_2p", "ucx_2p"), sweep))
    assert all(f.ok for f in result.figures), [(f.id, f.reason) for f in result.figures if not f.ok]
    rows = [r for r in evaluate(result) if r.case == "ucx_2p"]
    assert len(rows) == 1 and rows[0].status in ("pass", "fail")
    assert rows[0].measured.endswith("of nixl_2p (2 processes)") and rows[0].threshold == "≥ 90% of the NIXL backend (nixl_2p)"
    assert rows[0].shape == "push, scattered, 64 KiB rows, 1 MiB"
    assert live_children() == []


def test_ucx_2p_is_skipped_with_the_reason_where_ucxx_does_not_import(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "ucxx._lib.libucxx", None)  # import_module then raises ImportError
    monkeypatch.setattr(transport, "_LOADED", None)  # as in a process that never loaded ucxx
    real = cases.requirement_missing
    # requirement_missing caches its answers per process: ask the uncached check under the patch.
    monkeypatch.setattr(cases, "requirement_missing",
                        lambda req: cases._ucxx_missing() if req is Requirement.UCXX else real(req))
    sweep = ThroughputSweep(row_bytes=(4096,), rows=(4,), directions=("push",), slots=("scattered",))
    result = run(_config(("ucx_2p", "local_copy"), sweep))
    ucx = [f for f in result.figures if f.case == "ucx_2p"]
    assert ucx and all(f.status == "skipped" and f.reason.startswith("the ucx backend needs ucxx") for f in ucx)
    assert all(f.ok for f in result.figures if f.case == "local_copy")
    assert "ucx_2p: skipped: the ucx backend needs ucxx" in render_text(result, evaluate(result))
    assert live_children() == []
