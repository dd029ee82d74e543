"""``kvxfer router``: the Router served over HTTP.

    POST /generate {"prompt": [ids], "max_new_tokens": N, "request"?: str}
         -> NDJSON: {"event": "token", "index", "token", "at_s"} ... then
            {"event": "done", "final": true, "completion": {...}}  (completion.error set on failure)
            and {"event": "waiting"} whenever KEEPALIVE_S passed without another event
         "request" comes back as completion.request; the workers see the router's own id instead
    GET  /metrics  -> Prometheus text (prometheus_client's, of ``Router.metrics``)
    GET  /health   -> {"status": "ok", "workers": {url: reachable}}
    HEAD on either -> the GET's status and headers, no body

Every request gets an access log line at INFO (logger ``kvxfer.router.access``: method,
path, status, seconds), and a failed worker call a warning (``kvxfer.router``).

A /generate the workers' model cannot serve (ids past its vocabulary, more tokens than its
positions: the limits every worker's /health states) is answered 400, as is malformed JSON.

Announces ``{"event": "ready", "port": N, ...}`` on stdout like ``kvxfer serve``.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import os
import signal
import sys
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import Any

from kvxfer.router.results import Completion
from kvxfer.router.router import POLICIES, SELECTIONS, Router
from kvxfer.serving.announce import announce, reserve_stdout, watch_stdin
from kvxfer.serving.http import BadRequest, HttpServer, Request, Response, check_url
from kvxfer.serving.metrics import CONTENT_TYPE
from kvxfer.serving.startup import LOG_LEVELS, check_serving, listen, log_level


def completion_json(c: Completion) -> dict[str, Any]:
    return dataclasses.asdict(c)


KEEPALIVE_S = 5.0
"""The longest a /generate stream stays silent: the router may wait on its workers for
minutes between two tokens (a stalled transfer, then a recompute elsewhere), and its own
timers end that wait with the failure or the recompute. The "waiting" events let a client
tell such a wait from a router that hung, with a short silence limit of its own."""


def make_handler(router: Router, keepalive_s: float = KEEPALIVE_S):  # type: ignore[no-untyped-def]
    async def handle(request: Request) -> Response:
        path = request.path.strip("/")
        if request.method == "GET" and path == "metrics":
            return Response(200, router.metrics_text().encode(), CONTENT_TYPE)
        if request.method == "GET" and path in ("", "health"):
            return Response.json({"status": "ok", "workers": await router.health()})
        if request.method == "POST" and path == "generate":
            body = request.json()
            prompt = body.get("prompt") if isinstance(body, dict) else None
            max_new = body.get("max_new_tokens", 16) if isinstance(body, dict) else None
            if not isinstance(prompt, list) or not prompt or not all(
                    isinstance(t, int) and not isinstance(t, bool) for t in prompt):
                raise BadRequest("'prompt' must be a non-empty list of token ids")
            if not isinstance(max_new, int) or isinstance(max_new, bool) or max_new < 1:
                raise BadRequest("'max_new_tokens' must be a positive integer")
            problem = await router.check_input(prompt, max_new)
            if problem is not None:
                raise BadRequest(problem)
            rid = body.get("request")
            return Response.ndjson(_events(router, prompt, max_new, rid if isinstance(rid, str) else None,
                                           keepalive_s))
        return Response.json({"error": f"no {request.method} /{path}"}, 404)
    return handle


async def _events(router: Router, prompt: list[int], max_new: int, rid: str | None, keepalive_s: float
                  ) -> AsyncGenerator[dict[str, Any], None]:
    stream = router.stream(prompt, max_new, rid)
    pending: asyncio.Future[Any] | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(stream.__anext__())
            done, _ = await asyncio.wait({pending}, timeout=keepalive_s)
            if not done:
                yield {"event": "waiting"}  # writing it also shows whether the client is still there
                continue
            finished, pending = pending, None
            try:
                item = finished.result()
            except StopAsyncIteration:
                return
            if isinstance(item, Completion):
                yield {"event": "done", "final": True, "completion": completion_json(item)}
            else:
                yield {"event": "token", "index": item.index, "token": item.token, "at_s": item.at_s}
    finally:
        if pending is not None:
            # A client that went away: the router's stream runs on to its next item and is
            # closed there, at a yield, where every worker call it made can be settled (a
            # publish in flight, say, has no clean way back from a cancel). Its own timers
            # bound the wait. Only the server's shutdown cancels it mid-call.
            try:
                await asyncio.wait({pending})
            except asyncio.CancelledError:
                pending.cancel()
                await asyncio.gather(pending, return_exceptions=True)
                raise
        await stream.aclose()


async def serve_router(args: argparse.Namespace, ready_fd: int) -> int:
    router = Router(args.prefill, args.decode, selection=args.selection, on_failure=args.on_failure,
                    timeout_s=args.timeout)
    server = HttpServer(make_handler(router), args.host, args.port, access_log="kvxfer.router.access")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        port = await listen(server, "kvxfer router", args.host, args.port)
        if port is None:
            return 2
        if args.parent_watch:
            watch_stdin(loop, stop)
        announce({"event": "ready", "role": "router", "port": port, "url": f"http://{args.host}:{port}",
                  "pid": os.getpid()}, args.port_file, ready_fd)
        print(f"kvxfer router: listening on http://{args.host}:{port}", file=sys.stderr, flush=True)
        await stop.wait()
    finally:
        await server.close()  # closes the streams still open: their requests' aborts start now
        await router.close()
        if args.json:
            Path(args.json).write_text(json.dumps({"role": "router", "metrics": router.metrics.snapshot()},
                                                  indent=2) + "\n")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvxfer router", description="Serve the kvxfer router over HTTP.",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--prefill", action="append", default=[], metavar="URL", help="a prefill worker (repeat)")
    p.add_argument("--decode", action="append", default=[], metavar="URL", help="a decode worker (repeat)")
    p.add_argument("--selection", default="round_robin", choices=SELECTIONS)
    p.add_argument("--on-failure", default="fail", choices=POLICIES)
    p.add_argument("--timeout", type=float, default=30.0, help="seconds per worker call or stream event")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0 = ephemeral (announced on stdout)")
    p.add_argument("--port-file", default="")
    p.add_argument("--parent-watch", action="store_true", help="exit when stdin closes (the parent died)")
    p.add_argument("--json", default="", metavar="PATH", help="on exit, write a JSON report (metrics)")
    p.add_argument("--log-level", default="WARNING", type=log_level, help=", ".join(LOG_LEVELS))
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


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_numbers(parser, args)
    if not args.decode:
        parser.error("at least one --decode URL is required")
    check_serving(parser, args.host, args.port)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s router %(levelname)s %(name)s: %(message)s")
    return asyncio.run(serve_router(args, reserve_stdout()))


if __name__ == "__main__":
    sys.exit(main())
