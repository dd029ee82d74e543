"""Ready-made connected pairs for the conformance kit and for examples."""

from __future__ import annotations

import itertools

from kvxfer.backends.loopback import LoopbackBackend, LoopbackFabric
from kvxfer.contract import TransferMode
from kvxfer.testing.conformance import InProcessPeer, Pair
from kvxfer.testing.memory import HostBuffer, HostRows, retain_if_unquiesced

_names = itertools.count()


def loopback_pair(mode: TransferMode, *, delay_s: float = 0.01, deadline_s: float = 10.0) -> Pair:
    """Two loopback backends on one fabric, each with two host regions of unequal geometry."""
    fabric = LoopbackFabric()
    n = next(_names)
    local = LoopbackBackend(fabric, f"local-{n}", mode, deadline_s=deadline_s, delay_s=delay_s)
    peer = LoopbackBackend(fabric, f"peer-{n}", mode, deadline_s=deadline_s, delay_s=delay_s)
    local_mem = HostRows([HostBuffer("L0", 256, 64), HostBuffer("L1", 96, 40)])
    peer_mem = HostRows([HostBuffer("P0", 256, 48), HostBuffer("P1", 96, 50)])
    local.register(local_mem.regions)
    peer.register(peer_mem.regions)

    def inject_local(rows: int | None) -> None:
        local.fail_after_rows = rows

    def inject_peer(rows: int | None) -> None:
        peer.fail_after_rows = rows

    def close() -> None:
        retain_if_unquiesced(local.shutdown() | peer.shutdown(), local_mem, peer_mem)

    return Pair(local, local_mem, local_mem.regions, InProcessPeer(peer, peer_mem, peer_mem.regions, inject_peer),
                mode, inject_local, close)
