"""Pieces the reliability experiments share: progress lines, percentiles, /proc samples of a
process, and worker processes started and checked as the chaos tests do it."""

from __future__ import annotations

import asyncio
import os
import re
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TextIO

import numpy as np

from kvxfer.serving.http import HttpError, request_json, request_text
from kvxfer.worker.procs import Child, ProcessGroup

PROGRESS_EVERY_S = 3.0
READY_TIMEOUT_S = 180.0  # a loaded 2-core machine takes tens of seconds to start a worker
SETTLE_S = 15.0          # how long a worker may take to drop what a finished request held


class Progress:
    """One line on stderr at most every ``every_s`` seconds (and at the end), so that a long
    experiment shows it is alive without flooding a log."""

    def __init__(self, what: str, total: int, *, every_s: float = PROGRESS_EVERY_S, stream: TextIO | None = None,
                 enabled: bool = True) -> None:
        self.what, self.total = what, max(total, 1)
        self.every_s = every_s
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self.started = time.monotonic()
        self._last = self.started

    def note(self, text: str) -> None:
        if self.enabled:
            elapsed = time.monotonic() - self.started
            self.stream.write(f"[reliability] {self.what}: {text} ({elapsed:.0f}s)\n")
            self.stream.flush()

    def tick(self, done: int, extra: str = "") -> None:
        now = time.monotonic()
        if now - self._last >= self.every_s:
            self._last = now
            self.note(f"{done}/{self.total}" + (f", {extra}" if extra else ""))

    def finish(self, extra: str = "") -> None:
        self.note("done" + (f": {extra}" if extra else ""))


def ms(values_s: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile of seconds, in milliseconds (None for no values)."""
    if not values_s:
        return None
    return round(float(np.percentile(np.asarray(values_s, dtype=np.float64), q)) * 1e3, 3)


def max_ms(values_s: Sequence[float]) -> float | None:
    return round(max(values_s) * 1e3, 3) if values_s else None


@dataclass(frozen=True)
class ProcSample:
    """One process at one moment, read from /proc (Linux)."""

    pid: int
    at_s: float  # seconds since the experiment started
    rss_kib: int
    threads: int
    fds: int


def sample_process(pid: int, since: float) -> ProcSample | None:
    """None once the process is gone."""
    try:
        status = open(f"/proc/{pid}/status").read()  # noqa: SIM115 - one read
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None
    rss = re.search(r"^VmRSS:\s+(\d+)\s+kB", status, re.M)
    threads = re.search(r"^Threads:\s+(\d+)", status, re.M)
    return ProcSample(pid, round(time.monotonic() - since, 3), int(rss.group(1)) if rss else -1,
                      int(threads.group(1)) if threads else -1, fds)


def worker_argv(role: str, name: str, *extra: str) -> list[str]:
    """As tests/chaos/test_worker_kill.py starts its workers: a 10 s transfer timeout, so that
    a transfer cut by a kill ends within seconds."""
    return ["serve", "--role", role, "--name", name, "--transfer-timeout", "10", *extra]


def start_workers(group: ProcessGroup, names: Sequence[tuple[str, str]]) -> list[Child]:
    """Start (role, name) workers in parallel and wait for all of them."""
    children = [group.start(name, worker_argv(role, name)) for role, name in names]
    group.wait_ready(children, READY_TIMEOUT_S)
    return children


@dataclass(frozen=True)
class WorkerLeftovers:
    """What a worker still holds after its requests ended (all zero when nothing leaked)."""

    name: str
    answered: bool
    held: int
    reserved: int
    active_streams: int
    open_leases: int       # quarantined leases stay open until proven safe (rows a peer might still write)
    quarantined_rows: int
    server_errors: int  # its kvxfer_worker_requests_total{result="error"}: answers of 500


def _metric(text: str, name: str, label: str = "") -> int:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and (not label or label in line) and not line.startswith("#"):
            head, _, value = line.rpartition(" ")
            if head.split("{", 1)[0] == name:
                total += float(value)
    return int(total)


async def worker_leftovers(child: Child, settle_s: float = SETTLE_S) -> WorkerLeftovers:
    """Its /health and /metrics once nothing is held or reserved and no stream is active (its
    clean-up is done then), or after ``settle_s``: a request's clean-up runs on after its
    last event reached the router."""
    deadline = time.monotonic() + settle_s
    while True:
        try:
            health = await request_json(child.url, "GET", "/health", timeout=5.0)
            metrics = await request_text(child.url, "/metrics", 5.0)
        except HttpError:
            return WorkerLeftovers(child.name, False, -1, -1, -1, -1, -1, -1)
        left = WorkerLeftovers(child.name, True, int(health.get("held", -1)), int(health.get("reserved", -1)),
                           _metric(metrics, "kvxfer_worker_active_streams"), _metric(metrics, "kvxfer_open_leases"),
                           _metric(metrics, "kvxfer_quarantined_slots"),
                           _metric(metrics, "kvxfer_worker_requests_total", 'result="error"'))
        if (left.held, left.reserved, left.active_streams) == (0, 0, 0) or time.monotonic() > deadline:
            return left
        await asyncio.sleep(0.2)
