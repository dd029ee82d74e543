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


def listening_ports(pid: int) -> set[int]:
    """The TCP ports (IPv4 and IPv6) that process ``pid`` listens on, read from /proc (Linux)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = fd.readlink().name
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    ports = set()
    for table in ("tcp", "tcp6"):
        try:
            lines = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # LISTEN
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports
