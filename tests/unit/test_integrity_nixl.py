"""Row integrity over NIXL between two processes (host memory): the publisher in a child
process, this process fetching with rows corrupted where they landed, before the check. Every
corrupted row is False, every clean row True and byte for byte the publisher's."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from kvxfer.backends.common.integrity import MISMATCH
from kvxfer.contract import Backend, Delivered, Failed, TransferMode
from kvxfer.testing.conformance.transfers import _fill, _finish, _groups, _plan, _start
from kvxfer.testing.corruption import Corruptor
from kvxfer.testing.memory import HostRows
from kvxfer.testing.nixl_pairs import ChildPairs, DeviceRows, make_backend

pytest.importorskip("nixl")

CORRUPT = Corruptor(seed=21, p_bit=0.1, p_row=0.1)


class _CorruptedPairs(ChildPairs):
    def _local_backend(self, mode: TransferMode, memory: HostRows | DeviceRows) -> Backend:
        return make_backend(mode, memory, corrupt_landed=CORRUPT, **self.options)


@pytest.fixture(scope="module")
def pairs() -> Iterator[ChildPairs]:
    yield from _CorruptedPairs.kept(deadline_s=10.0)


@pytest.mark.parametrize("mode", list(TransferMode))
def test_rows_corrupted_after_a_nixl_transfer_are_false_and_clean_ones_exact(pairs: ChildPairs,
                                                                           mode: TransferMode) -> None:
    _check_transfers(pairs, mode, 3)


@pytest.mark.parametrize("options", [
    {"chunk_bytes": 1024, "packed": "never", "window": 2},
    {"packed": "always", "packed_chunk_bytes": 1024, "arena_bytes": 4096},
], ids=["unpacked", "packed"])
def test_a_push_in_many_chunks_sends_the_digest_of_every_chunks_rows(options: dict[str, object]) -> None:
    """The publisher digests each chunk's rows as it posts it (those posted inline at
    submission too): with chunks of 4 rows or fewer, every clean row still checks out."""
    pairs = _CorruptedPairs(deadline_s=10.0, **options)
    try:
        _check_transfers(pairs, TransferMode.PUSH, 2)
    finally:
        pairs.close()


def _check_transfers(pairs: ChildPairs, mode: TransferMode, count: int) -> None:
    pair = pairs(mode)
    try:
        for i in range(count):
            plan = _plan(pair, f"corrupt-{mode.value}-{i}", rows=24, seed=30 + i)
            _fill(pair, plan, local_is_source=False)
            outcome, _ = _finish(pair, _start(pair, plan, "fetch"))
            changed = CORRUPT.take()
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
