"""Row integrity over NIXL between two processes (host memory): the publisher in a child
process, this process fetching with rows corrupted where they landed, before the check. Every
corrupted row is False, every clean row True and byte for byte the publisher's."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvxfer.contract import TransferMode
from kvxfer.testing.corruption import Corruptor, check_corrupted_fetches, corrupting
from kvxfer.testing.nixl_pairs import ChildPairs, make_backend

pytest.importorskip("nixl")

CORRUPT = Corruptor(seed=21, p_bit=0.1, p_row=0.1)


_CorruptedPairs = corrupting(ChildPairs, make_backend, CORRUPT)


@pytest.fixture(scope="module")
def pairs() -> Iterator[ChildPairs]:
    yield from _CorruptedPairs.kept(deadline_s=10.0)


@pytest.mark.parametrize("mode", list(TransferMode))
def test_rows_corrupted_after_a_nixl_transfer_are_false_and_clean_ones_exact(pairs: ChildPairs,
                                                                           mode: TransferMode) -> None:
    check_corrupted_fetches(pairs, mode, 3, CORRUPT)


@pytest.mark.parametrize("mode, options", [
    (TransferMode.PUSH, {"chunk_bytes": 1024, "packed": "never", "window": 2}),
    (TransferMode.PUSH, {"packed": "always", "packed_chunk_bytes": 1024, "arena_bytes": 4096}),
    (TransferMode.PULL, {"chunk_bytes": 1024, "window": 2}),
], ids=["push-unpacked", "push-packed", "pull"])
def test_a_transfer_in_many_chunks_checks_every_chunks_rows(mode: TransferMode, options: dict[str, object]) -> None:
    """With chunks of 4 rows or fewer: a push publisher digests each chunk's rows as it posts
    it (those posted inline at submission too), and a pull fetcher checks each chunk's rows as
    its READ completes, while later READs move; either way every damaged row is False and
    every clean row checks out."""
    pairs = _CorruptedPairs(deadline_s=10.0, **options)
    try:
        check_corrupted_fetches(pairs, mode, 2, CORRUPT)
    finally:
        pairs.close()
