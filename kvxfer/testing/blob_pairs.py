"""Pairs for the conformance kit over a blob store: the backend under test and its "peer", a
second BlobBackend on the same store. A store has no peer that moves bytes: each end moves
its own rows (publish puts them, fetch gets them), so the pair's fetches wait a while for
the keys the other end is still putting (``fetch_wait_s``), as a decode end does when it
knows a prefill end is publishing."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import numpy as np

from kvxfer.backends.blob import BlobBackend, BlobDriver, MemoryDriver, MemoryStore
from kvxfer.contract import CacheKind, LayerGroupRows, TokenRange, TransferMode, View
from kvxfer.testing.conformance import InProcessPeer, Pair
from kvxfer.testing.memory import HostBuffer, HostRows, retain_if_unquiesced

_names = itertools.count()


def blob_pair(mode: TransferMode, driver: Callable[[], BlobDriver] | None = None, *, fetch_wait_s: float = 3.0,
              timeout_s: float = 10.0) -> Pair:
    """Two blob backends on one store (a fresh MemoryStore unless ``driver`` makes the
    drivers), each with two host regions of unequal geometry, as ``loopback_pair``."""
    if driver is None:
        store = MemoryStore()
        driver = lambda: MemoryDriver(store)  # noqa: E731 - one store shared by the two ends
    n = next(_names)
    local_driver, peer_driver = driver(), driver()
    local = BlobBackend(local_driver, name=f"local-{n}", mode=mode, fetch_wait_s=fetch_wait_s, timeout_s=timeout_s)
    peer = BlobBackend(peer_driver, name=f"peer-{n}", mode=mode, fetch_wait_s=fetch_wait_s, timeout_s=timeout_s)
    local_mem = HostRows([HostBuffer("L0", 256, 64), HostBuffer("L1", 96, 40)])
    peer_mem = HostRows([HostBuffer("P0", 256, 48), HostBuffer("P1", 96, 50)])
    local.register(local_mem.regions)
    peer.register(peer_mem.regions)

    def inject(d: BlobDriver) -> Callable[[int | None], None] | None:
        if not isinstance(d, MemoryDriver):
            return None  # faults are injected into the in-memory store only; the kit skips the check

        def fail_after(rows: int | None) -> None:
            d.fail_after = None if rows is None else d._handled + rows
        return fail_after

    def close() -> None:
        retain_if_unquiesced(local.shutdown() | peer.shutdown(), local_mem, peer_mem)

    return Pair(local, local_mem, local_mem.regions,
                InProcessPeer(peer, peer_mem, peer_mem.regions, inject(peer_driver)), mode, inject(local_driver), close,
                peer_hears=False)


def blob_view(memory: HostRows, request: str, slots: list[int], layout: bytes = b"layout-a") -> View:
    """``slots`` of ``memory``'s first region as one paged layer group (``g0``), ordinals
    0..n-1, 16 tokens a row."""
    rows = LayerGroupRows("g0", CacheKind.PAGED, memory.regions[0], np.asarray(slots, dtype=np.int64),
                          np.arange(len(slots), dtype=np.int64))
    return View(request, TokenRange(0, 16 * len(slots)), (rows,), layout)
