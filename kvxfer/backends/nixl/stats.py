"""What the NIXL backend counts: which path carried each submission, and the packed traffic
each end saw."""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass

from kvxfer.backends.common.attempt import TrackedAttempt
from kvxfer.backends.nixl.paths import Path


@dataclass(frozen=True)
class NixlStats:
    """Counters since the backend started: which path carried submissions, and the packed
    traffic each end saw (sent by the active end, scattered by the receiving one)."""

    packed_submissions: int = 0     # pushes this end sent packed
    unpacked_submissions: int = 0   # pushes and pulls this end moved one descriptor per run
    packed_received: int = 0        # transfers that landed here packed
    chunks_sent: int = 0
    bytes_sent: int = 0
    chunks_scattered: int = 0
    bytes_scattered: int = 0
    credits_granted: int = 0
    credits_ahead: int = 0          # of those, granted at fetch() before the sender asked
    chunks_posted_inline: int = 0   # unpacked chunks posted by the owner's publish() (``post_inline``)


class Tally:
    """The counters behind ``NixlBackend.stats()`` and the path of each attempt (weakly held:
    an attempt its owner dropped is forgotten)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[str, int] = dict.fromkeys(NixlStats.__dataclass_fields__, 0)
        self._paths: weakref.WeakKeyDictionary[TrackedAttempt, Path] = weakref.WeakKeyDictionary()

    def count(self, **deltas: int) -> None:
        with self._lock:
            for key, value in deltas.items():
                self._counts[key] += value

    def stats(self) -> NixlStats:
        with self._lock:
            return NixlStats(**self._counts)

    def set_path(self, attempt: TrackedAttempt, path: Path, *, first: bool = False) -> None:
        """``first``: only when no path was set yet (a record confirms what a request said)."""
        with self._lock:
            if first:
                self._paths.setdefault(attempt, path)
            else:
                self._paths[attempt] = path

    def path_of(self, attempt: TrackedAttempt) -> Path | None:
        with self._lock:
            return self._paths.get(attempt)
