"""Chunks of NIXL descriptors: coalesced runs, bounded chunks, exact row accounting."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvxfer.backends.common.matching import match_rows
from kvxfer.backends.common.transfers import hint_groups
from kvxfer.backends.nixl.plan import ChunkBytes, count_descriptors, plan_chunks
from kvxfer.contract import CacheKind, Hint, LayerGroupRows, MemoryKind, SlotRegion, TokenRange, TransferMode, View

A = SlotRegion("A", 1 << 20, 1024, 64, MemoryKind.HOST)
B = SlotRegion("B", 1 << 30, 1024, 64, MemoryKind.HOST, device_id=0)
PB = SlotRegion("PB", 1 << 32, 1024, 64, MemoryKind.DEVICE, device_id=3)


def _view(region: SlotRegion, slots: list[int], ordinals: list[int], name: str = "g") -> View:
    return View("r", TokenRange(0, 1024), (LayerGroupRows(name, CacheKind.PAGED, region, slots, ordinals),), b"L")


def _hint(view: View) -> Hint:
    return Hint("nixl", TransferMode.PUSH, "peer", "r", "t", b"L", hint_groups(view))


def test_runs_contiguous_on_both_ends_become_one_descriptor() -> None:
    local = _view(A, [4, 5, 6, 9, 10, 20], [0, 1, 2, 3, 4, 5])
    peer = _view(PB, [30, 31, 32, 33, 40, 41], [0, 1, 2, 3, 4, 5])
    (chunk,) = plan_chunks(match_rows(local, _hint(peer)), _hint(peer), chunk_bytes=1 << 20)
    # runs: [4-6]->[30-32], [9]->[33], [10]->[40], [20]->[41]
    assert chunk.local_descs[:, 0].tolist() == [A.address + s * 1024 for s in (4, 9, 10, 20)]
    assert chunk.remote_descs[:, 0].tolist() == [PB.address + s * 1024 for s in (30, 33, 40, 41)]
    assert chunk.local_descs[:, 1].tolist() == [3072, 1024, 1024, 1024] == chunk.remote_descs[:, 1].tolist()
    assert set(chunk.local_descs[:, 2].tolist()) == {0} and set(chunk.remote_descs[:, 2].tolist()) == {3}
    assert (chunk.local_kind, chunk.remote_kind) == (MemoryKind.HOST, MemoryKind.DEVICE)
    assert chunk.local_rows.tolist() == list(range(6)) and chunk.nbytes == 6 * 1024


def test_without_coalescing_each_row_is_a_descriptor() -> None:
    local = _view(A, list(range(8)), list(range(8)))
    peer = _view(PB, list(range(8)), list(range(8)))
    (chunk,) = plan_chunks(match_rows(local, _hint(peer)), _hint(peer), chunk_bytes=1 << 20, coalesce_runs=False)
    assert chunk.local_descs.shape == (8, 3) and set(chunk.local_descs[:, 1].tolist()) == {1024}


def test_chunks_bound_bytes_and_cover_matched_rows_in_order() -> None:
    rng = np.random.default_rng(0)
    local = _view(A, rng.permutation(64)[:50].tolist(), list(range(50)))
    peer_ordinals = [o for o in range(50) if o % 7]  # some rows have no counterpart
    peer = _view(PB, rng.permutation(64)[: len(peer_ordinals)].tolist(), peer_ordinals)
    chunks = plan_chunks(match_rows(local, _hint(peer)), _hint(peer), chunk_bytes=3 * 1024 + 5)
    assert all(c.rows <= 3 and c.nbytes <= 3 * 1024 for c in chunks)
    rows = np.concatenate([c.local_rows for c in chunks])
    assert rows.tolist() == [o for o in range(50) if o % 7]
    peer_rows = np.concatenate([c.peer_rows for c in chunks])
    assert peer.groups[0].ordinals[peer_rows].tolist() == local.groups[0].ordinals[rows].tolist()


def test_chunk_size_follows_the_memory_at_both_ends() -> None:
    """Device to device: ChunkBytes.device; host at either end: ChunkBytes.host."""
    sizes = ChunkBytes(host=4 * 1024, device=16 * 1024)
    ld = SlotRegion("LD", 1 << 34, 1024, 64, MemoryKind.DEVICE, device_id=0)
    rows = list(range(40))
    device_chunks = plan_chunks(match_rows(_view(ld, rows, rows), _hint(_view(PB, rows, rows))),
                                _hint(_view(PB, rows, rows)), chunk_bytes=sizes)
    assert [c.rows for c in device_chunks] == [16, 16, 8]
    assert all(c.local_descs.shape == (1, 3) for c in device_chunks)  # each chunk one coalesced run
    host_chunks = plan_chunks(match_rows(_view(A, rows, rows), _hint(_view(PB, rows, rows))),
                              _hint(_view(PB, rows, rows)), chunk_bytes=sizes)
    assert [c.rows for c in host_chunks] == [4] * 10
    assert ChunkBytes.uniform(123) == ChunkBytes(123, 123)
    assert ChunkBytes() == ChunkBytes(16 << 20, 256 << 20)
    with pytest.raises(ValueError, match="device 0"):
        ChunkBytes(device=0)
    assert ChunkBytes.of(None) == ChunkBytes()
    assert ChunkBytes.of(sizes) is sizes
    assert ChunkBytes.of(123) == ChunkBytes(123, 123)
    with pytest.raises(ValueError, match="chunk_bytes must be positive, got -5"):
        ChunkBytes.of(-5)
    with pytest.raises(TypeError, match="chunk_bytes must be an int, a ChunkBytes or None, got '16M'"):
        ChunkBytes.of("16M")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="got True"):
        ChunkBytes.of(True)


def test_row_limit_takes_exactly_the_first_rows_across_groups() -> None:
    local = View("r", TokenRange(0, 99), (
        LayerGroupRows("g0", CacheKind.PAGED, A, list(range(5)), list(range(5))),
        LayerGroupRows("g1", CacheKind.PAGED, B, list(range(10, 16)), list(range(6))),
    ), b"L")
    hint = _hint(local)
    chunks = plan_chunks(match_rows(local, hint), hint, chunk_bytes=2 * 1024, row_limit=7)
    assert [(c.group, c.rows) for c in chunks] == [(0, 2), (0, 2), (0, 1), (1, 2)]
    assert plan_chunks(match_rows(local, hint), hint, chunk_bytes=1 << 20, row_limit=0) == []



def _slots(rng: np.random.Generator, n: int) -> list[int]:
    """n distinct slots of 64, ascending: dense picks make long runs, sparse ones many breaks."""
    return np.sort(rng.choice(64, size=n, replace=False)).tolist()


@settings(max_examples=200, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), rows=st.integers(0, 60), per_chunk=st.integers(1, 9),
       limit=st.none() | st.integers(0, 70), coalesce=st.booleans())
def test_counting_descriptors_agrees_with_planning_them(seed: int, rows: int, per_chunk: int, limit: int | None,
                                                         coalesce: bool) -> None:
    """The packed path decides on counts alone; they must be the plan's, runs and chunk edges included."""
    rng = np.random.default_rng(seed)
    kept = [o for o in range(rows) if o % 5 != 3]  # rows the peer lacks leave gaps in the match
    local = View("r", TokenRange(0, 1024), (
        LayerGroupRows("g0", CacheKind.PAGED, A, _slots(rng, rows), list(range(rows))),
        LayerGroupRows("g1", CacheKind.PAGED, B, _slots(rng, rows // 2), list(range(rows // 2))),
    ), b"L")
    peer = View("r", TokenRange(0, 1024), (
        LayerGroupRows("g0", CacheKind.PAGED, PB, _slots(rng, len(kept)), kept),
        LayerGroupRows("g1", CacheKind.PAGED, A, _slots(rng, rows // 2), list(range(rows // 2))),
    ), b"L")
    matches = match_rows(local, _hint(peer))
    chunk_bytes = per_chunk * 1024
    chunks = plan_chunks(matches, _hint(peer), chunk_bytes=chunk_bytes, row_limit=limit, coalesce_runs=coalesce)
    assert count_descriptors(matches, chunk_bytes=chunk_bytes, row_limit=limit, coalesce_runs=coalesce) == (
        sum(len(c.local_descs) for c in chunks), len(chunks))


def test_job_masks_are_exact_and_a_whole_group_is_the_shared_true_mask() -> None:
    """ActiveJob.masks(): the rows of proven chunks on both ends, read-only; a group whose
    every row is proven is the shared all-True mask (what the wire codec sends by identity)."""
    from kvxfer.backends.common.attempt import TrackedAttempt
    from kvxfer.backends.nixl.jobs import ActiveJob, conclusion
    from kvxfer.contract import Delivered, Failed, constant_mask

    local = _view(A, list(range(10)), list(range(10)))
    peer = _view(PB, list(range(20, 30)), list(range(10)))
    chunks = plan_chunks(match_rows(local, _hint(peer)), _hint(peer), chunk_bytes=4 * 1024)
    assert [c.rows for c in chunks] == [4, 4, 2]
    job = ActiveJob(TrackedAttempt(None, lambda a: None, "t"), local, _hint(peer), "WRITE", chunks, deadline=1e18)
    job.done = [0, 2]
    mine, theirs = job.masks()
    expected = [True] * 4 + [False] * 4 + [True] * 2
    assert mine[0].tolist() == expected == theirs[0].tolist()
    assert not mine[0].flags.writeable and not theirs[0].flags.writeable
    job.failure = "stopped"
    status, outcome, _ = conclusion(job, mine)
    assert isinstance(outcome, Failed) and outcome.masks[0].tolist() == expected
    job.failure = None
    job.done = [2, 0, 1, 0]  # in any order, and once each however often listed
    mine, theirs = job.masks()
    assert mine[0] is constant_mask(10, True) and theirs[0] is constant_mask(10, True)
    assert isinstance(conclusion(job)[1], Delivered)
