"""How a served process tells its parent its port, and notices that its parent is gone.

Kept free of torch and the engine so that ``kvxfer router`` starts without importing them.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import threading
from pathlib import Path


def watch_stdin(loop: asyncio.AbstractEventLoop, stop: asyncio.Event) -> None:
    """Set ``stop`` when stdin reaches EOF: the parent that holds its other end is gone."""
    def run() -> None:
        try:
            # os.read, not sys.stdin: a daemon thread blocked inside the buffered reader holds
            # its lock, and an interpreter exiting meanwhile aborts ("could not acquire lock
            # for <stdin> at interpreter shutdown").
            while os.read(0, 4096):
                pass
        except (OSError, ValueError):
            pass
        try:
            loop.call_soon_threadsafe(stop.set)
        except RuntimeError:
            pass
    threading.Thread(target=run, name="kvxfer-parent-watch", daemon=True).start()


def reserve_stdout() -> int:
    """Keep stdout for the ready line alone: return a duplicate of it, and point fd 1 (and
    Python's stdout) at stderr, so that libraries printing there (NIXL logs) neither mix
    into the announcement nor fill a pipe that the parent stops reading."""
    sys.stdout.flush()
    fd = os.dup(1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return fd


def announce(info: dict[str, object], port_file: str, fd: int) -> None:
    line = json.dumps(info)
    if port_file:
        tmp = Path(port_file + ".tmp")
        tmp.write_text(line + "\n")
        os.replace(tmp, port_file)  # atomic: a reader never sees half a line
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)
