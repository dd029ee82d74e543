"""Progress of a command that runs in phases (``kvxfer pair``), as short lines on stderr.

A phase counts something: reference outputs computed, workers up, requests done. On a
terminal its line is redrawn in place (a carriage return) as the count moves, and ended
when the phase is. Elsewhere (a CI log, a file) a phase prints a line when it starts, at
its milestones (each quarter of its count, or each step where every one matters, as a
worker coming up) and at its end: a few lines per phase, never one per token or request.
Nothing is printed when progress is off (``--quiet``); the command's report is not progress
and goes to stdout as before.
"""

from __future__ import annotations

import os
import selectors
import sys
import time
from collections.abc import Sequence
from typing import Any, Protocol, TextIO

from kvxfer.worker.procs import Child, ProcessFailed


class Line:
    """Where progress goes: one line redrawn in place on a terminal, a line per milestone elsewhere."""

    def __init__(self, prefix: str, enabled: bool = True, stream: TextIO | None = None) -> None:
        self.prefix = prefix
        self.enabled = enabled
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._drawn = 0  # the width of the line being redrawn on the terminal (0: none)

    def show(self, text: str, *, end: bool, milestone: bool) -> None:
        """The current state of a phase. ``end``: its last line (a terminal moves past it);
        ``milestone``: worth a line of its own where lines are not redrawn."""
        if not self.enabled:
            return
        line = f"{self.prefix}: {text}"
        if self.tty:
            line = line[: max(self._columns() - 1, 20)]  # a wrapped line would not redraw in place
            self.stream.write("\r" + line + " " * max(self._drawn - len(line), 0) + ("\n" if end else ""))
            self._drawn = 0 if end else len(line)
        elif end or milestone:
            self.stream.write(line + "\n")
        else:
            return
        self.stream.flush()

    def _columns(self) -> int:
        try:
            return os.get_terminal_size(self.stream.fileno()).columns
        except (AttributeError, OSError, ValueError):  # not a real terminal (a test's stand-in)
            return 120

    def say(self, text: str) -> None:
        """A line of its own (a phase that is one event, as the router coming up)."""
        self.show(text, end=True, milestone=True)


class Count:
    """One phase: ``LABEL done/total UNIT, DETAIL (elapsed)``, shown as it moves."""

    def __init__(self, line: Line, label: str, total: int, unit: str = "", *, detail: str = "",
                 every_step: bool = False, started: float | None = None) -> None:
        self.line, self.label, self.total, self.unit = line, label, total, unit
        self.done = 0
        self.every_step = every_step  # each step a milestone (a worker up), not each quarter
        self.started = time.perf_counter() if started is None else started
        self._quarter = 0
        line.show(self.text(detail), end=total <= 0, milestone=True)

    def text(self, detail: str = "") -> str:
        out = f"{self.label} {self.done}/{self.total}" + (f" {self.unit}" if self.unit else "")
        return out + (f", {detail}" if detail else "") + f" ({time.perf_counter() - self.started:.1f} s)"

    def advance(self, detail: str = "") -> None:
        self.done += 1
        quarter = 4 * self.done // max(self.total, 1)
        milestone, self._quarter = self.every_step or quarter > self._quarter, quarter
        self.line.show(self.text(detail), end=self.done >= self.total, milestone=milestone)


class _Outcome(Protocol):
    tokens: list[int]
    error: str | None

    @property
    def matched(self) -> bool: ...


class RequestProgress:
    """Requests sent through the router: how many are done, and how many failed so far."""

    def __init__(self, total: int, enabled: bool = True, line: Line | None = None,
                 label: str = "sending requests") -> None:
        self.total, self.done, self.tokens, self.failed, self.differ = total, 0, 0, 0, 0
        line = line or Line("kvxfer pair", enabled)
        self._count = Count(line, label, total, "done") if total > 0 and line.enabled else None

    def update(self, result: _Outcome) -> None:
        self.done += 1
        self.tokens += len(result.tokens)
        if result.error is not None:
            self.failed += 1
        elif not result.matched:
            self.differ += 1
        if self._count is not None:
            differ = f", {self.differ} differ from the reference" if self.differ else ""
            self._count.advance(f"{self.failed} failed{differ}, {self.tokens} tokens")


def wait_announced(group: Any, children: Sequence[Child], timeout: float, count: Count) -> None:
    """Wait for every child's ready line (``group.wait_ready``), counting each as it comes, in
    the order they announce it; a child that exits first is reported then, not after the rest."""
    deadline = time.monotonic() + timeout
    pending = list(children)
    while pending:
        child = _next_announced(pending, deadline)
        if child is None:
            late = pending[0]
            raise ProcessFailed(f"{', '.join(c.name for c in pending)} did not announce readiness within "
                                f"{timeout:.0f}s; log: {late.log_path}\n{late.log_tail()}")
        group.wait_ready([child], max(deadline - time.monotonic(), 1.0))  # a line begun is read to its end
        pending.remove(child)
        waiting = f", waiting for {', '.join(c.name for c in pending[:3])}" + (", ..." if len(pending) > 3 else "")
        count.advance(f"{child.name} ready" + (waiting if pending else ""))


def _next_announced(pending: list[Child], deadline: float) -> Child | None:
    """The first of ``pending`` with something on its stdout (its ready line, or its end) by
    ``deadline``; a child whose stdout cannot be watched is taken at once."""
    streams = {}
    for child in pending:
        stdout = getattr(getattr(child, "proc", None), "stdout", None)
        if stdout is None:
            return child
        streams[stdout] = child
    with selectors.DefaultSelector() as sel:
        for stdout in streams:
            sel.register(stdout, selectors.EVENT_READ)
        while (left := deadline - time.monotonic()) > 0:
            ready = sel.select(left)
            if ready:
                return streams[ready[0][0].fileobj]
    return None
