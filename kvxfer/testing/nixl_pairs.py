"""Connected NIXL pairs for the conformance kit: both ends in this process, or the peer in a
child process (``ChildPairs``, over ``kvxfer.testing.subprocess_peer``), always over host memory."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

from kvxfer.backends.nixl import NixlBackend
from kvxfer.contract import TransferMode
from kvxfer.testing.conformance import InProcessPeer, Pair
from kvxfer.testing.memory import HostBuffer, HostRows
from kvxfer.testing.subprocess_peer import SubprocessPeer

_names = itertools.count()

# Geometry as in kvxfer.testing.pairs: two groups of unequal row sizes at each end.
LOCAL_BUFFERS = (("L0", 256, 64), ("L1", 96, 40))
PEER_BUFFERS = (("P0", 256, 48), ("P1", 96, 50))


def host_rows(spec: tuple[tuple[str, int, int], ...]) -> HostRows:
    return HostRows([HostBuffer(name, slot_bytes, slots) for name, slot_bytes, slots in spec])


def make_backend(mode: TransferMode, memory: HostRows, **options: Any) -> NixlBackend:
    backend = NixlBackend(mode=mode, **options)
    backend.register(memory.regions)
    return backend


def _injector(backend: NixlBackend) -> Callable[[int | None], None]:
    def inject(rows: int | None) -> None:
        backend.fail_after_rows = rows
    return inject


def nixl_pair(mode: TransferMode, *, deadline_s: float = 10.0, **options: Any) -> Pair:
    """Two NixlBackends in this process (UCX between two agents of one process)."""
    local_mem, peer_mem = host_rows(LOCAL_BUFFERS), host_rows(PEER_BUFFERS)
    local = make_backend(mode, local_mem, deadline_s=deadline_s, **options)
    peer = make_backend(mode, peer_mem, deadline_s=deadline_s, **options)

    def close() -> None:
        local.shutdown()
        peer.shutdown()

    return Pair(local, local_mem, local_mem.regions,
                InProcessPeer(peer, peer_mem, peer_mem.regions, _injector(peer)), mode, _injector(local), close)


def child_backend(mode: str, deadline_s: float = 10.0, buffers: list[list[Any]] | None = None,
                  **options: Any) -> tuple[NixlBackend, HostRows, Callable[[int | None], None]]:
    """Runs in the child process of a SubprocessPeer: a NixlBackend over host buffers
    (``buffers``: [name, slot_bytes, slots] items; the kit's peer geometry by default)."""
    memory = host_rows(tuple((str(n), int(b), int(k)) for n, b, k in buffers) if buffers else PEER_BUFFERS)
    backend = make_backend(TransferMode(mode), memory, deadline_s=deadline_s, **options)
    return backend, memory, _injector(backend)


class ChildPairs:
    """A ``make_pair`` factory whose peer is a NixlBackend in one child process, rebuilt for
    each pair (a fresh child per pair costs seconds on a busy 2-core machine). ``close()``
    ends the child."""

    def __init__(self, *, deadline_s: float = 10.0, **options: Any) -> None:
        self.options = {"deadline_s": deadline_s, **options}
        self.peer: SubprocessPeer | None = None

    def __call__(self, mode: TransferMode) -> Pair:
        kwargs = {"mode": mode.value, **self.options}
        if self.peer is None:
            self.peer = SubprocessPeer("kvxfer.testing.nixl_pairs:child_backend", kwargs)
        else:
            self.peer.rebuild(kwargs)
        peer = self.peer
        local_mem = host_rows(LOCAL_BUFFERS)
        local = make_backend(mode, local_mem, **self.options)

        def close() -> None:
            try:
                local.shutdown()
            finally:
                peer.shutdown()

        return Pair(local, local_mem, local_mem.regions, peer, mode, _injector(local), close)

    def close(self) -> None:
        if self.peer is not None:
            self.peer.close()
            self.peer = None
