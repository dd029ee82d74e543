"""Waiting for a condition that another thread or process makes true, in tests and tools."""

from __future__ import annotations

import time
from collections.abc import Callable

from kvxfer.contract import Attempt, Outcome


def settle(condition: Callable[[], object], timeout: float = 5.0, step: float = 0.005) -> bool:
    """Poll ``condition`` until it is true or ``timeout`` seconds passed; its last truth."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if condition():
            return True
        time.sleep(step)
    return bool(condition())


def ended(attempt: Attempt, timeout: float = 10.0) -> Outcome:
    """Wait until ``attempt`` has its outcome and has quiesced: the outcome (AssertionError
    naming the attempt if not within ``timeout`` seconds)."""
    assert settle(lambda: attempt.poll() is not None and attempt.quiesced(), timeout, 0.002), attempt
    outcome = attempt.poll()
    assert outcome is not None, attempt
    return outcome
