"""A thread-safe attempt that a backend's progress thread concludes and quiesces."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from kvxfer.contract import Attempt, Outcome, WakeFn

log = logging.getLogger(__name__)


def cancel_and_wait_quiet(attempts: list[TrackedAttempt], kick: Callable[[], None], grace_s: float = 1.0) -> None:
    """A backend's shutdown, first step: cancel every attempt, then give peers up to
    ``grace_s`` to confirm that they stopped touching our memory, kicking the backend's
    progress thread (``kick``) while waiting so that it handles their answers."""
    for attempt in attempts:
        attempt.cancel()
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and not all(a.quiesced() for a in attempts):
        kick()
        time.sleep(0.002)


class TrackedAttempt(Attempt):
    """Outcome and quiescence are set once each, by the backend; wake runs after each is visible."""

    def __init__(self, wake: WakeFn | None = None, on_cancel: Callable[[TrackedAttempt], None] | None = None,
                 label: str = "") -> None:
        self._lock = threading.Lock()
        self._outcome: Outcome | None = None
        self._quiesced = False
        self._wake = wake
        self._on_cancel = on_cancel
        self._cancel_requested = False  # set once, read without the lock (a bool is atomic here)
        self._done: threading.Event | None = None  # made by the first wait(): most attempts are never waited on
        self.label = label
        self.started = time.monotonic()

    # --- the owner's side -------------------------------------------------------------
    def poll(self) -> Outcome | None:
        return self._outcome

    def quiesced(self) -> bool:
        return self._quiesced

    def cancel(self) -> None:
        if self._cancel_requested or self._outcome is not None:
            self._cancel_requested = True
            return
        self._cancel_requested = True
        if self._on_cancel is not None:
            self._on_cancel(self)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until concluded and quiesced (for tests and tools, not for owners' loops)."""
        with self._lock:
            if self._outcome is not None and self._quiesced:
                return True
            if self._done is None:
                self._done = threading.Event()
            done = self._done
        return done.wait(timeout)

    # --- the backend's side -----------------------------------------------------------
    @property
    def cancel_requested(self) -> bool:
        return self._cancel_requested

    def conclude(self, outcome: Outcome) -> bool:
        """Set the outcome unless one is set already; True when this call set it."""
        with self._lock:
            if self._outcome is not None:
                return False
            self._outcome = outcome
            done = self._done if self._quiesced else None
        if done is not None:
            done.set()
        self._notify()
        return True

    def mark_quiesced(self) -> None:
        with self._lock:
            if self._quiesced:
                return
            self._quiesced = True
            done = self._done if self._outcome is not None else None
        if done is not None:
            done.set()
        self._notify()

    def _notify(self) -> None:
        if self._wake is None:
            return
        try:
            self._wake()
        except Exception:  # a failing wake must not stop the backend's progress thread
            log.exception("wake callback of attempt %s raised", self.label)

    def __repr__(self) -> str:
        return f"<TrackedAttempt {self.label} outcome={type(self._outcome).__name__} quiesced={self._quiesced}>"
