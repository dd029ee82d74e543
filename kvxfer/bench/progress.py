"""A progress bar on stderr: one redrawn line on a terminal, one line per step otherwise.

The time left it shows is measured, not guessed: ``kvxfer.bench.pace`` costs each figure
still to run at its own case's pace so far, and the line says so ("at this pace"), with
how many cases have not begun (those are costed from the others until they run). Until
there is more to go by than one case's first figure, it shows no estimate at all.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

from kvxfer.bench.pace import Pace, clock, duration


class Progress:
    def __init__(self, total: int, stream: TextIO | None = None, enabled: bool = True, width: int = 28) -> None:
        self.total = max(total, 1)
        self.done = 0
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self.width = width
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.started = time.monotonic()
        self.pace: Pace | None = None  # the runner's: what the figures took, and what is left

    def line(self, label: str) -> str:
        frac = self.done / self.total
        filled = int(round(frac * self.width))
        elapsed = time.monotonic() - self.started
        return (f"[{'#' * filled}{'.' * (self.width - filled)}] {self.done}/{self.total}  "
                f"{clock(elapsed)} elapsed{self.left()}  {label}")

    def left(self) -> str:
        """``, about 3 min left at this pace (2 cases not begun)``, or nothing before any figure ran."""
        seconds = self.pace.seconds_left() if self.pace is not None and self.done < self.total else None
        if seconds is None:
            return ""
        assert self.pace is not None
        fresh = self.pace.not_begun()
        span = duration(seconds)
        return f", {span if span.startswith('<') else 'about ' + span} left at this pace" + (
            f" ({fresh} case{'s' if fresh > 1 else ''} not begun)" if fresh else "")

    def step(self, label: str) -> None:
        """Announce the step about to run (so a slow step shows what it is)."""
        if not self.enabled:
            return
        text = self.line(label)
        if self.tty:
            self.stream.write("\r\x1b[2K" + text[:160])
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def advance(self) -> None:
        self.done += 1

    def finish(self) -> None:
        if self.enabled:
            self.stream.write(("\r\x1b[2K" if self.tty else "") + self.line("done") + "\n")
            self.stream.flush()
