"""``kvxfer up``: the router and its workers as one supervised service, in one command.

    kvxfer up --model smollm2                # the router on 127.0.0.1:8000, one prefill, one decode
    kvxfer up --model smollm2 --prefill 2 --decode 2 --port 9000 --backend nixl --mode pull

It starts the prefill and decode workers (``kvxfer serve``), then the router (``kvxfer
router``) on ``--port`` with those workers, each as a child process logging to ``--log-dir``,
and prints one line once the router answers: ``kvxfer up: serving MODEL at URL/v1 ...``. It
stays up: a worker or the router that exits is started again on the port it had, so the
router's list of workers stays true (at most ``--restarts`` times in ten minutes for each,
after which ``kvxfer up`` stops everything and exits 1). Ctrl-C or SIGTERM stops every
process it started and exits 0.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

from kvxfer.engine import TOY
from kvxfer.serving.command import CommandParser
from kvxfer.serving.startup import check_serving
from kvxfer.worker.forked import preload
from kvxfer.worker.procs import Child, ProcessFailed, ProcessGroup
from kvxfer.worker.serve import (
    add_model_args,
    check_backend,
    check_model_args,
    check_visible,
    model_args_list,
    parse_device,
)

RESTART_WINDOW_S = 600.0
"""``--restarts`` counts the restarts of one process within this many seconds."""


@dataclass
class _Supervised:
    """One process of the service: how to start it again, on the port it first had."""

    name: str
    argv: list[str]
    child: Child
    restarts: list[float] = field(default_factory=list)

    def restart_argv(self) -> list[str]:
        argv = list(self.argv)
        argv[argv.index("--port") + 1] = str(self.child.port)
        return argv


def build_parser() -> argparse.ArgumentParser:
    p = CommandParser(prog="kvxfer up", description="Run the router and its prefill and decode workers as one "
                      "supervised service.", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--host", default="127.0.0.1", help="the router's address (the workers stay on 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="the router's port (0: any free one, announced)")
    p.add_argument("--prefill", type=int, default=1, metavar="N", help="prefill workers")
    p.add_argument("--decode", type=int, default=1, metavar="M", help="decode workers")
    p.add_argument("--engine", default="reference", choices=["reference", "transformers"],
                   help="what the workers run: kvxfer's reference engine, or Hugging Face transformers' continuous "
                        "batching (a GGUF --model such as smollm2, the cpu, nixl)")
    p.add_argument("--backend", default="nixl", choices=["nixl", "ipc", "ucx"])
    p.add_argument("--mode", default="push", choices=["push", "pull"])
    p.add_argument("--blocks", type=int, default=2048, help="pool blocks per worker")
    p.add_argument("--on-failure", default="recompute", choices=["fail", "recompute"],
                   help="the router's policy when a worker fails mid-request")
    p.add_argument("--restarts", type=int, default=5,
                   help="restarts of any one process within ten minutes before the service gives up")
    p.add_argument("--startup-timeout", type=float, default=120.0, help="seconds each process may take to be ready")
    p.add_argument("--log-dir", default="", help="each process's log (default: a temporary directory)")
    p.add_argument("--json", default="", metavar="PATH", help="once ready, write the processes (name, pid, port)")
    add_model_args(p)
    return p


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Every flag, before any process starts (exit 2, one line)."""
    for flag in ("prefill", "decode", "blocks"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag} must be at least 1, got {getattr(args, flag)}")
    if args.restarts < 0:
        parser.error(f"--restarts must be 0 or more, got {args.restarts}")
    if not 0 <= args.port <= 65535:
        parser.error(f"--port must be 0 to 65535, got {args.port}")
    if not args.startup_timeout > 0:
        parser.error(f"--startup-timeout must be positive, got {args.startup_timeout}")
    check_serving(parser, args.host, args.port)
    check_model_args(parser, args)
    if args.engine == "transformers":
        _check_transformers(parser, args)
    try:
        check_visible(parse_device(args.device))
    except ValueError as exc:
        parser.error(str(exc))
    check_backend(parser, args.backend)


