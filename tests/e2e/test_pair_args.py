"""`kvxfer pair`'s arguments: it refuses a workload that cannot run before it starts any process, and it
puts each role on its own device."""

from __future__ import annotations

import io

import pytest
import torch

from kvxfer import pair


@pytest.mark.parametrize(("argv", "words"), [
    (["--concurrency", "0"], "--concurrency must be at least 1"),  # used to hang on Semaphore(0)
    (["--requests", "0"], "--requests must be at least 1"),        # used to report success on nothing
    (["--prefill-workers", "0"], "--prefill-workers must be at least 1"),
    (["--min-len", "300", "--max-len", "10"], "--min-len 300 is over --max-len 10"),
    (["--max-new-tokens", "5000"], "do not fit"),
    (["--timeout", "0"], "--timeout must be positive"),
    (["--temperature", "-1"], "--temperature: must lie in [0, 1e+06], got -1.0"),
    (["--temperature", "1", "--top-p", "0"], "--top-p: must lie in (0, 1], got 0.0"),
    (["--temperature", "1", "--top-k", "-3"], "--top-k: must be an int, 0 or -1 for none, got -3"),
    (["--top-p", "0.5"], "--top-p, --top-k and --sampling-seed need --temperature above 0"),
    (["--temperature", "1", "--sampling-seed", str(2 ** 64 - 2), "--requests", "5"], "passes 2**64"),
])
def test_bad_workload_is_a_usage_error(argv: list[str], words: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        pair.main([*argv, "--layers", "1", "--hidden", "32", "--heads", "2", "--kv-heads", "1", "--head-dim", "16",
                   "--intermediate", "64", "--vocab", "64"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert words in err and "Traceback" not in err


def test_busy_poll_outside_ipc_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        pair.main(["--busy-poll", "--backend", "nixl"])
    assert exc.value.code == 2 and "--busy-poll applies to --backend ipc only, not nixl" in capsys.readouterr().err


def test_serve_refuses_busy_poll_outside_ipc(capsys: pytest.CaptureFixture[str]) -> None:
    from kvxfer.worker import serve

    with pytest.raises(SystemExit) as exc:
        serve.main(["--role", "decode", "--busy-poll"])
    assert exc.value.code == 2 and "--busy-poll applies to --backend ipc only, not nixl" in capsys.readouterr().err


@pytest.mark.parametrize("flags,words", [
    (["--transfer-timeout", "-1"], "--transfer-timeout must be positive, got -1.0"),
    (["--blocks", "0"], "--blocks must be at least 1, got 0"),
    (["--threads", "0"], "--threads must be at least 1, got 0"),
    (["--port", "70000"], "--port must be 0 to 65535, got 70000"),
    (["--nixl-chunk-pause", "-0.5"], "--nixl-chunk-pause must not be negative, got -0.5"),
])
def test_serve_refuses_numbers_that_cannot_work_by_flag(flags: list[str], words: str,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    from kvxfer.worker import serve

    with pytest.raises(SystemExit) as exc:
        serve.main(["--role", "decode", *flags])
    assert exc.value.code == 2 and words in capsys.readouterr().err


def test_worker_config_and_backend_factory_refuse_busy_poll_outside_ipc() -> None:
    from kvxfer.contract import TransferMode
    from kvxfer.worker.backends import make_backend
    from kvxfer.worker.core import WorkerConfig

    with pytest.raises(ValueError, match="busy_poll applies to the ipc backend only, not 'nixl'"):
        WorkerConfig(role="decode", backend="nixl", busy_poll=True)
    with pytest.raises(ValueError, match="busy_poll applies to the ipc backend only, not 'loopback'"):
        make_backend("loopback", TransferMode.PUSH, name="x", deadline_s=1.0, busy_poll=True)


def _pair_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exc:
        pair.main(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "Traceback" not in err
    return err


def test_a_role_device_that_is_not_visible_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    missing = torch.cuda.device_count()  # cuda:0 on a machine without CUDA
    err = _pair_error(["--device", "cpu", "--prefill-device", f"cuda:{missing}"], capsys)
    assert f"--prefill-device cuda:{missing}: CUDA device {missing} is not visible" in err
    assert f"this process sees {missing} CUDA device" in err


def test_workers_mixing_cpu_and_cuda_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    err = _pair_error(["--prefill-device", "cpu", "--decode-device", "cuda:1"], capsys)
    assert "prefill on cpu (--prefill-device)" in err and "decode on cuda:1 (--decode-device)" in err
    assert "mix cpu and cuda" in err


def test_an_oracle_on_another_kind_of_device_than_the_workers_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    err = _pair_error(["--device", "cpu", "--prefill-device", "cuda:0", "--decode-device", "cuda:0"], capsys)
    assert "the oracle on cpu (--device)" in err and "mix cpu and cuda" in err


def test_a_role_device_that_is_no_device_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    err = _pair_error(["--decode-device", "gpu1"], capsys)
    assert "--decode-device gpu1: not a device; use auto, cpu, cuda or cuda:N" in err


def test_each_role_gets_one_device_flag_its_own() -> None:
    from kvxfer.worker.serve import model_args_list

    args = pair.build_parser().parse_args(["--device", "cpu"])
    argv = model_args_list(args, "cuda:1")  # the worker command line; not started here
    assert argv.count("--device") == 1 and argv[argv.index("--device") + 1] == "cuda:1"
    assert model_args_list(args)[model_args_list(args).index("--device") + 1] == "cpu"


def test_report_names_the_role_devices_when_they_differ_from_the_oracle() -> None:
    config = {"backend": "ipc", "mode": "push", "lender": "inplace", "prefill_workers": 1, "decode_workers": 1,
              "model": "1L/32H/2h/1kv/float32 on cuda", "concurrency": 1, "device": "cuda",
              "prefill_device": "cuda:0", "decode_device": "cuda:1"}
    out = io.StringIO()
    pair.print_report(pair.summarize([], 1.0, config), out)
    assert "model 1L/32H/2h/1kv/float32 on cuda (oracle), prefill on cuda:0, decode on cuda:1" in out.getvalue()
    same = io.StringIO()
    pair.print_report(pair.summarize([], 1.0, config | {"prefill_device": "cuda", "decode_device": "cuda"}), same)
    assert same.getvalue().splitlines()[0].endswith("model 1L/32H/2h/1kv/float32 on cuda")


@pytest.mark.skipif(bool(__import__("kvxfer.native", fromlist=["info"]).info().cuda_usable),
                    reason="with a usable GPU --backend ipc runs: the order is checked where ipc is refused")
def test_ipc_asks_cuda_only_after_the_workers_fork_server_is_forked(monkeypatch: pytest.MonkeyPatch,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """Asking CUDA whether ipc can run starts CUDA in the asking process, and a worker forked
    from it afterwards sees no GPU ("CUDA driver initialization failed"): every `kvxfer pair
    --backend ipc` on a GPU failed so. The pair asks only after its fork server exists."""
    import contextlib

    from kvxfer import cli, native

    asked: list[str] = []
    real = native.info
    monkeypatch.setattr(native, "info", lambda: asked.append("info") or real())
    monkeypatch.setattr(native, "cuda_built", lambda: True)
    forked: list[list[str]] = []

    @contextlib.contextmanager
    def fork_server_here():  # type: ignore[no-untyped-def]
        forked.append(list(asked))
        yield False

    monkeypatch.setattr(pair, "fork_server_here", fork_server_here)
    monkeypatch.setattr(cli, "AS_COMMAND", True)
    with pytest.raises(SystemExit) as exc:
        pair.main(["--backend", "ipc", "--requests", "1", "--quiet"])
    assert exc.value.code == 2 and "--backend ipc needs a visible CUDA GPU" in capsys.readouterr().err
    assert forked == [[]], f"CUDA was asked before the fork server was forked: {forked}"
    assert asked, "ipc was never checked against CUDA"
