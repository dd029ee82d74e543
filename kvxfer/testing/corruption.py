"""Corrupting rows on purpose: the fault injection behind the integrity tests. The corruptor
itself is production's (``kvxfer.backends.common.corruption``: ``kvxfer serve
--inject-corruption`` uses it); this adds the check a backend's tests share."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from kvxfer.backends.common.corruption import Corruptor, flip_bit, reverse_row, row_bytes
from kvxfer.backends.common.integrity import MISMATCH
from kvxfer.contract import Delivered, Failed, TransferMode
from kvxfer.testing.conformance.pair import Pair
from kvxfer.testing.conformance.transfers import _fill, _finish, _groups, _plan, _start

__all__ = ["Corruptor", "check_corrupted_fetches", "flip_bit", "reverse_row", "row_bytes"]


def corrupting(pairs: type, make_backend: Callable[..., object], corruptor: Corruptor) -> type:
    """``pairs`` (the nixl or ucx kit's ``ChildPairs``) whose local, fetching end, made by that
    kit's ``make_backend``, damages the rows that land there through ``corruptor``."""

    class Corrupting(pairs):  # type: ignore[valid-type, misc]
        def _local_backend(self, mode: TransferMode, memory: object) -> object:
            return make_backend(mode, memory, corrupt_landed=corruptor, **self.options)

    return Corrupting


def check_corrupted_fetches(make_pair: Callable[[TransferMode], Pair], mode: TransferMode, count: int,
                            corruptor: Corruptor) -> None:
    """``count`` fetches of 24 scattered rows per group through a pair whose local (fetching)
    end has ``corruptor`` as its ``corrupt_landed`` hook: every row it changed is False, every
    other row True and byte for byte the source's, and the outcome is Failed, never Delivered."""
    pair = make_pair(mode)
    try:
        for i in range(count):
            plan = _plan(pair, f"corrupt-{mode.value}-{i}", rows=24, seed=30 + i)
            _fill(pair, plan, local_is_source=False)
            outcome, _ = _finish(pair, _start(pair, plan, "fetch"))
            changed = corruptor.take()
            assert changed, "the seeded corruptor changed no row"
            for mask, (name, region, _) in zip(outcome.masks, _groups(pair)):
                slots = plan.local_slots[name]
                expected = np.array([(region.name, int(s)) not in changed for s in slots.tolist()])
                assert mask.tolist() == expected.tolist()
                got = pair.local_memory.read(region.name, slots[expected])
                rows = np.frombuffer(plan.payload[name], dtype=np.uint8).reshape(slots.size, -1)
                assert got == rows[expected].tobytes()
            assert isinstance(outcome, Failed) and outcome.reason.startswith(MISMATCH), outcome
            assert not isinstance(outcome, Delivered)
    finally:
        pair.close()
