"""The run mark finds a process a test started after it was reparented away, which a look
at this process's children cannot."""

from __future__ import annotations

import os
import signal
import subprocess

from kvxfer.testing.leftovers import RUN_MARK_ENV, mark_run, marked_processes
from kvxfer.testing.waiting import settle
from kvxfer.worker.procs import children_of


def test_an_orphaned_grandchild_is_found_by_its_mark_and_not_among_the_children() -> None:
    mark = f"{RUN_MARK_ENV}={os.environ[RUN_MARK_ENV]}".encode()  # tests/conftest.py marked the run
    # The shell, in a session of its own, starts a sleep, prints its pid and exits: init adopts
    # it. (Not `setsid sleep` inside the shell: setsid may fork, and $! is then a pid that exits.)
    shell = subprocess.run(["sh", "-c", "sleep 60 </dev/null >/dev/null 2>&1 & echo $!"],
                           capture_output=True, text=True, check=True, start_new_session=True)
    orphan = int(shell.stdout.strip())
    try:
        # Until its exec is done the process may still read as the shell's fork: wait for the sleep.
        assert settle(lambda: "sleep 60" in marked_processes(mark).get(orphan, "")), \
            "the orphan was not found by its mark"
        assert orphan not in children_of(os.getpid())
        other = subprocess.run(["sh", "-c", "echo $$"], capture_output=True, text=True, check=True,
                               env={"PATH": os.environ["PATH"]})
        assert int(other.stdout) not in marked_processes(mark)  # gone, and never marked
    finally:
        os.kill(orphan, signal.SIGKILL)
    assert settle(lambda: orphan not in marked_processes(mark)), "a killed orphan is still listed"


def test_a_new_mark_replaces_the_old_one_for_processes_started_from_then_on() -> None:
    old = os.environ[RUN_MARK_ENV]
    try:
        mark = mark_run()
        assert mark == f"{RUN_MARK_ENV}={os.environ[RUN_MARK_ENV]}".encode() and os.environ[RUN_MARK_ENV] != old
    finally:
        os.environ[RUN_MARK_ENV] = old
