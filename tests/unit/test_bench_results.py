"""kvxfer bench: the JSON schema, compare logic, tables and target rows, on hand-made results."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from kvxfer.bench import cli
from kvxfer.bench.compare import _figure_value, compare, regressions, render
from kvxfer.bench.references import ratio
from kvxfer.bench.report import markdown_table, render_markdown, render_text, text_table
from kvxfer.bench.results import SCHEMA_VERSION, BenchResult, Figure, ResultError, load, write
from kvxfer.bench.targets import evaluate

K, M = 1 << 10, 1 << 20


def _tp(case: str, seconds: float, role: str = "backend", **key: object) -> Figure:
    base = {"memory": "host", "direction": "push", "slots": "scattered", "row_bytes": 64 * K, "rows": 1024,
            "groups": 1}
    base.update(key)  # type: ignore[arg-type]
    full = {k: base[k] for k in ("memory", "direction", "slots", "row_bytes", "rows", "groups") if k in base}
    full["total_bytes"] = int(key.get("total_bytes", 64 * M))  # type: ignore[call-overload]
    return Figure("throughput", case, role, full, "ok", "", {"seconds_best": seconds, "seconds_median": seconds * 1.1,
                                                             "reps": 10.0}, {"descriptors": 1024})


def _result(*figures: Figure) -> BenchResult:
    return BenchResult("2026-11-29T00:00:00+00:00", {"hostname": "h", "cpu": "c", "cores": 2}, {"python": "3.11"},
                       {"name": "test"}, tuple(figures), 1.0)


_LAT_KEY = {"direction": "push", "memory": "host", "slots": "scattered", "row_bytes": 64 * K, "rows": 32, "groups": 1,
            "total_bytes": 2 * M}


def _refs() -> list[Figure]:
    copy = Figure("throughput", "local_copy", "reference", {"memory": "host", "total_bytes": 64 * M}, "ok", "",
                  {"seconds_best": 0.004, "seconds_median": 0.005, "reps": 10.0})
    one = Figure("throughput", "nixl_one_desc", "ceiling", {"memory": "host", "direction": "push",
                                                            "total_bytes": 64 * M}, "ok", "",
                 {"seconds_best": 0.008, "seconds_median": 0.009, "reps": 10.0})
    return [copy, one]


def test_gbps_and_ratios_to_same_run_references() -> None:
    fig = _tp("loopback", 0.016)
    result = _result(*_refs(), fig)
    assert fig.get("gbps_best") == pytest.approx(64 * M / 0.016 / 1e9)
    assert ratio(result, fig, "local_copy") == pytest.approx(0.25)
    assert ratio(result, fig, "nixl_one_desc") == pytest.approx(0.5)
    # another total size has no reference in this run: no ratio rather than a wrong one
    assert ratio(result, _tp("loopback", 0.01, total_bytes=32 * M), "local_copy") is None


def test_json_round_trip_keeps_every_figure(tmp_path: Path) -> None:
    skipped = Figure("throughput", "ipc", "backend", {"memory": "device", "total_bytes": 1}, "skipped", "no CUDA")
    lat = Figure("latency", "nixl", "backend", _LAT_KEY, "ok", "",
                 {"p50_s": 5e-5, "p99_s": 1e-4, "min_s": 4e-5, "samples": 100.0})
    result = _result(*_refs(), _tp("loopback", 0.016), skipped, lat)
    path = tmp_path / "r.json"
    write(result, path, [t.to_json() for t in evaluate(result)])
    raw = json.loads(path.read_text())
    assert raw["schema"] == "kvxfer-bench" and raw["schema_version"] == SCHEMA_VERSION
    assert raw["figures"][2]["metrics"]["gbps_best"] == pytest.approx(64 * M / 0.016 / 1e9)
    assert any(t["status"] == "pass" for t in raw["targets"])  # 50 µs p50 / 100 µs p99 meets the target
    back = load(path)
    assert [f.id for f in back.figures] == [f.id for f in result.figures]
    assert back.figures[3].reason == "no CUDA" and back.figures[4].metrics["p99_s"] == 1e-4


@pytest.mark.parametrize("mutate,message", [
    (lambda d: d.update(schema="other"), "not a kvxfer bench result"),
    (lambda d: d.update(schema_version=99), "schema version 99"),
    (lambda d: d.pop("machine"), "'machine'"),
    (lambda d: d["figures"][0].update(status="great"), "unknown status"),
    (lambda d: d["figures"][0]["metrics"].pop("seconds_best"), "seconds_best"),
])
def test_load_names_what_is_wrong(tmp_path: Path, mutate, message: str) -> None:  # type: ignore[no-untyped-def]
    data = _result(*_refs()).to_json()
    mutate(data)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ResultError, match=message):
        load(path)


def test_load_refuses_non_json(tmp_path: Path) -> None:
    path = tmp_path / "x.json"
    path.write_text("{nope")
    with pytest.raises(ResultError, match="not JSON"):
        load(path)


def test_compare_flags_throughput_drop_latency_rise_and_lost_figures() -> None:
    lat = Figure("latency", "loopback", "backend", {"rows": 32, "total_bytes": 2 * M}, "ok", "",
                 {"p50_s": 5e-5, "p99_s": 1e-4, "min_s": 4e-5, "samples": 100.0})
    old = _result(_tp("loopback", 0.010, slots="scattered"), _tp("loopback", 0.010, slots="contiguous"),
                  _tp("nixl", 0.010), lat)
    lat_new = Figure("latency", "loopback", "backend", lat.key, "ok", "",
                     {"p50_s": 5.2e-5, "p99_s": 2e-4, "min_s": 4e-5, "samples": 100.0})
    new = _result(_tp("loopback", 0.0125, slots="scattered"),      # 20% slower: regression
                  _tp("loopback", 0.0095, slots="contiguous"),     # 5% faster: same
                  Figure("throughput", "nixl", "backend", _tp("nixl", 1).key, "skipped", "module gone"),
                  lat_new, _tp("ipc", 0.001))
    changes = compare(old, new, threshold=0.10)
    verdicts = {(c.figure.split("/")[1], c.figure.split("/")[4] if c.figure.startswith("throughput") else "",
                 c.metric.split(" ")[0]): c.verdict for c in changes}
    assert verdicts[("loopback", "slots=scattered", "gbps_best")] == "regression"
    assert verdicts[("loopback", "slots=contiguous", "gbps_best")] == "same"
    assert verdicts[("nixl", "slots=scattered", "gbps_best")] == "lost"
    assert verdicts[("loopback", "", "p50_s")] == "same"
    assert verdicts[("loopback", "", "p99_s")] == "regression"
    assert verdicts[("ipc", "slots=scattered", "-")] == "new"
    assert len(regressions(changes)) == 3
    text = render(changes, 0.10)
    assert "REGRESSION" in text and "LOST" in text and "3 regression(s) beyond 10%" in text
    # a looser threshold forgives the 20% drop but never a lost figure
    assert {c.verdict for c in regressions(compare(old, new, threshold=1.5))} == {"lost"}


def test_compare_cli_exit_codes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    write(_result(_tp("loopback", 0.010)), a, [])
    write(_result(_tp("loopback", 0.0101)), b, [])
    assert cli.main(["--compare", str(a), str(b)]) == 0
    write(_result(_tp("loopback", 0.020)), b, [])
    assert cli.main(["--compare", str(a), str(b), "--threshold", "0.3"]) == 1
    assert "REGRESSION" in capsys.readouterr().out
    assert cli.main(["--compare", str(a), str(tmp_path / "missing.json")]) == 2


def test_text_table_aligns_numbers_right_and_text_left() -> None:
    out = text_table(["case", "GB/s"], [["loopback", "1.50"], ["nixl_one_desc", "12.25"]]).splitlines()
    assert out[0] == "case            GB/s"
    assert out[2] == "loopback        1.50"
    assert out[3] == "nixl_one_desc  12.25"
    assert len({len(line) for line in out}) == 1


def test_markdown_table_escapes_pipes() -> None:
    assert markdown_table(["a", "b"], [["x|y", "1"]]).splitlines() == ["| a | b |", "| --- | --- |", "| x\\|y | 1 |"]


def test_reports_show_ratios_targets_and_skips() -> None:
    skipped = Figure("throughput", "ipc", "backend", {"memory": "device", "total_bytes": 1}, "skipped",
                     "kvxfer.backends.ipc does not exist yet")
    over = Figure("overhead", "nixl", "backend", {"rows": 100000, "groups": 1, "row_bytes": 256,
                                                  "total_bytes": 25600000}, "ok", "",
                  {"per_row_s_best": 1.5e-6, "per_row_s_median": 2e-6, "publish_per_row_s": 1e-6,
                   "decode_per_row_s": 1e-6, "samples": 5.0})
    result = _result(*_refs(), _tp("loopback", 0.016), skipped, over)
    targets = evaluate(result)
    text = render_text(result, targets)
    line = next(t for t in text.splitlines() if t.startswith("loopback") and "scattered" in t)
    assert "25%" in line and "50%" in line           # vs copy, vs nixl one descriptor
    assert "2000 ns/row" in text and "FAIL" in text  # overhead target: 2 µs > 1 µs
    assert "ipc: skipped: kvxfer.backends.ipc does not exist yet (1 figure)" in text
    md = render_markdown(result, targets, "r.json")
    assert "## Targets (docs/performance.md)" in md and "`r.json`" in md and "| loopback |" in md


def test_targets_never_pass_without_figures() -> None:
    rows = evaluate(_result(*_refs()))
    assert rows and all(r.status == "not measured" for r in rows)


def test_plots_write_png_per_panel(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from kvxfer.bench import plots

    figs = [_tp("loopback", 0.01 * i, row_bytes=r, rows=64 * M // r) for i, r in enumerate((4 * K, 64 * K, M), 1)]
    written = plots.plot(_result(*_refs(), *figs), tmp_path, "t")
    assert [p.name for p in written] == ["t-host-push-scattered-64MiB.png"]
    assert written[0].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_refuses_plots_without_matplotlib_before_running(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    from kvxfer.bench import plots

    monkeypatch.setattr(plots, "available", lambda: False)
    assert cli.main(["--preset", "tiny", "--cases", "local_copy", "--no-latency", "--no-overhead", "--no-progress",
                     "--plots", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "--plots needs matplotlib, which is not installed" in err and "local_copy" not in err
    assert list(tmp_path.iterdir()) == []
    # --out asks for JSON and markdown, and plots only where matplotlib is there.
    assert cli.main(["--preset", "tiny", "--cases", "local_copy", "--no-latency", "--no-overhead", "--no-progress",
                     "--out", str(tmp_path)]) == 0
    assert "matplotlib is not installed (pip install matplotlib)" in capsys.readouterr().err
    assert sorted(p.suffix for p in tmp_path.iterdir()) == [".json", ".md"]


def test_cli_refuses_a_gpu_preset_without_a_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    from kvxfer.bench.cases import Requirement, requirement_missing

    if requirement_missing(Requirement.CUDA) is None:
        pytest.skip("this machine has a GPU")
    for name in ("gpu", "gpu2"):
        assert cli.main(["--preset", name, "--no-progress"]) == 2
        assert f"--preset {name} measures device memory" in capsys.readouterr().err


def test_an_interrupted_run_writes_what_it_measured_and_exits_130(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    from kvxfer.bench import runner

    real = runner._measure
    calls = []

    def interrupt_second(*args: object, **kwargs: object) -> object:
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(runner, "_measure", interrupt_second)
    out = tmp_path / "r.json"
    assert cli.main(["--preset", "tiny", "--no-latency", "--no-overhead", "--no-progress", "--json", str(out)]) == 130
    assert "interrupted" in capsys.readouterr().err and out.exists()


def test_relative_compare_cancels_a_slower_machine() -> None:
    old = _result(*_refs(), _tp("loopback", 0.010))
    # everything twice as slow, the reference included: a busy host, not a regression
    slow_refs = [Figure(f.mode, f.case, f.role, f.key, f.status, f.reason,
                        {k: v * 2 if k.startswith("seconds") else v for k, v in f.metrics.items()}) for f in _refs()]
    new = _result(*slow_refs, _tp("loopback", 0.020))
    assert any(c.verdict == "regression" for c in compare(old, new))
    rel = [c for c in compare(old, new, relative=True) if "loopback" in c.figure]
    assert [(c.metric, c.verdict) for c in rel] == [("vs copy", "same")]
    assert rel[0].old == pytest.approx(0.4)
    # the backend alone slower: still a regression when relative
    new2 = _result(*_refs(), _tp("loopback", 0.020))
    assert [c.verdict for c in compare(old, new2, relative=True) if "loopback" in c.figure] == ["regression"]


def test_two_gpu_runs_are_judged_against_the_peer_copy() -> None:
    """With prefill and decode on different GPUs, local_copy is the peer copy: issue 8's
    target (IPC >= 85% of it, scattered rows) replaces the same-GPU ones, and the report says
    where each end was."""
    dev = {"memory": "device", "total_bytes": 256 * M}
    peer_copy = Figure("throughput", "local_copy", "reference", dev, "ok", "",
                       {"seconds_best": 0.001, "seconds_median": 0.001, "reps": 10.0})
    ipc = _tp("ipc", 0.00125, memory="device", total_bytes=256 * M)          # 80% of the peer copy
    kernel = _tp("ipc_kernel", 0.00110, role="ceiling", memory="device", total_bytes=256 * M)  # 91%
    nixl = _tp("nixl_2p", 0.01, memory="device", total_bytes=256 * M)
    packed = _tp("nixl_2p_packed", 0.002, memory="device", total_bytes=256 * M)    # 50% of the peer copy
    per_row = _tp("nixl_per_row", 0.05, role="baseline", memory="device", total_bytes=256 * M)  # packed 25x it
    result = dataclasses.replace(_result(peer_copy, ipc, kernel, nixl, packed, per_row),
                                 config={"name": "gpu2", "devices": [0, 1]})
    rows = {r.case: r for r in evaluate(result) if "peer copy" in r.threshold}
    assert set(rows) == {"ipc", "ipc_kernel", "nixl_2p_packed"}  # the IPC target speaks about IPC only
    assert rows["ipc"].status == "fail" and rows["ipc"].measured.startswith("80.0%")
    assert rows["ipc_kernel"].status == "pass"
    # The packed path's target across two GPUs: 40% of the peer copy passes, 25x per row does not.
    assert rows["nixl_2p_packed"].measured == "50.0% of local_copy, 25x nixl_per_row"
    assert rows["nixl_2p_packed"].status == "fail"
    assert not [r for r in evaluate(result) if "of D2D" in r.threshold]
    text = render_text(result, evaluate(result))
    assert "prefill on cuda:0, decode on cuda:1" in text
    same = dataclasses.replace(result, config={"name": "gpu", "devices": [0, 0]})
    assert [r for r in evaluate(same) if "of D2D" in r.threshold]
    assert "prefill on cuda" not in render_text(same, evaluate(same))
    # A peer copy is not a D2D copy: the two runs' figures share names, not meaning.
    with pytest.raises(ValueError, match="different GPUs"):
        compare(same, result)
    assert compare(result, result) is not None


def test_targets_judge_the_transports_they_speak_of() -> None:
    # The same-node targets judge the IPC cases only (the NIXL paths have the packed target),
    # and the small-request and overhead targets judge transports, not the loopback oracle.
    # Each judged row names its figure (direction, row size, bytes).
    big = {"memory": "device", "rows": 4096, "total_bytes": 256 * M}
    ipc = _tp("ipc", 0.001, **big)
    packed = _tp("nixl_2p_packed", 0.01, direction="pull", **big)
    lat = Figure("latency", "loopback", "backend", _LAT_KEY, "ok", "", {"p50_s": 5e-5, "p99_s": 1e-4, "min_s": 4e-5,
                                                                         "samples": 100.0})
    over = Figure("overhead", "loopback", "backend", {"rows": 100000, "groups": 1, "row_bytes": 256,
                                                      "total_bytes": 25600000}, "ok", "",
                  {"per_row_s_best": 1e-8, "per_row_s_median": 1e-8, "publish_per_row_s": 1e-8,
                   "decode_per_row_s": 1e-8, "samples": 5.0})
    d2d = Figure("throughput", "local_copy", "reference", {"memory": "device", "total_bytes": 256 * M}, "ok", "",
                 {"seconds_best": 0.000134, "seconds_median": 0.00014, "reps": 10.0})
    rows = evaluate(_result(d2d, ipc, packed, lat, over))
    same_node = [r for r in rows if r.target.startswith("same node GPU")]
    assert [r.case for r in same_node] == ["ipc"] and same_node[0].shape == "push, scattered, 64 KiB rows, 256 MiB"
    assert all(r.status == "not measured" for r in rows if r.target.startswith(("small request", "submission")))


def test_relative_compare_without_an_old_reference_is_not_a_pass() -> None:
    # An OLD run with no local copy cannot give ratios: each such figure is "incomparable" and
    # counts against the comparison, where it used to be skipped and "no regression" printed.
    # A figure that failed in OLD and works in NEW is listed, and overhead prints in ns.
    old = _result(_tp("loopback", 0.010), dataclasses.replace(_tp("nixl", 0.01), status="error", reason="boom"))
    new = _result(*_refs(), _tp("loopback", 0.010), _tp("nixl", 0.01))
    changes = compare(old, new, relative=True)
    loop = [c for c in changes if "loopback" in c.figure]
    assert [c.verdict for c in loop] == ["incomparable"] and regressions(changes)
    assert any(c.verdict == "new" and "/nixl/" in c.figure and "old run" in c.metric for c in changes)
    assert "no regression" not in render(changes, 0.1)
    assert _figure_value("per_row_s_median", 2.5e-8) == "25 ns"
    # A run compared with itself has no regression, its local copy included (the reference
    # of the ratios, not a figure to divide by itself).
    same = _result(*_refs(), _tp("loopback", 0.010), _tp("nixl", 0.01))
    assert not regressions(compare(same, same, relative=True))
