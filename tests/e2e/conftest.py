"""Process tests: no child process of the test run may outlive a test."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import pytest

from kvxfer.worker.procs import children_of


@pytest.fixture(autouse=True)
def no_child_left_behind() -> Iterator[None]:
    yield
    deadline = time.monotonic() + 10
    while children_of(os.getpid()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert children_of(os.getpid()) == [], "a test left a child process running"
