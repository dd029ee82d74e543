"""The ``kvxfer`` command: each subcommand lives in its own module and is imported on use."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Sequence

# subcommand -> (module, one-line help). A module's ``main(argv) -> int`` runs it.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "pair": ("kvxfer.pair", "run prefill, decode and router locally and check output token for token"),
    "up": ("kvxfer.up", "the router on port 8000 and its workers as one supervised service"),
    "serve": ("kvxfer.worker.serve", "run a prefill or decode worker (--role prefill|decode)"),
    "router": ("kvxfer.router.serve", "serve the embeddable router over HTTP"),
    "bench": ("kvxfer.bench.cli", "transfer microbenchmarks with in-run baselines"),
    "doctor": ("kvxfer.doctor", "say which transport really carries the bytes"),
    "launch": ("kvxfer.launch.cli", "place workers and router on a Ray cluster as actors (kvxfer[ray])"),
}


def _available_one(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


def _available() -> dict[str, tuple[str, str]]:
    return {name: (module, text) for name, (module, text) in SUBCOMMANDS.items() if _available_one(module)}


def _usage(commands: dict[str, tuple[str, str]]) -> str:
    lines = ["usage: kvxfer COMMAND [ARGS...]", "", "commands:"]
    lines += [f"  {name:<8} {text}" for name, (_, text) in commands.items()]
    lines += ["", "Each command takes --help; long ones take --json PATH for a machine-readable report."]
    return "\n".join(lines)


AS_COMMAND = False
"""True once ``main`` runs as this process's own command (``kvxfer ...``, ``python -m
kvxfer.cli ...``: no argv given), not called by a script or a test: the process's state is then
kvxfer's alone, so ``kvxfer pair`` may fork its workers' server from itself (a fork would carry a
caller's atexit handlers and finalizers into every worker)."""


def main(argv: Sequence[str] | None = None) -> int:
    if argv is None:
        # Under ``python -m kvxfer.cli`` this module runs as __main__: the flag goes on the one
        # that ``import kvxfer.cli`` gives, where the commands read it.
        import kvxfer.cli

        kvxfer.cli.AS_COMMAND = True
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(_usage(_available()))
        return 0 if args else 2
    if args[0] in ("--version", "version"):
        from kvxfer import __version__

        print(f"kvxfer {__version__}")
        return 0
    name = args[0]
    # Only the command asked for is looked up: finding a submodule imports its package, and
    # kvxfer.bench's alone is a few tenths of a second that a refusal would wait for.
    if name not in SUBCOMMANDS or not _available_one(SUBCOMMANDS[name][0]):
        print(f"kvxfer: unknown command {name!r}\n\n{_usage(_available())}", file=sys.stderr)
        return 2
    module = importlib.import_module(SUBCOMMANDS[name][0])
    return int(module.main(args[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main())
