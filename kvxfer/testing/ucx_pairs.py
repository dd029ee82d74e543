"""Connected ucx pairs for the conformance kit: both ends in this process (two ucxx workers),
or the peer in a child process (``ChildPairs``), over host memory (or device memory with
``memory_kind="device"``, where ucxx was built with CUDA)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from kvxfer.backends.ucx import UcxBackend
from kvxfer.contract import TransferMode
from kvxfer.testing.conformance import InProcessPeer, Pair
from kvxfer.testing.memory import HostRows
from kvxfer.testing.nixl_pairs import LOCAL_BUFFERS, PEER_BUFFERS, DeviceRows, rows_of
from kvxfer.testing.subprocess_peer import SubprocessPeer, live_children


def make_backend(mode: TransferMode, memory: HostRows | DeviceRows, **options: Any) -> UcxBackend:
    backend = UcxBackend(mode=mode, **options)
    backend.register(memory.regions)
    return backend


def _injector(backend: UcxBackend) -> Callable[[int | None], None]:
    def inject(rows: int | None) -> None:
        backend.fail_after_rows = rows
    return inject


def ucx_pair(mode: TransferMode, *, deadline_s: float = 10.0, memory_kind: str = "host", **options: Any) -> Pair:
    """Two UcxBackends in this process."""
    local_mem, peer_mem = rows_of(memory_kind, LOCAL_BUFFERS), rows_of(memory_kind, PEER_BUFFERS)
    local = make_backend(mode, local_mem, deadline_s=deadline_s, **options)
    peer = make_backend(mode, peer_mem, deadline_s=deadline_s, **options)

    def close() -> None:
        local.shutdown()
        peer.shutdown()

    return Pair(local, local_mem, local_mem.regions,
                InProcessPeer(peer, peer_mem, peer_mem.regions, _injector(peer)), mode, _injector(local), close)


def child_backend(mode: str, deadline_s: float = 10.0, memory_kind: str = "host",
                  **options: Any) -> tuple[UcxBackend, HostRows | DeviceRows, Callable[[int | None], None]]:
    """Runs in the child process of a SubprocessPeer: a UcxBackend over the kit's peer buffers."""
    memory = rows_of(memory_kind, PEER_BUFFERS)
    backend = make_backend(TransferMode(mode), memory, deadline_s=deadline_s, **options)
    return backend, memory, _injector(backend)


class ChildPairs:
    """A ``make_pair`` factory whose peer is a UcxBackend in one child process, rebuilt for
    each pair; ``close()`` ends the child."""

    def __init__(self, *, deadline_s: float = 10.0, memory_kind: str = "host", **options: Any) -> None:
        self.options = {"deadline_s": deadline_s, **options}
        self.memory_kind = memory_kind
        self.peer: SubprocessPeer | None = None

    def __call__(self, mode: TransferMode) -> Pair:
        kwargs = {"mode": mode.value, "memory_kind": self.memory_kind, **self.options}
        if self.peer is None:
            self.peer = SubprocessPeer("kvxfer.testing.ucx_pairs:child_backend", kwargs)
        else:
            self.peer.rebuild(kwargs)
        peer = self.peer
        local_mem = rows_of(self.memory_kind, LOCAL_BUFFERS)
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

    @staticmethod
    def kept(**options: Any) -> Iterator[ChildPairs]:
        """For a module-scoped fixture: the pairs, then their child closed, and AssertionError
        if any child process of this one is left running."""
        pairs = ChildPairs(**options)
        try:
            yield pairs
        finally:
            pairs.close()
        left = live_children()
        if left:
            raise AssertionError(f"child processes left running: {left}")
