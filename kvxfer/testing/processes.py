"""What a process test asserts once a run is over: the processes it started are gone and
their ports closed."""

from __future__ import annotations

import time
from pathlib import Path

from kvxfer.worker.procs import port_open


def gone(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat[stat.rfind(")") + 2] == "Z"  # a zombie runs nothing and holds no port


def assert_nothing_left(processes: list[dict[str, int]]) -> None:
    """Every process of a pair report (``pid``, ``port``) ends within 10 s and frees its port."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not all(gone(p["pid"]) for p in processes):
        time.sleep(0.1)
    assert [p for p in processes if not gone(p["pid"])] == []
    assert [p for p in processes if port_open(p["port"])] == []
