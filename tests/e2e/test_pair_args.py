"""`kvxfer pair` refuses a workload that cannot run, before it starts any process."""

from __future__ import annotations

import pytest

from kvxfer import pair


@pytest.mark.parametrize(("argv", "words"), [
    (["--concurrency", "0"], "--concurrency must be at least 1"),  # used to hang on Semaphore(0)
    (["--requests", "0"], "--requests must be at least 1"),        # used to report success on nothing
    (["--prefill-workers", "0"], "--prefill-workers must be at least 1"),
    (["--min-len", "300", "--max-len", "10"], "--min-len 300 is over --max-len 10"),
    (["--max-new-tokens", "5000"], "do not fit"),
    (["--timeout", "0"], "--timeout must be positive"),
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


def test_worker_config_and_backend_factory_refuse_busy_poll_outside_ipc() -> None:
    from kvxfer.contract import TransferMode
    from kvxfer.worker.backends import make_backend
    from kvxfer.worker.core import WorkerConfig

    with pytest.raises(ValueError, match="busy_poll applies to the ipc backend only, not 'nixl'"):
        WorkerConfig(role="decode", backend="nixl", busy_poll=True)
    with pytest.raises(ValueError, match="busy_poll applies to the ipc backend only, not 'loopback'"):
        make_backend("loopback", TransferMode.PUSH, name="x", deadline_s=1.0, busy_poll=True)
