"""Processes a test run started, however far from it they went.

Why: a module's check of its own children misses a process that was reparented (started
with setsid and double-forked, or left by a child that died first: init adopts it). Every
process inherits the environment it was started with, so a mark set in the test process's
environment at the start of the run follows all of its descendants; /proc/<pid>/environ
shows each one's. A child started with an environment of its own (``env={...}`` without
``os.environ``) carries no mark and is seen only while it is a direct child.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from kvxfer.worker.procs import INTERPRETER_HELPERS

RUN_MARK_ENV = "KVXFER_TEST_RUN"


def mark_run() -> bytes:
    """Mark this process's environment for the processes it starts from now on; the mark as
    it appears in /proc/<pid>/environ. A run started by a test gets a mark of its own."""
    mark = secrets.token_hex(8)
    os.environ[RUN_MARK_ENV] = mark
    return f"{RUN_MARK_ENV}={mark}".encode()


def marked_processes(mark: bytes) -> dict[int, str]:
    """Live (not zombie) processes other than this one whose environment holds ``mark``, with
    their command lines; the interpreter's own multiprocessing helpers are left out (they end
    with their interpreter)."""
    out: dict[int, str] = {}
    me = os.getpid()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        try:
            environ = (entry / "environ").read_bytes()
            if mark not in environ.split(b"\0"):
                continue
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:  # gone meanwhile, or not ours to read
            continue
        if stat[stat.rfind(")") + 2:].split()[0] == "Z" or any(h in cmdline for h in INTERPRETER_HELPERS):
            continue
        out[int(entry.name)] = cmdline.replace(b"\0", b" ").decode(errors="replace").strip()[:200]
    return out
