"""The registry of lenders' claims (kvxfer.lender.claims) stays whole when a lender is
collected while the registry is being read: the collection's finalizer may run inside any
allocation of that read."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from kvxfer.contract import MemoryKind, SlotRegion
from kvxfer.lender import claims


class _Cyclic:
    """A lender stand-in kept only by a reference cycle: collected by the cyclic collector."""

    def __init__(self) -> None:
        self.me = self


def _region(i: int) -> SlotRegion:
    return SlotRegion(f"r{i}", (1 << 40) + i * 4096, 64, 64, MemoryKind.HOST)


@pytest.fixture
def collect_at_every_allocation() -> Iterator[None]:
    threshold = gc.get_threshold()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.set_threshold(*threshold)
        gc.enable()
        gc.collect()


def test_lenders_collected_in_the_middle_of_a_lookup_leave_the_registry_whole(
        collect_at_every_allocation: None) -> None:
    held = [claims.claim(_Cyclic(), [_region(i)], f"pool {i}") for i in range(300)]
    # The 300 lenders are garbage, uncollected. The collector is set to run a few
    # allocations from now: inside the lookup's read of the registry (one tuple per claim;
    # new ones, not CPython's free list of pairs, which counts for nothing and is emptied here).
    pairs = [(i, -i) for i in range(5000)]
    gc.set_threshold(gc.get_count()[0] + 20)
    gc.enable()
    assert claims.holder([_region(299)]) is None  # its lender collected meanwhile
    for i in range(300):
        assert claims.holder([_region(i)]) is None
    owner = _Cyclic()
    again = claims.claim(owner, [_region(7)], "pool 7 again")  # the memory is free again
    assert claims.holder([_region(7)]) is owner
    again.release()
    assert claims.holder([_region(7)]) is None
    del held, pairs
