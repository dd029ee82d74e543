"""Every kvxfer command's usage error is one line naming what is wrong, and a flag counts only
when spelled in full (kvxfer.serving.command)."""

from __future__ import annotations

import pytest

from kvxfer.bench.cli import build_parser as bench_parser
from kvxfer.doctor.report import _parser as doctor_parser
from kvxfer.launch.cli import build_parser as launch_parser
from kvxfer.pair import build_parser as pair_parser
from kvxfer.router.serve import build_parser as router_parser
from kvxfer.serving.command import CommandParser
from kvxfer.up import build_parser as up_parser
from kvxfer.worker.serve import build_parser as serve_parser


def refusal(parser: CommandParser, argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exc:
        parser.parse_args(argv)
    assert exc.value.code == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1, err
    return err


def test_a_usage_error_is_one_line_naming_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    err = refusal(serve_parser(), ["--role", "prefill", "--port", "x"], capsys)
    assert err == "kvxfer serve: error: argument --port: invalid int value: 'x' (kvxfer serve --help lists the flags)\n"


def test_an_abbreviated_flag_is_not_taken_for_the_whole_one(capsys: pytest.CaptureFixture[str]) -> None:
    err = refusal(serve_parser(), ["--role", "prefill", "--back", "ucx"], capsys)
    assert "unrecognized arguments: --back ucx" in err
    err = refusal(router_parser(), ["--selec", "round_robin"], capsys)
    assert "unrecognized arguments: --selec round_robin" in err


@pytest.mark.parametrize("parser", [pair_parser, serve_parser, router_parser, bench_parser, doctor_parser, launch_parser, up_parser])
def test_every_command_parser_is_one(parser: object) -> None:
    assert isinstance(parser(), CommandParser)  # type: ignore[operator]


def test_help_is_still_the_whole_usage(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        serve_parser().parse_args(["--help"])
    assert exc.value.code == 0 and "--transfer-timeout" in capsys.readouterr().out
