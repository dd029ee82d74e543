"""`kvxfer pair`'s command line and report, without starting a process: bad flags are usage
errors naming the flag (exit 2) before anything runs, a lane probe that hangs is reported as
one, a capped --max-len is reported as capped, and failures are grouped by what went wrong,
not by the text before the first colon."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvxfer import pair

SMALL = ["--layers", "1", "--hidden", "32", "--heads", "2", "--kv-heads", "1", "--head-dim", "16",
         "--intermediate", "64", "--vocab", "64", "--device", "cpu", "--quiet"]


class _Child:
    def __init__(self, name: str, argv: list[str]) -> None:
        self.name, self.pid, self.port, self.argv = name, 0, 9, argv
        self.url = "http://127.0.0.1:9"  # nothing listens: the metrics fetch fails, as the pair allows
        self.info = {"role": name.rstrip("0123456789")}


class _Group:
    """ProcessGroup's surface, starting nothing."""

    started: list[_Child] = []  # every child of every group (the test that reads it clears it)

    def __init__(self, log_dir: Path) -> None:
        log_dir.mkdir(parents=True, exist_ok=True)  # as ProcessGroup does: the pair writes there
        self.children: list[_Child] = []

    def __enter__(self) -> _Group:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def start(self, name: str, argv: list[str]) -> _Child:
        self.children.append(_Child(name, argv))
        _Group.started.append(self.children[-1])
        return self.children[-1]

    def wait_ready(self, children: list[_Child], timeout: float) -> None:
        return None


