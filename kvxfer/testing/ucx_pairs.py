"""Connected ucx pairs for the conformance kit: both ends in this process (two ucxx workers),
or the peer in a child process (``ChildPairs``), over host memory (or device memory with
``memory_kind="device"``, where ucxx was built with CUDA)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvxfer.backends.ucx import UcxBackend
from kvxfer.contract import Backend, TransferMode
from kvxfer.testing import nixl_pairs
from kvxfer.testing.conformance import Pair
from kvxfer.testing.memory import HostRows
from kvxfer.testing.nixl_pairs import PEER_BUFFERS, DeviceRows, fault_injector, rows_of, two_ends


def make_backend(mode: TransferMode, memory: HostRows | DeviceRows, **options: Any) -> UcxBackend:
    backend = UcxBackend(mode=mode, **options)
    backend.register(memory.regions)
    return backend


def ucx_pair(mode: TransferMode, *, deadline_s: float = 10.0, memory_kind: str = "host", **options: Any) -> Pair:
    """Two UcxBackends in this process."""
    return two_ends(mode, lambda m, memory: make_backend(m, memory, deadline_s=deadline_s, **options), memory_kind)


def child_backend(mode: str, deadline_s: float = 10.0, memory_kind: str = "host", device: int = 0,
                  **options: Any) -> tuple[UcxBackend, HostRows | DeviceRows, Callable[[int | None], None]]:
    """Runs in the child process of a SubprocessPeer: a UcxBackend over the kit's peer buffers."""
    memory = rows_of(memory_kind, PEER_BUFFERS, device)
    backend = make_backend(TransferMode(mode), memory, deadline_s=deadline_s, **options)
    return backend, memory, fault_injector(backend)


class ChildPairs(nixl_pairs.ChildPairs):
    """A ``make_pair`` factory whose peer is a UcxBackend in one child process, rebuilt for
    each pair; ``close()`` ends the child (see ``nixl_pairs.ChildPairs``)."""

    CHILD = "kvxfer.testing.ucx_pairs:child_backend"

    def _local_backend(self, mode: TransferMode, memory: HostRows | DeviceRows) -> Backend:
        return make_backend(mode, memory, **self.options)
