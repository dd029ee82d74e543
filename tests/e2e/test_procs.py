"""children_of: what "no process left behind" counts."""

from __future__ import annotations

import multiprocessing as mp
import os
import subprocess
import sys

from kvxfer.worker.procs import children_of


def _noop() -> None:
    return None


def test_multiprocessing_resource_tracker_is_not_a_left_child() -> None:
    """A spawn context starts Python's resource tracker once per interpreter (the NIXL bench
    does); it exits with the interpreter, so process tests must not count it."""
    proc = mp.get_context("spawn").Process(target=_noop)
    proc.start()
    proc.join(60)
    assert proc.exitcode == 0
    assert children_of(os.getpid()) == []


def test_a_live_child_is_counted() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        assert children_of(os.getpid()) == [child.pid]
    finally:
        child.communicate(b"")
    assert children_of(os.getpid()) == []
