"""A progress bar on stderr: one redrawn line on a terminal, one line per step otherwise."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    def __init__(self, total: int, stream: TextIO | None = None, enabled: bool = True, width: int = 28) -> None:
        self.total = max(total, 1)
        self.done = 0
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self.width = width
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.started = time.monotonic()

    def line(self, label: str) -> str:
        frac = self.done / self.total
        filled = int(round(frac * self.width))
        elapsed = time.monotonic() - self.started
        eta = f" eta {elapsed / frac - elapsed:4.0f}s" if 0 < frac < 1 else ""
        return f"[{'#' * filled}{'.' * (self.width - filled)}] {self.done}/{self.total} {elapsed:4.0f}s{eta} {label}"

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
