"""Waiting for a condition that another thread or process makes true, in tests and tools."""

from __future__ import annotations

import time
from collections.abc import Callable


def settle(condition: Callable[[], object], timeout: float = 5.0, step: float = 0.005) -> bool:
    """Poll ``condition`` until it is true or ``timeout`` seconds passed; its last truth."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if condition():
            return True
        time.sleep(step)
    return bool(condition())
