"""Two-process tests: every child a test starts must be reaped by the end of the test."""

from __future__ import annotations

import multiprocessing as mp
from collections.abc import Iterator

import pytest

from kvxfer.testing.subprocess_peer import live_children


@pytest.fixture(autouse=True)
def no_child_left_behind(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    if "keeps_child" in request.fixturenames:
        return  # a module-scoped child is checked when its fixture ends
    assert live_children() == [], "a test left a peer child process running"
    left = [p for p in mp.active_children() if p.name == "kvxfer-ipc-peer"]  # kvxfer.testing.ipc_pairs.ChildPeer
    assert not left, f"IPC peer processes left running: {left}"
