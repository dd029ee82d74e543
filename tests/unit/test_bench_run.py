"""kvxfer bench end to end on loopback: a tiny real sweep, skips with reasons, nothing left running.

No figure is asserted here (timing inside unit tests proves nothing); what is checked is
that every planned figure is reported, that bytes were verified, and the outputs.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import threading
from pathlib import Path

import pytest

from kvxfer.bench import cli, evaluate, preset, render_text, run
from kvxfer.bench.cases import CaseSpec, Requirement, Role
from kvxfer.bench.config import ThroughputSweep
from kvxfer.bench.registry import registry
from kvxfer.bench.results import load


def _tiny(cases: tuple[str, ...] = ("local_copy", "loopback")):  # type: ignore[no-untyped-def]
    return dataclasses.replace(preset("tiny"), cases=cases)


def test_tiny_loopback_sweep_end_to_end() -> None:
    before = {t.ident for t in threading.enumerate()}
    result = run(_tiny())
    by_mode = {m: [f for f in result.figures if f.mode == m] for m in ("throughput", "latency", "overhead")}
    assert all(f.ok for f in result.figures), [(f.id, f.reason) for f in result.figures if not f.ok]
    loop = [f for f in by_mode["throughput"] if f.case == "loopback"]
    assert len(loop) == 4 and all(f.facts["verified"] is True for f in loop)
    assert all(f.get("gbps_best") > 0 and f.metrics["seconds_best"] <= f.metrics["seconds_median"] for f in loop)
    assert [f.case for f in by_mode["latency"]] == ["loopback"]
    lat = by_mode["latency"][0].metrics
    assert lat["samples"] == 5 and lat["min_s"] <= lat["p50_s"] <= lat["p99_s"]
    assert by_mode["overhead"][0].metrics["per_row_s_median"] > 0
    assert result.machine["cores"] and result.versions["numpy"]
    if shutil.which("git") and (Path(__file__).resolve().parents[2] / ".git").exists():
        assert result.versions["kvxfer_revision"]  # run from a checkout: the commit the figures belong to
    # references are measured twice (first and last) and keep the faster pass
    refs = [f for f in by_mode["throughput"] if f.case == "local_copy"]
    for f in refs:
        passes = f.facts["passes_gbps_best"]
        assert len(passes) == 2 and f.get("gbps_best") == pytest.approx(max(passes), rel=1e-3)
    # every backend thread and process the run started has ended
    leftover = [t for t in threading.enumerate() if t.ident not in before and t.is_alive()]
    assert leftover == []


def test_absent_requirements_and_device_memory_are_skipped_with_reasons() -> None:
    cfg = dataclasses.replace(
        _tiny(("loopback", "ipc", "local_copy")),
        throughput=(ThroughputSweep(row_bytes=(4096,), rows=(4,), memory=("host", "device"), slots=("scattered",)),),
        latency=None, overhead=None)
    result = run(cfg)
    status = {(f.case, f.key.get("memory")): (f.status, f.reason) for f in result.figures}
    assert status[("loopback", "host")][0] == "ok"
    import torch

    if not torch.cuda.is_available():
        assert status[("ipc", "host")][0] == "skipped"
        assert status[("ipc", "host")][1].startswith("no CUDA device")  # and why the native CUDA half is not usable
        assert status[("local_copy", "device")] == ("skipped", "device memory: no CUDA device")
        assert status[("loopback", "device")][0] == "skipped"
    assert "ipc: skipped:" in render_text(result, evaluate(result))


def test_a_case_that_fails_is_an_error_figure_and_the_run_goes_on(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvxfer.bench import cases

    real = cases.requirement_missing
    monkeypatch.setattr(cases, "requirement_missing",
                        lambda req: "probe says no" if req is Requirement.KVXFER_IPC else real(req))
    class Broken:
        def __init__(self, config: object) -> None:
            pass

        def throughput(self, point: object) -> object:
            raise RuntimeError("wire cut")

        def close(self) -> None:
            pass

    specs = dict(registry())
    specs["broken"] = CaseSpec("broken", "broken", Role.BACKEND, frozenset(), ("row_bytes",),
                               frozenset({"throughput"}), Broken)  # type: ignore[arg-type]
    specs["absent"] = CaseSpec("absent", "absent", Role.BACKEND, frozenset({Requirement.KVXFER_IPC}), ("row_bytes",),
                               frozenset({"throughput"}), Broken)  # type: ignore[arg-type]
    cfg = dataclasses.replace(_tiny(("broken", "absent", "local_copy")), latency=None, overhead=None)
    result = run(cfg, specs=specs)
    broken = [f for f in result.figures if f.case == "broken"]
    assert broken and all(f.status == "error" and f.reason == "RuntimeError: wire cut" for f in broken)
    absent = [f for f in result.figures if f.case == "absent"]
    assert absent and all(f.status == "skipped" and f.reason == "probe says no" for f in absent)
    assert all(f.ok for f in result.figures if f.case == "local_copy")


def test_cli_writes_json_and_markdown(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = cli.main(["--preset", "tiny", "--cases", "local_copy,loopback", "--no-latency", "--no-overhead",
                     "--out", str(tmp_path), "--no-progress"])
    assert code == 0
    out = capsys.readouterr()
    assert "Throughput" in out.out and "Targets (docs/performance.md)" in out.out
    json_files = list(tmp_path.glob("tiny-*.json"))
    md_files = list(tmp_path.glob("tiny-*.md"))
    assert len(json_files) == 1 and len(md_files) == 1
    result = load(json_files[0])
    assert json.loads(json_files[0].read_text())["targets"]
    assert {f.case for f in result.figures} == {"local_copy", "loopback"}
    assert "| loopback |" in md_files[0].read_text()


def test_progress_goes_to_stderr(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--preset", "tiny", "--cases", "local_copy", "--no-latency", "--no-overhead"]) == 0
    out = capsys.readouterr()
    # two local-copy figures, each measured again in the references' second pass
    assert "4/4" in out.err and "done" in out.err and "second pass" in out.err
    assert "[" not in out.out.splitlines()[0]


@pytest.mark.slow
def test_nixl_cases_two_processes_verified_and_reaped() -> None:
    """Raw NIXL baselines and kvxfer NIXL with its peer in a child: bytes checked, children gone."""
    pytest.importorskip("nixl._api")
    import multiprocessing

    from kvxfer.bench.config import Repetition
    from kvxfer.testing.subprocess_peer import live_children

    cfg = dataclasses.replace(
        _tiny(("nixl_one_desc", "nixl_per_row", "peer_practice", "nixl_2p")),
        throughput=(ThroughputSweep(row_bytes=(4096,), rows=(16,), directions=("push", "pull"),
                                    slots=("scattered",)),),
        latency=None, overhead=None, repetition=Repetition(warmup=0, reps=3, budget_s=0.1))
    result = run(cfg)
    assert all(f.ok for f in result.figures), [(f.id, f.reason) for f in result.figures if not f.ok]
    assert {f.case for f in result.figures} == {"nixl_one_desc", "nixl_per_row", "peer_practice", "nixl_2p"}
    assert all(f.facts["verified"] is True and f.facts["processes"] == 2 for f in result.figures)
    per_row = [f for f in result.figures if f.case == "nixl_per_row"]
    assert {f.facts["descriptors"] for f in per_row} == {16}
    assert {f.facts["descriptors"] for f in result.figures if f.case == "peer_practice"} == {16 * 2 * 4}
    # A result says which sizes the backend measured with: chunks, and the packed arena by memory.
    kvxfer_nixl = [f for f in result.figures if f.case == "nixl_2p"]
    assert kvxfer_nixl and all(f.facts["arena_device"] == [1 << 30, 64 << 20] and f.facts["arena_host"] == [
        64 << 20, 4 << 20] and f.facts["chunk_bytes_device"] == 256 << 20 for f in kvxfer_nixl)
    assert multiprocessing.active_children() == []
    assert live_children() == []


def test_time_limit_and_interrupt_still_return_every_figure() -> None:
    cfg = dataclasses.replace(_tiny(("local_copy", "loopback")), latency=None, overhead=None)
    planned = len(run(cfg).figures)
    cut = run(cfg, time_limit_s=0.0)
    assert len(cut.figures) == planned
    assert {f.reason for f in cut.figures} == {"not run: the run's time limit of 0s was reached"}

    class Interrupted:
        def __init__(self, config: object) -> None:
            pass

        def throughput(self, point: object) -> object:
            raise KeyboardInterrupt

        def close(self) -> None:
            pass

    specs = dict(registry())
    specs["ctrl_c"] = CaseSpec("ctrl_c", "ctrl_c", Role.BACKEND, frozenset(), ("row_bytes",),
                               frozenset({"throughput"}), Interrupted)  # type: ignore[arg-type]
    result = run(dataclasses.replace(cfg, cases=("ctrl_c", "local_copy")), specs=specs)
    reasons = [(f.case, f.status, f.reason) for f in result.figures]
    assert reasons[0] == ("ctrl_c", "skipped", "interrupted while measuring")
    assert all(r == "not run: the run was interrupted" for _, _, r in reasons[1:]) and len(reasons) > 1


def test_a_backend_that_copies_only_its_first_transfer_fails_verification(monkeypatch: pytest.MonkeyPatch) -> None:
    # Equal rows after the timed runs prove nothing by themselves: the warm-up put the same,
    # unchanged source in place. The check stamps fresh bytes and moves them once more, so a
    # transport that stops moving bytes after its first transfer is an error figure, not a
    # verified one.
    from kvxfer.backends.loopback import LoopbackBackend

    real = LoopbackBackend._copy_runs
    calls = {"n": 0}

    def first_only(job, src_base, dst_base, row_bytes, src, dst):  # type: ignore[no-untyped-def]
        calls["n"] += 1
        return real(job, src_base, dst_base, row_bytes, src, dst) if calls["n"] == 1 else len(src)

    def reset(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls["n"] = 0  # every figure starts from a fresh pair: its first transfer copies
        return real_setup(*args, **kwargs)

    from kvxfer.bench import backend_cases

    real_setup = backend_cases.BackendCase._setup
    monkeypatch.setattr(LoopbackBackend, "_copy_runs", staticmethod(first_only))
    monkeypatch.setattr(backend_cases.BackendCase, "_setup", reset)
    result = run(dataclasses.replace(_tiny(("loopback",)), overhead=None))
    judged = [f for f in result.figures if f.case == "loopback" and f.mode in ("throughput", "latency")]
    # The bench's own byte check names the rows that differ; with row integrity on (the default)
    # the fetcher's digest check fails the transfer first, and the figure names that outcome.
    assert judged and all(f.status == "error" and ("differ" in (f.reason or "") or "outcome Failed" in (f.reason or ""))
                          for f in judged), [
        (f.id, f.status, f.reason) for f in judged]


def test_store_cases_put_and_get_with_bytes_checked_and_nothing_left() -> None:
    """--preset store's cases at the tiny preset's sizes: the in-process and /dev/shm stores
    (Mooncake's are measured by the preset itself, in bench/results)."""
    import os

    before = {t.ident for t in threading.enumerate()}
    def stores() -> set[str]:  # the bench's own directories only: tests in parallel make others
        return {name for name in os.listdir("/dev/shm") if name.startswith("kvxfer-bench-store-")}

    shm = stores()
    cases = ("store_memory_put", "store_memory_get", "store_shm_put", "store_shm_get")
    result = run(dataclasses.replace(_tiny(cases), latency=None, overhead=None))
    figures = [f for f in result.figures if f.mode == "throughput"]
    assert {f.case for f in figures} == set(cases) and all(f.ok for f in figures), [f.reason for f in figures]
    assert all(f.facts["verified"] is True and f.get("gbps_best") > 0 for f in figures)
    assert [t for t in threading.enumerate() if t.ident not in before and t.is_alive()] == []
    assert stores() == shm  # the shm store's directories are gone
