"""A case's second process, started so that Ctrl-C reaches the bench and not the child.

Ctrl-C in a terminal sends SIGINT to the whole foreground process group: to ``kvxfer
bench`` and to every child it started (a two-process case's peer, a raw NIXL target, the
layouts workload's decode ranks). A Python child would raise KeyboardInterrupt wherever it
was and print a traceback under the bench's last lines. So every child starts with SIGINT
blocked: a child inherits the signal mask of the thread that forks it, across exec, and
the interpreter in it then never sees the signal (multiprocessing starts its resource
tracker the same way). The bench alone reacts: it stops the run, writes what it measured,
closes every case, each of which ends its children (and kills one that does not exit), and
exits 130. SIGTERM is left as it is: its default action ends a child without a word, and
the bench turns its own into the same stop as Ctrl-C.

The start runs on a helper thread that blocks SIGINT, not on the main thread with SIGINT
blocked: a child takes seconds to come up (NIXL's import), and a Ctrl-C meanwhile must stop
the bench then, not once the child is ready. The child being started is then ended
(SIGTERM), which makes its start fail at once.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable
from multiprocessing import resource_tracker
from typing import Any, TypeVar

from kvxfer.worker.procs import children_of

T = TypeVar("T")
_JOIN_S = 30.0  # a start whose child was ended fails within this (it reads end of file)
_STOP_S = 5.0


def start_child(start: Callable[[], T]) -> T:
    """``start()``, which starts a child process (and may wait until it is up), with SIGINT
    blocked for that child. A Ctrl-C meanwhile ends the child and is raised here."""
    before = running_children()
    box: dict[str, Any] = {}

    def run() -> None:
        # multiprocessing's first spawn launches its resource tracker, and unblocks SIGINT on
        # its way out of that launch: launched first, it leaves this thread's mask alone.
        resource_tracker.ensure_running()
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})  # this thread's mask, the child's from birth
        try:
            box["made"] = start()
        except BaseException as exc:  # raised again on the waiting thread
            box["error"] = exc

    helper = threading.Thread(target=run, name="kvxfer-bench-child-start", daemon=True)
    helper.start()
    try:
        while helper.is_alive():
            helper.join(0.1)  # interruptible: KeyboardInterrupt comes out of the wait
    except KeyboardInterrupt:
        stop(running_children() - before)
        helper.join(_JOIN_S)
        close = getattr(box.get("made"), "close", None)
        if callable(close):
            close()
        raise
    if "error" in box:
        raise box["error"]
    return box["made"]  # type: ignore[no-any-return]


def stop(pids: Iterable[int], wait_s: float = _STOP_S) -> list[int]:
    """SIGTERM ``pids``, then SIGKILL those still running after ``wait_s``; the pids that
    were running. Their owners reap them (a Popen's or a Process's wait)."""
    running = [pid for pid in pids if _signal(pid, signal.SIGTERM)]
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and any(_alive(pid) for pid in running):
        time.sleep(0.05)
    for pid in running:
        if _alive(pid):
            _signal(pid, signal.SIGKILL)
    return running


def running_children() -> set[int]:
    """This process's children now running (Python's own multiprocessing helpers left out)."""
    return set(children_of(os.getpid()))


def stop_leftovers(before: set[int]) -> None:
    """End the children started since ``before`` that are still running once every case is
    closed (none should be): a run leaves no process behind, and says so when it had to."""
    left = sorted(running_children() - before)
    if left:
        stop(left)
        print(f"kvxfer bench: stopped {len(left)} child process(es) that outlived their case: "
              f"{', '.join(map(str, left))}", file=sys.stderr)


def _signal(pid: int, signum: int) -> bool:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        return False
    return True


def _alive(pid: int) -> bool:
    """Running: not gone and not a zombie (ended, not yet reaped by its owner)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2] != "Z"
