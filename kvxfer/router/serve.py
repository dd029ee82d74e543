"""``kvxfer router``: the Router served over HTTP, OpenAI-compatible (``kvxfer.router.app``
lists the routes).

    kvxfer router --prefill http://127.0.0.1:8001 --decode http://127.0.0.1:8002   # port 8000
    kvxfer router ... --model smollm2   # serve this name, with this GGUF's tokenizer (default: the workers')
    kvxfer router --etcd http://127.0.0.1:2379   # the workers registered in etcd (kvxfer serve --etcd), as they come and go
    kvxfer router ... --api-key-file PATH   # clients send 'Authorization: Bearer KEY' (kvxfer.serving.keys)

With ``KVXFER_CLUSTER_KEY`` (or ``--cluster-key-file``) it sends the workers' cluster key on
every worker call.

Every request gets an access log line at INFO (logger ``kvxfer.router.access``: method,
path, status, seconds, and for a 4xx the message it answered), and a failed worker call a
warning (``kvxfer.router``).

Announces ``{"event": "ready", "port": N, ...}`` on stdout like ``kvxfer serve``, and says
where it listens on stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvxfer.modelfiles import CheckpointError, load_tokenizer
from kvxfer.router.constants import POLICIES, SELECTIONS
from kvxfer.serving.announce import announce, reserve_stdout, watch_stdin
from kvxfer.serving.command import CommandParser
from kvxfer.serving.discovery import Membership, add_etcd_args, check_etcd, in_thread, with_health
from kvxfer.serving.keys import add_key_args, keys_from_args, open_door_warning
from kvxfer.serving.startup import LOG_LEVELS, check_serving, ignore_late_stops, listen, log_level, stop_on_signals
from kvxfer.serving.urls import check_url

if TYPE_CHECKING:
    from kvxfer.router.router import Router


async def serve_router(args: argparse.Namespace, ready_fd: int) -> int:
    from kvxfer.router.app import make_handler
    from kvxfer.router.frontend import OpenAIFrontend
    from kvxfer.router.router import Router
    from kvxfer.serving.http import HttpServer

    router = Router(args.prefill, args.decode, selection=args.selection, on_failure=args.on_failure,
                    timeout_s=args.timeout, cluster_key=args.cluster_key)
    frontend = OpenAIFrontend(router, model=args.model or None, tokenizer=args.tokenizer)
    handler = make_handler(router, frontend, api_key=args.api_key)
    membership = None
    if args.etcd_client is not None:
        membership = await _follow(args, router)
        handler = with_health(handler, "discovery", membership.state)
    server = HttpServer(handler, args.host, args.port, access_log="kvxfer.router.access")
    loop = asyncio.get_running_loop()
    stop = stop_on_signals(loop)
    try:
        port = await listen(server, "kvxfer router", args.host, args.port)
        if port is None:
            return 2
        if args.parent_watch:
            watch_stdin(loop, stop)
        announce({"event": "ready", "role": "router", "port": port, "url": f"http://{args.host}:{port}",
                  "pid": os.getpid()}, args.port_file, ready_fd)
        print(f"kvxfer router: listening on http://{args.host}:{port}", file=sys.stderr, flush=True)
        warning = open_door_warning("kvxfer router", args.host, args.api_key, "API key",
                                    "run completions on the workers (--api-key-file or KVXFER_API_KEY)")
        if warning:
            print(warning, file=sys.stderr, flush=True)
        await stop.wait()
    finally:
        ignore_late_stops(loop)
        if membership is not None:
            await in_thread(membership.close, 1.0, "etcd-unwatch")  # its thread dies with the process
        await server.close()  # closes the streams still open: their requests' aborts start now
        await router.close()
        if args.json:
            Path(args.json).write_text(json.dumps({"role": "router", "metrics": router.metrics.snapshot()},
                                                  indent=2) + "\n")
    return 0


async def _follow(args: argparse.Namespace, router: Router) -> Membership:
    """Follow the workers registered in etcd; with static workers, those set the model that
    discovered ones must serve."""
    model = None
    if args.prefill or args.decode:
        limits = await router.model()
        model = limits.name or None if limits is not None else None
    membership = Membership(args.etcd_client, args.etcd_namespace, router, model=model)
    membership.start()
    if not await membership.synced(args.etcd_client.timeout * 3):
        logging.getLogger("kvxfer.router").warning("etcd at %s: the workers' list not read yet; following it "
                                                   "in the background", args.etcd_client)
    return membership


def build_parser() -> argparse.ArgumentParser:
    p = CommandParser(prog="kvxfer router", description="Serve the kvxfer router over HTTP.",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--prefill", action="append", default=[], metavar="URL", help="a prefill worker (repeat)")
    p.add_argument("--decode", action="append", default=[], metavar="URL", help="a decode worker (repeat)")
    p.add_argument("--selection", default="round_robin", choices=SELECTIONS)
    p.add_argument("--on-failure", default="fail", choices=POLICIES)
    p.add_argument("--model", default="", metavar="NAME",
                   help="the model clients name in OpenAI requests, whose GGUF gives the tokenizer and chat "
                        "template: toy, smollm2 or a .gguf path (default: the one the workers' /health names)")
    p.add_argument("--timeout", type=float, default=30.0, help="seconds per worker call or stream event")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0 = ephemeral (announced on stdout)")
    p.add_argument("--port-file", default="")
    p.add_argument("--parent-watch", action="store_true", help="exit when stdin closes (the parent died)")
    p.add_argument("--json", default="", metavar="PATH", help="on exit, write a JSON report (metrics)")
    p.add_argument("--log-level", default="WARNING", type=log_level, help=", ".join(LOG_LEVELS))
    add_etcd_args(p, register=False)
    add_key_args(p, api=True, cluster=True)
    return p


def check_numbers(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse numbers and worker URLs that cannot work, by flag, before anything starts (exit 2)."""
    if not 0 < args.timeout < float("inf"):
        parser.error(f"--timeout must be a positive number of seconds, got {args.timeout}")
    if not 0 <= args.port <= 65535:
        parser.error(f"--port must be 0 to 65535, got {args.port}")
    for url in args.prefill + args.decode:
        try:
            check_url(url)
        except ValueError as exc:
            parser.error(f"worker URL {exc}")


def _tokenizer(parser: argparse.ArgumentParser, model: str) -> Any:
    """The tokenizer of ``--model``, loaded now so that a bad name is a usage error (exit 2)."""
    if not model:
        return None
    try:
        return load_tokenizer(model)
    except CheckpointError as exc:
        parser.error(f"--model {model}: {exc}")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_numbers(parser, args)
    keys_from_args(parser, args)
    check_etcd(parser, args)
    if not args.decode and args.etcd_client is None:
        parser.error("at least one --decode URL is required, or --etcd to discover the workers")
    check_serving(parser, args.host, args.port)
    args.tokenizer = _tokenizer(parser, args.model)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s router %(levelname)s %(name)s: %(message)s")
    return asyncio.run(serve_router(args, reserve_stdout()))


if __name__ == "__main__":
    sys.exit(main())
