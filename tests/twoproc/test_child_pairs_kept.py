"""ChildPairs.kept, the GPU modules' fixtures' helper, over host memory (in a module of its
own: another module's kept child would be alive beside it)."""

from __future__ import annotations

import pytest

from kvxfer.contract import TransferMode
from kvxfer.testing.conformance import CHECKS
from kvxfer.testing.nixl_pairs import ChildPairs
from kvxfer.testing.subprocess_peer import live_children


def test_kept_pairs_end_their_child_and_name_any_left_running() -> None:
    """ChildPairs.kept, as the GPU modules' fixtures use it: at teardown its child is gone;
    a child process of this one still running then is an AssertionError naming its pid."""
    from kvxfer.testing.subprocess_peer import SubprocessPeer

    kept = ChildPairs.kept()
    pairs = next(kept)
    CHECKS[0](pairs, TransferMode.PUSH)
    assert pairs.peer is not None
    pid = pairs.peer.pid
    with pytest.raises(StopIteration):
        next(kept)
    assert pairs.peer is None and pid not in live_children()

    kept = ChildPairs.kept()
    next(kept)
    stray = SubprocessPeer("kvxfer.testing.nixl_pairs:child_backend", {"mode": "push"})
    try:
        with pytest.raises(AssertionError, match=f"left running: \\[{stray.pid}\\]"):
            next(kept)
    finally:
        stray.close()
    assert live_children() == []
