"""Start-up checks every server command runs before it builds anything: one line naming the
problem, exit status 2 (``parser.error``), never a traceback and never a half-built worker.

A port in use is found before pools, agents and models are made (a bind probe; a second
process may still take the port between the probe and the real bind, which the server's own
start then reports in one line too). A malformed ``KVXFER_HINT_KEY`` is refused here rather
than on the first request.
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import signal
import socket
import sys
from typing import TYPE_CHECKING

from kvxfer.wire import WireError, hint_key_from_env

if TYPE_CHECKING:
    from kvxfer.serving.http import HttpServer

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def log_level(text: str) -> str:
    """``--log-level``'s type: any case of LOG_LEVELS."""
    level = text.upper()
    if level not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(f"must be one of {', '.join(LOG_LEVELS)}, got {text!r}")
    return level


def port_in_use(host: str, port: int) -> str | None:
    """Why ``host:port`` cannot be served (in use, or not an address of this machine), or
    None; port 0 (ephemeral) always can."""
    if port == 0:
        return None
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        return f"--host {host} does not resolve: {exc.strerror}"
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server binds: TIME_WAIT is no conflict
        try:
            probe.bind(address)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return f"port {port} on {host} is in use: stop what listens there, or pass another --port (0: any)"
            return f"cannot listen on {host}:{port}: {exc.strerror}"
    return None


def check_serving(parser: argparse.ArgumentParser, host: str, port: int) -> None:
    """The checks of every server command: the port, and the hint key."""
    reason = port_in_use(host, port)
    if reason is not None:
        parser.error(reason)
    try:
        hint_key_from_env()
    except WireError as exc:
        parser.error(str(exc))


async def listen(server: HttpServer, prog: str, host: str, port: int) -> int | None:
    """The port ``server`` now listens on; None, after one line on stderr saying why, when it
    cannot (the port was taken after ``check_serving``'s probe): the caller exits 2."""
    try:
        return await server.start()
    except OSError as exc:
        print(f"{prog}: error: cannot listen on {host}:{port}: {exc.strerror or exc}", file=sys.stderr, flush=True)
        return None


def stop_on_signals(loop: asyncio.AbstractEventLoop) -> asyncio.Event:
    """An event that SIGTERM or SIGINT sets: a server's signal to stop cleanly."""
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    return stop


def ignore_late_stops(loop: asyncio.AbstractEventLoop) -> None:
    """Once a server is stopping, a second SIGTERM (a parent that closed our stdin and then
    signalled, as ``ProcessGroup.stop`` does) must not kill it mid-exit (status -15): the
    loop would put SIGTERM back to its default when it closes, so it is ignored from now on.
    SIGKILL still ends a server that hangs."""
    loop.remove_signal_handler(signal.SIGTERM)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
