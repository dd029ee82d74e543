"""`kvxfer router` refuses numbers that cannot work, by flag, before it serves (exit 2): a
negative --timeout used to be accepted, and --port 99999 ended in an OverflowError traceback."""

from __future__ import annotations

import pytest

from kvxfer.router import Router, serve


@pytest.fixture
def never_serves(monkeypatch: pytest.MonkeyPatch) -> None:
    """A refusal comes before the router takes stdout or serves: either would be a bug here."""
    def reached(*args: object) -> None:
        raise AssertionError("the router went on to serve")

    monkeypatch.setattr(serve, "reserve_stdout", reached)
    monkeypatch.setattr(serve, "serve_router", reached)


@pytest.mark.usefixtures("never_serves")
@pytest.mark.parametrize(("flags", "words"), [
    (["--timeout", "-5"], "--timeout must be a positive number of seconds, got -5.0"),
    (["--timeout", "0"], "--timeout must be a positive number of seconds, got 0.0"),
    (["--timeout", "inf"], "--timeout must be a positive number of seconds, got inf"),
    (["--timeout", "nan"], "--timeout must be a positive number of seconds, got nan"),
    (["--port", "99999"], "--port must be 0 to 65535, got 99999"),
    (["--port", "-1"], "--port must be 0 to 65535, got -1"),
])
def test_router_refuses_numbers_that_cannot_work_by_flag(flags: list[str], words: str,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        serve.main(["--decode", "http://127.0.0.1:1", *flags])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and words in err and "Traceback" not in err, err


def test_an_embedded_router_refuses_a_timeout_that_cannot_work() -> None:
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="timeout_s must be a positive number of seconds"):
            Router([], ["http://127.0.0.1:1"], timeout_s=bad)


@pytest.mark.usefixtures("never_serves")
@pytest.mark.parametrize("flags", [["--decode", "http://127.0.0.1"], ["--decode", "http://127.0.0.1:1", "--prefill",
                                                                       "127.0.0.1:8001"]])
def test_router_refuses_a_worker_url_without_a_host_and_a_port(flags: list[str],
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    # One without a port was taken as port 80, and every call to it failed.
    with pytest.raises(SystemExit) as exc:
        serve.main(flags)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("kvxfer router: error:")]
    assert exc.value.code == 2 and "Traceback" not in err, err
    assert len(lines) == 1 and "is not a server's URL: give http://HOST:PORT" in lines[0], err


def test_router_serves_on_8000_by_default_and_refuses_a_port_in_use(capsys: pytest.CaptureFixture[str]) -> None:
    import socket

    assert serve.build_parser().parse_args(["--decode", "http://127.0.0.1:1"]).port == 8000
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        with pytest.raises(SystemExit) as exc:
            serve.main(["--decode", "http://127.0.0.1:1", "--port", str(port)])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and f"port {port} on 127.0.0.1 is in use" in err and "Traceback" not in err


def test_router_refuses_a_bad_log_level_and_no_decode_worker(capsys: pytest.CaptureFixture[str]) -> None:
    for flags, words in ((["--decode", "http://127.0.0.1:1", "--log-level", "chatty"], "--log-level: must be one of"),
                         ([], "at least one --decode URL is required")):
        with pytest.raises(SystemExit) as exc:
            serve.main(flags)
        assert exc.value.code == 2 and words in capsys.readouterr().err


@pytest.mark.usefixtures("never_serves")
@pytest.mark.parametrize(("model", "words"), [("llama-9000", "unknown model 'llama-9000': use toy, smollm2"),
                                              ("/nonexistent/m.gguf", "cannot read the GGUF file /nonexistent/m.gguf")])
def test_router_refuses_a_model_it_cannot_read_a_tokenizer_from(model: str, words: str,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        serve.main(["--decode", "http://127.0.0.1:1", "--port", "0", "--model", model])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("kvxfer router: error: --model")]
    assert exc.value.code == 2 and len(lines) == 1 and words in lines[0] and "Traceback" not in err, err