@pytest.fixture
def no_processes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every request matches; no worker or router process is started."""
    async def workload(url: str, prompts: list[list[int]], expected: list[list[int]], *rest: Any) -> list[pair.Result]:
        return [pair.Result(f"pair-{i}", len(p), e, e, 0.01, 0.02, None, "disaggregated", None)
                for i, (p, e) in enumerate(zip(prompts, expected))]

    monkeypatch.setattr(pair, "ProcessGroup", _Group)
    monkeypatch.setattr(pair, "run_workload", workload)


def _usage_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exc:
        pair.main(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "Traceback" not in err, err
    return err


@pytest.mark.usefixtures("no_processes")
@pytest.mark.parametrize(("flags", "words"), [
    (["--layers", "0"], "--layers must be a positive int, got 0"),
    (["--heads", "3", "--kv-heads", "2"], "--heads (3) must be a multiple of --kv-heads (2)"),
    (["--head-dim", "15"], "--head-dim (15) must be even"),
    (["--block-tokens", "0"], "--block-tokens must be a positive int, got 0"),
])
def test_model_flags_that_make_no_model_are_usage_errors(flags: list[str], words: str,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    assert words in _usage_error([*SMALL, *flags], capsys)


@pytest.mark.usefixtures("no_processes")
@pytest.mark.parametrize(("flags", "words"), [
    (["--layerwise", "0"], "--layerwise must be a positive number of layer groups, got 0"),
    (["--layerwise", "2"], "--layerwise 2 is more layer groups than the model has layers (1)"),
    (["--layerwise", "2", "--lender", "staging"], "--layerwise 2 with --lender staging is not supported"),
    (["--layers", "2", "--layerwise", "2", "--decode-tp", "2"], "--layerwise 2 with a TP group of engine KV"),
    (["--engine", "transformers", "--layers", "2", "--layerwise", "2", "--sliding-window", "8"],
     "--layerwise 2 with --sliding-window: layer-wise streaming cuts a cache of full-attention layers only"),
])
def test_bad_layerwise_is_a_usage_error(flags: list[str], words: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert words in _usage_error([*SMALL, *flags], capsys)


@pytest.mark.usefixtures("no_processes")
@pytest.mark.parametrize("name", ["KVXFER_API_KEY", "KVXFER_CLUSTER_KEY"])
def test_a_key_its_processes_could_not_use_is_a_usage_error(name: str, monkeypatch: pytest.MonkeyPatch,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv(name, "two words")  # its workers and router inherit it, and would refuse it
    err = _usage_error(SMALL, capsys)
    assert f"{name} holds a space" in err and "two words" not in err


@pytest.mark.usefixtures("no_processes")
@pytest.mark.parametrize(("flags", "words"), [
    (["--inject-corruption", "1.5"], "--inject-corruption must be a share of rows from 0 to 1, got 1.5"),
    (["--inject-corruption", "0.1", "--integrity", "off"], "it needs --integrity on"),
])
def test_corruption_injection_that_cannot_work_is_a_usage_error(flags: list[str], words: str,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    from kvxfer.worker import serve

    assert words in _usage_error([*SMALL, *flags], capsys)
    with pytest.raises(SystemExit) as exc:
        serve.main(["--role", "decode", *flags])
    assert exc.value.code == 2 and words in capsys.readouterr().err


def test_serve_refuses_model_flags_that_make_no_model(capsys: pytest.CaptureFixture[str]) -> None:
    from kvxfer.worker import serve

    with pytest.raises(SystemExit) as exc:
        serve.main(["--role", "decode", "--kv-heads", "0"])
    assert exc.value.code == 2 and "--kv-heads must be a positive int, got 0" in capsys.readouterr().err


@pytest.mark.usefixtures("no_processes")
def test_a_lane_probe_that_does_not_finish_is_reported(monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    def hangs(memory: str, timeout: float, devices: tuple[int, int]) -> None:
        raise subprocess.TimeoutExpired(["python", "-m", "kvxfer.doctor.probe"], timeout)

    monkeypatch.setattr(pair, "probe_lanes", hangs)
    assert pair.main([*SMALL, "--backend", "nixl", "--mode", "pull", "--startup-timeout", "7"]) == 2
    err = capsys.readouterr().err
    assert "could not probe the NIXL lanes (a probe process did not exit within 7 s)" in err, err


@pytest.mark.usefixtures("no_processes")
def test_a_json_path_that_cannot_be_written_is_refused_before_the_run(tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "no-such-dir" / "report.json"
    err = _usage_error([*SMALL, "--json", str(missing)], capsys)
    assert f"--json {missing}: directory {missing.parent} does not exist" in err
    err = _usage_error([*SMALL, "--json", str(tmp_path)], capsys)
    assert f"--json {tmp_path} is a directory" in err


@pytest.mark.usefixtures("no_processes")
def test_a_capped_max_len_is_reported_as_used(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    report = tmp_path / "report.json"
    argv = [*SMALL, "--requests", "2", "--warmup", "0", "--min-len", "4080", "--max-len", "5000",
            "--max-new-tokens", "4", "--json", str(report), "--log-dir", str(tmp_path / "logs")]
    assert pair.main(argv) == 0
    assert "--max-len 5000 capped to 4092: the model holds 4096 positions" in capsys.readouterr().err
    config = json.loads(report.read_text())["config"]
    assert config["prompt_lengths"] == [4080, 4092] and config["max_len_requested"] == 5000


@pytest.mark.usefixtures("no_processes")
@pytest.mark.parametrize("flags", [[], ["--integrity", "off"]], ids=["default", "off"])
def test_integrity_goes_to_every_worker_and_into_the_report(flags: list[str], tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    state = "off" if flags else "on"
    report = tmp_path / "report.json"
    _Group.started.clear()
    argv = [*SMALL, *flags, "--requests", "1", "--warmup", "0", "--max-len", "16", "--max-new-tokens", "2",
            "--json", str(report), "--log-dir", str(tmp_path / "logs")]
    assert pair.main(argv) == 0
    workers = [c for c in _Group.started if c.argv[0] == "serve"]
    assert len(workers) == 2
    for child in workers:
        at = child.argv.index("--integrity")
        assert child.argv[at + 1] == state, child.argv
    assert json.loads(report.read_text())["config"]["integrity"] == state
    assert f"inplace lender, integrity {state})" in capsys.readouterr().out


def test_failures_group_by_cause_not_by_worker_or_request() -> None:
    def failed(error: str) -> pair.Result:
        return pair.Result("pair-0", 3, [], [1], None, 1.0, None, "?", error)

    errors = [
        "router: http://127.0.0.1:40001/generate: no event within 60.0s",
        "router: http://127.0.0.1:40002/generate: stream ended before its final event",
        "decode http://127.0.0.1:8002: transfer failed: 3 of 8 rows arrived (deadline); policy is fail",
        "decode http://127.0.0.1:8003: transfer failed: 5 of 9 rows arrived (deadline); policy is fail",
        "reserve on http://127.0.0.1:8002 failed: http://127.0.0.1:8002/reserve: HTTP 409: PoolExhausted (policy fail)",
        "reserve on http://127.0.0.1:8003 failed: http://127.0.0.1:8003/reserve: HTTP 500: boom (policy fail)",
        "decode http://127.0.0.1:8002: HTTP 500: request 'r0123456789ab-4' is not reserved here",
        "decode http://127.0.0.1:8003: HTTP 500: request 'r0123456789ab-17' is not reserved here",
    ]
    failures = pair.summarize([failed(e) for e in errors], 1.0, {})["failures"]
    assert failures == {
        "router: <worker>/generate: no event within 60.0s": 1,
        "router: <worker>/generate: stream ended before its final event": 1,
        "decode <worker>: transfer failed: N of N rows arrived (deadline); policy is fail": 2,
        "reserve on <worker> failed: <worker>/reserve: HTTP 409: PoolExhausted (policy fail)": 1,
        "reserve on <worker> failed: <worker>/reserve: HTTP 500: boom (policy fail)": 1,
        "decode <worker>: HTTP 500: request '<request>' is not reserved here": 2,
    }, failures


def test_a_refused_flag_is_refused_before_torch_is_imported() -> None:
    """The refusal comes within about a second: nothing the checks need imports torch (an
    oracle module that did made it 4.5 s)."""
    probe = ("import sys\nfrom kvxfer import pair\ntry:\n    pair.main(['--requests', '0'])\nexcept SystemExit as e:\n"
             "    print(e.code, 'torch' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert done.stdout.split() == ["2", "False"], done.stdout + done.stderr
    assert done.stderr == "kvxfer pair: error: --requests must be at least 1, got 0 (kvxfer pair --help lists the flags)\n"
