"""The loopback reference backend passes the conformance kit, in both modes."""

from __future__ import annotations

import itertools

import pytest

from kvxfer.backends.loopback import LoopbackBackend, LoopbackFabric
from kvxfer.contract import TransferMode
from kvxfer.testing.conformance import CHECKS, InProcessPeer, Pair
from kvxfer.testing.memory import HostBuffer, HostRows

_names = itertools.count()


def make_pair(mode: TransferMode) -> Pair:
    fabric = LoopbackFabric()
    n = next(_names)
    local = LoopbackBackend(fabric, f"local-{n}", mode, deadline_s=10.0, delay_s=0.01)
    peer = LoopbackBackend(fabric, f"peer-{n}", mode, deadline_s=10.0, delay_s=0.01)
    local_mem = HostRows([HostBuffer("L0", 256, 64), HostBuffer("L1", 96, 40)])
    peer_mem = HostRows([HostBuffer("P0", 256, 48), HostBuffer("P1", 96, 50)])
    local.register(local_mem.regions)
    peer.register(peer_mem.regions)

    def inject_local(rows: int | None) -> None:
        local.fail_after_rows = rows

    def inject_peer(rows: int | None) -> None:
        peer.fail_after_rows = rows

    def close() -> None:
        local.shutdown()
        peer.shutdown()

    return Pair(local, local_mem, local_mem.regions, InProcessPeer(peer, peer_mem, peer_mem.regions, inject_peer),
                mode, inject_local, close)


@pytest.mark.parametrize("mode", list(TransferMode), ids=lambda m: m.value)
@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
def test_loopback_conformance(check, mode):  # type: ignore[no-untyped-def]
    check(make_pair, mode)
