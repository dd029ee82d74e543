"""The ``kvxfer`` command looks up only the subcommand asked for: a refusal of ``kvxfer router``
or ``kvxfer serve`` does not wait for other commands' packages (kvxfer.bench alone is a few
tenths of a second), nor for what serving needs once its flags are good (aiohttp, requests,
torch: together most of a second on the 2-core machine); an unknown command still lists
every command there is."""

from __future__ import annotations

import subprocess
import sys

import pytest

PROBE = """
import sys
from kvxfer import cli
try:
    cli.main(sys.argv[1:])
except SystemExit as exc:
    print(exc.code, sorted(m for m in ("kvxfer.bench", "kvxfer.launch", "torch") if m in sys.modules))
"""


def test_a_refused_router_flag_imports_no_other_command() -> None:
    done = subprocess.run([sys.executable, "-c", PROBE, "router", "--port", "99999"], capture_output=True,
                          text=True, timeout=60)
    assert done.stdout.strip() == "2 []", done.stdout + done.stderr
    assert done.stderr.startswith("kvxfer router: error: ") and done.stderr.count("\n") == 1, done.stderr


HEAVY = """
import sys
from kvxfer import cli
try:
    cli.main(sys.argv[1:])
except SystemExit as exc:
    print(exc.code, sorted(m for m in ("aiohttp", "requests", "torch") if m in sys.modules))
"""


@pytest.mark.parametrize("argv", [["serve", "--role", "prefill", "--port", "99999"], ["router", "--port", "99999"],
                                  ["up", "--decode", "0"], ["pair", "--requests", "0"], ["doctor", "--timeout", "0"]])
def test_a_refusal_comes_before_the_serving_stack_is_imported(argv: list[str]) -> None:
    done = subprocess.run([sys.executable, "-c", HEAVY, *argv], capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "2 []", done.stdout + done.stderr
    assert done.stderr.startswith(f"kvxfer {argv[0]}: error: ") and done.stderr.count("\n") == 1, done.stderr


def test_an_unknown_command_lists_the_commands() -> None:
    done = subprocess.run([sys.executable, "-m", "kvxfer.cli", "serv"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr.startswith("kvxfer: unknown command 'serv'")
    assert all(f"  {name} " in done.stderr for name in ("pair", "up", "serve", "router", "bench", "doctor"))
