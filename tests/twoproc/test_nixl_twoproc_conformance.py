"""NixlBackend passes the conformance kit with its peer in a child process (two real processes,
hints crossing as kvxfer.wire bytes), with the packed path forced on and off."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvxfer.contract import TransferMode
from kvxfer.testing.conformance import CHECKS
from kvxfer.testing.nixl_pairs import ChildPairs
from kvxfer.testing.subprocess_peer import live_children


@pytest.fixture(scope="module", params=["always", "never"], ids=lambda p: f"packed-{p}")
def keeps_child(request: pytest.FixtureRequest) -> Iterator[ChildPairs]:
    pairs = ChildPairs(packed=request.param, arena_bytes=8 << 20, packed_chunk_bytes=1 << 20)
    yield pairs
    pid = pairs.peer.pid if pairs.peer else None
    pairs.close()
    assert pid is None or pid not in live_children()
    assert live_children() == []


@pytest.mark.parametrize("mode", list(TransferMode), ids=lambda m: m.value)
@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
def test_nixl_conformance_two_processes(check, mode, keeps_child):  # type: ignore[no-untyped-def]
    check(keeps_child, mode)
    assert keeps_child.peer is not None and keeps_child.peer.process.poll() is None, "the peer child died"