def _check_transformers(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``--engine transformers``: what it cannot run yet, named before anything starts."""
    if args.model == TOY or args.checkpoint:
        parser.error("--engine transformers loads a GGUF with transformers itself: give --model smollm2 or a .gguf "
                     "path (not the toy model or --checkpoint)")
    if args.device not in ("auto", "cpu"):
        parser.error(f"--engine transformers runs on the cpu for now, not --device {args.device}")
    if args.backend != "nixl":
        parser.error(f"--engine transformers moves KV over nixl for now, not --backend {args.backend}")
    if importlib.util.find_spec("transformers") is None:
        parser.error("--engine transformers needs transformers (pip install 'kvxfer[transformers]')")


def _prepare_transformers(args: argparse.Namespace) -> None:
    """Import the transformers engine once for every worker (the fork server), and convert the
    GGUF here when no conversion is kept yet, rather than in each worker at once."""
    import torch

    from kvxfer.adapters.transformers.converted import cache_root, converted_dir, load_converted
    from kvxfer.modelfiles import model_path

    preload("kvxfer.worker.hf_engine")
    path = model_path(args.model)
    assert path is not None  # _check_transformers refused the toy model
    if not (converted_dir(path, torch.float32) / "model.safetensors").is_file():
        print(f"kvxfer up: converting {path.name} with transformers once (kept in {cache_root()})", file=sys.stderr,
              flush=True)
        load_converted(path)


def _workers(group: ProcessGroup, args: argparse.Namespace) -> list[_Supervised]:
    common = ["--port", "0", "--backend", args.backend, "--mode", args.mode, "--blocks", str(args.blocks),
              "--etcd", "", "--engine", args.engine, *model_args_list(args)]
    out = []
    for role, count in (("prefill", args.prefill), ("decode", args.decode)):
        for i in range(count):
            name = f"{role}{i}"
            argv = ["serve", "--role", role, "--name", name, *common]
            out.append(_Supervised(name, argv, group.start(name, argv)))
    group.wait_ready([w.child for w in out], args.startup_timeout)
    return out


def _router(group: ProcessGroup, args: argparse.Namespace, workers: list[_Supervised]) -> _Supervised:
    argv = ["router", "--host", args.host, "--port", str(args.port), "--on-failure", args.on_failure,
            "--model", args.checkpoint or args.model, "--etcd", ""]
    for w in workers:
        argv += [f"--{w.child.info['role']}", w.child.url]
    router = _Supervised("router", argv, group.start("router", argv))
    group.wait_ready([router.child], args.startup_timeout)
    return router


def _restart(group: ProcessGroup, proc: _Supervised, args: argparse.Namespace) -> str | None:
    """Start ``proc`` again on its port; why not (too many restarts, or it failed), else None."""
    now = time.monotonic()
    proc.restarts = [t for t in proc.restarts if now - t < RESTART_WINDOW_S] + [now]
    if len(proc.restarts) > args.restarts:
        return f"{proc.name} exited {len(proc.restarts)} times within {RESTART_WINDOW_S:.0f} s"
    proc.child.stop()  # reaped, its log closed
    group.children.remove(proc.child)
    argv = proc.restart_argv()
    proc.child = group.start(proc.name, argv)
    try:
        proc.child.wait_ready(args.startup_timeout)
    except ProcessFailed as exc:
        return f"{proc.name} did not come back: {exc}"
    return None


def supervise(group: ProcessGroup, procs: list[_Supervised], args: argparse.Namespace,
              stop: threading.Event) -> int:
    """Until ``stop``: restart any process that exited; 1 when one cannot be kept up."""
    while not stop.wait(0.2):
        for proc in procs:
            if proc.child.alive() or stop.is_set():
                continue
            code = proc.child.proc.poll()
            print(f"kvxfer up: {proc.name} exited ({code}); starting it again on port {proc.child.port} "
                  f"(log: {proc.child.log_path})", file=sys.stderr, flush=True)
            why = _restart(group, proc, args)
            if why is not None:
                print(f"kvxfer up: {why}; stopping the service", file=sys.stderr, flush=True)
                return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_args(parser, args)
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    log_dir = Path(args.log_dir) if args.log_dir else Path(tempfile.mkdtemp(prefix="kvxfer-up-"))
    if args.engine == "transformers":
        _prepare_transformers(args)
    try:
        with ProcessGroup(log_dir) as group:
            try:
                workers = _workers(group, args)
                router = _router(group, args, workers)
            except ProcessFailed as exc:
                print(f"kvxfer up: {exc}", file=sys.stderr, flush=True)
                return 2
            procs = [*workers, router]
            if args.json:
                Path(args.json).write_text(json.dumps(
                    [{"name": p.name, "pid": p.child.pid, "port": p.child.port} for p in procs], indent=2) + "\n")
            url = f"http://{args.host}:{router.child.port}"
            print(f"kvxfer up: serving {args.checkpoint or args.model} at {url}/v1 ({args.prefill} prefill, "
                  f"{args.decode} decode on {args.backend} {args.mode}; logs in {log_dir}); Ctrl-C stops it",
                  flush=True)
            code = supervise(group, procs, args, stop)
            print("kvxfer up: stopping", file=sys.stderr, flush=True)
            return code
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


if __name__ == "__main__":
    sys.exit(main())
