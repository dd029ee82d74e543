"""StagingLender on CPU: capacity arithmetic, FIFO runs, copies, quarantine, round trips."""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest
import torch
from test_lender_helpers import FULL, STATE, SWA, block_bytes, fill, link, move

from kvxfer.contract import MemoryKind, TransferMode
from kvxfer.lender import (
    InPlaceLender,
    LeaseError,
    LenderBusy,
    LendingDisabled,
    ResumeBounds,
    StagingLender,
    rows_per_fetch,
)
from kvxfer.pool import Layout, PagedKVPool


def pool(groups=(FULL,), blocks=64, layout=Layout.BLOCK_MAJOR) -> PagedKVPool:
    return PagedKVPool(list(groups), blocks, layout=layout, scope=b"m")


def test_capacity_arithmetic() -> None:
    p = pool((FULL, SWA, STATE))
    # 20 tokens at any offset touch up to 6 blocks of 4; the window group needs at most
    # its sink + the 16-token window (3 blocks of 8), capped by 1 + ceil(19 / 8) = 4; state 1.
    assert [rows_per_fetch(g, 20) for g in (FULL, SWA, STATE)] == [6, 4, 1]
    per_fetch = 6 * FULL.row_bytes + 4 * SWA.row_bytes + STATE.row_bytes
    lender = StagingLender(p, fetch_tokens=20, max_fetches=3, max_bytes=int(2.5 * per_fetch))
    stats = lender.stats()
    assert stats.fetches == 2
    assert {n: s.capacity for n, s in stats.regions.items()} == {"full": 12, "swa": 8, "ssm": 2}
    assert all(r.memory_kind is MemoryKind.HOST for r in lender.regions)
    assert sum(r.nbytes for r in lender.regions) == 2 * per_fetch
    assert StagingLender(pool((FULL,)), 20, 3, 10**9).stats().fetches == 3
    with pytest.raises(ValueError, match="fetch_tokens, max_fetches and max_bytes must be positive ints, got 1.5"):
        StagingLender(pool((FULL,)), 1.5, 3, 10**9)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=f"needs {per_fetch} staging bytes"):
        StagingLender(pool((FULL, SWA, STATE)), 20, 3, per_fetch - 1)
    # an unaligned lease of fetch_tokens tokens fits; a longer one is refused
    p2 = pool((FULL,))
    lender2 = StagingLender(p2, 20, 1, 1 << 20)
    fill(p2, "r", 24)
    lease = lender2.lend_read("r", (3, 23))
    assert lease.view() is not None and len(lease.view().groups[0]) == 6
    lease.release()
    p2.allocate("w", 0)
    with pytest.raises(LeaseError, match="staging holds 6"):
        lender2.lend_write("w", (0, 64))
    assert p2.stats()["full"]["pinned"] == 0  # the refused lease pinned nothing


@pytest.mark.parametrize("mode", list(TransferMode), ids=lambda m: m.value)
@pytest.mark.parametrize("sides", ["staging-staging", "inplace-staging", "staging-inplace", "layer-major"])
def test_round_trip_through_staging_is_byte_exact(sides: str, mode: TransferMode) -> None:
    layout = Layout.LAYER_MAJOR if sides == "layer-major" else Layout.BLOCK_MAJOR
    groups = (FULL, SWA, STATE)
    p, d = pool(groups, layout=layout), pool(groups, layout=layout)
    lp = InPlaceLender(p) if sides == "inplace-staging" else StagingLender(p, 40, 2, 1 << 24)
    ld = InPlaceLender(d) if sides == "staging-inplace" else StagingLender(d, 40, 2, 1 << 24)
    fill(p, "r", 37, seed=5)
    d.allocate("r", 0)
    read, write = lp.lend_read("r", (0, 37)), ld.lend_write("r", (0, 37))
    lnk = link(lp, ld, mode)
    try:
        _, out = move(lnk, read, write)
        assert out.all_delivered
    finally:
        read.release()
        write.release()
        lnk.close()
    for g in (FULL, SWA):
        ordinals = np.array([0, 2, 3, 4]) if g is SWA else np.arange(10)
        assert block_bytes(d, "r", g.name, ordinals) == block_bytes(p, "r", g.name, ordinals)
    assert torch.equal(d.state("r", "ssm"), p.state("r", "ssm"))
    assert ld.readiness("r") == ResumeBounds(37, 37)
    for lender in (lp, ld):
        if isinstance(lender, StagingLender):
            assert all(s.free == s.capacity for s in lender.stats().regions.values())


def test_mark_arrived_copies_only_marked_rows() -> None:
    d = pool()
    lender = StagingLender(d, 32, 1, 1 << 20)
    d.allocate("r", 0)
    write = lender.lend_write("r", (0, 16))
    view = write.view()
    staging = lender._buffers["full"]
    staging[: len(view.groups[0])] = 7  # as if the peer wrote every slot
    write.mark_arrived([np.array([True, False, True, False])])
    write.release()
    table = d.block_table("r", "full")
    rows = d.storage("full")
    assert bool((rows[table[[0, 2]]] == 7).all()) and int(torch.count_nonzero(rows[table[[1, 3]]])) == 0
    assert lender.readiness("r") == ResumeBounds(4, 0)


def test_fifo_grant_in_contiguous_runs_and_cancellation() -> None:
    p = pool()
    fill(p, "r", 64)
    lender = StagingLender(p, fetch_tokens=21, max_fetches=2, max_bytes=1 << 20)  # 6 rows a fetch, 12 slots
    a = lender.lend_read("r", (2, 22))  # 6 rows: slots 0..5
    a2 = lender.lend_read("r", (0, 16))  # 4 rows: slots 6..9
    b = lender.lend_read("r", (0, 24))  # 6 rows: only 2 free -> waits
    c = lender.lend_read("r", (0, 4))  # 1 row: would fit, but b is first
    assert a.view().groups[0].slots.tolist() == list(range(6))
    assert a2.view().groups[0].slots.tolist() == [6, 7, 8, 9]
    assert b.view() is None and c.view() is None and lender.stats().waiting == 2
    b.release()  # cancelled while waiting: stops blocking
    assert c.view() is not None and c.view().groups[0].slots.tolist() == [10]
    a.release()
    d = lender.lend_read("r", (0, 24))
    assert d.view().groups[0].slots.tolist() == list(range(6))
    e = lender.lend_read("r", (0, 8))  # 2 rows: free are 11 only (run of 1) -> waits
    assert e.view() is None
    a2.release()
    assert e.view().groups[0].slots.tolist() == [6, 7]
    for lease in (c, d, e):
        lease.release()
    assert lender.stats().regions["full"].free == 12
    # bytes in the slots are the pool's pages
    f = lender.lend_read("r", (0, 8))
    rows = lender._buffers["full"][torch.from_numpy(f.view().groups[0].slots.copy())]
    assert torch.equal(rows, p.storage("full")[p.block_table_tensor("r", "full")[:2]])
    f.release()


def test_failed_copy_slots_come_back_once_the_copy_has_surely_ended() -> None:
    # On the host a copy runs on the calling thread: one that raised has stopped, so its
    # slots return at the lender's next call, and the next lease may be granted them.
    p = pool()
    fill(p, "r", 16)
    lender = StagingLender(p, 16, 2, 1 << 20)  # 5 rows a fetch, 10 slots
    lender.inject_copy_faults(1)
    bad = lender.lend_read("r", (0, 16))
    assert bad.view() is None and "injected staging copy fault" in (bad.failure or "")
    stats = lender.stats()
    assert (stats.regions["full"].quarantined, stats.regions["full"].free, stats.reclaimed) == (0, 6, 4)
    bad.release()
    assert lender.stats().regions["full"].free == 10 and p.stats()["full"]["pinned"] == 0
    good = lender.lend_read("r", (0, 16))
    assert good.view() is not None and good.view().groups[0].slots.tolist() == [0, 1, 2, 3]
    good.release()
    assert lender.stats().regions["full"].free == 10


def test_failed_copy_of_unknown_end_quarantines_slots_for_good() -> None:
    p = pool()
    fill(p, "r", 16)
    lender = StagingLender(p, 16, 2, 1 << 20)  # 5 rows a fetch, 10 slots
    lender.inject_copy_faults(1, end_unknown=True)
    bad = lender.lend_read("r", (0, 16))
    assert bad.view() is None and "injected staging copy fault" in (bad.failure or "")
    bad.release()
    stats = lender.stats().regions["full"]
    assert (stats.quarantined, stats.free) == (4, 6)
    assert p.stats()["full"]["pinned"] == 0  # CPU copies are synchronous: the pages are safe
    good = lender.lend_read("r", (0, 16))
    assert good.view() is not None and good.view().groups[0].slots.tolist() == [4, 5, 6, 7]
    good.release()
    assert lender.stats().regions["full"].free == 6  # never comes back


def test_failed_arrival_copy_counts_nothing() -> None:
    d = pool()
    lender = StagingLender(d, 16, 1, 1 << 20)
    d.allocate("r", 0)
    write = lender.lend_write("r", (0, 16))
    lender.inject_copy_faults(1)
    write.mark_arrived(write.view().row_masks(True))
    assert write.failure is not None and "to device failed" in write.failure
    write.release()
    assert lender.readiness("r") == ResumeBounds(0, 0)
    assert lender.stats().regions["full"].quarantined == 0 and lender.stats().reclaimed == 4  # the copy ended


def test_forced_shutdown_retains_staging_and_pages() -> None:
    p = pool(blocks=8)
    fill(p, "r", 8)
    lender = StagingLender(p, 8, 1, 1 << 20)
    lease = lender.lend_read("r", (0, 8))
    waiting = lender.lend_read("r", (0, 8))
    assert waiting.view() is None
    with pytest.raises(LenderBusy):
        lender.shutdown()
    report = lender.shutdown(force=True)
    assert report.open_leases == 2 and report.retained_staging["full"].tolist() == [0, 1]
    assert report.retained_blocks["full"].tolist() == sorted(p.block_table("r", "full").tolist())
    assert lender.stats().regions["full"].quarantined == 2 and lender.stats().waiting == 0
    lease.release()


def test_quarantined_staging_memory_outlives_the_lender() -> None:
    p = pool()
    fill(p, "r", 16)
    lender = StagingLender(p, 16, 1, 1 << 20)
    lender.inject_copy_faults(1, end_unknown=True)
    bad = lender.lend_read("r", (0, 16))
    bad.release()
    assert lender.stats().regions["full"].quarantined == 4
    buffer = weakref.ref(lender._buffers["full"])
    assert lender.shutdown().retained_anything is False  # no lease was open
    del lender, bad
    gc.collect()
    # a copy of unknown completion may still land in those slots: the memory is never freed
    assert buffer() is not None


def test_mark_arrived_after_forced_shutdown_is_refused_by_name() -> None:
    d = pool()
    lender = StagingLender(d, 16, 1, 1 << 20)
    d.allocate("r", 0)
    write = lender.lend_write("r", (0, 16))
    assert write.view() is not None
    lender.shutdown(force=True)  # the slots are quarantined: nothing may be copied out of them
    with pytest.raises(LendingDisabled, match="shut down"):
        write.mark_arrived(write.view().row_masks(True))
    assert lender.readiness("r") == ResumeBounds(0, 0)
    write.release()


def test_a_lease_that_can_no_longer_fit_fails_instead_of_holding_up_the_queue() -> None:
    # 5 slots. A write lease holds 4; a 2-row read waits (strict FIFO), a 1-row read behind it.
    # The write lease's arrival copy fails, its end unknown: its 4 slots are quarantined for good, so the
    # 2-row read can never be granted. It fails by name, and the 1-row read behind it is
    # granted the last slot; a new 2-row lease is refused at once.
    p = pool()
    fill(p, "r", 16)
    p.allocate("w", 0)
    lender = StagingLender(p, 16, 1, 1 << 20)  # 5 rows a fetch, 5 slots
    write = lender.lend_write("w", (0, 16))
    two = lender.lend_read("r", (0, 8))
    one = lender.lend_read("r", (12, 16))
    assert write.view() is not None and two.view() is None and one.view() is None
    lender.inject_copy_faults(1, end_unknown=True)
    write.mark_arrived(write.view().row_masks(True))
    assert write.failure is not None
    write.release()
    assert two.view() is None and "longest run of staging slots left is 1" in (two.failure or "")
    assert one.view() is not None and one.view().groups[0].slots.tolist() == [4]
    with pytest.raises(LeaseError, match="longest run of staging slots left is 1"):
        lender.lend_read("r", (0, 8))
    two.release()
    one.release()
    assert lender.stats().waiting == 0 and p.stats()["full"]["pinned"] == 0


def test_forced_shutdown_under_a_copy_in_flight_leaves_later_calls_working() -> None:
    # On a GPU a read lease's copy may still run when shutdown(force=True) retains its slots
    # and pages; here an event that completes later stands for it. Once it completes, the
    # lender's next calls (view, readiness, release) must not trip over the retained lease.
    from kvxfer.lender.staging import _Copy

    class LateEvent:
        done = False

        def query(self) -> bool:
            return self.done

    p = pool()
    fill(p, "r", 16)
    lender = StagingLender(p, 16, 2, 1 << 20)
    lease = lender.lend_read("r", (0, 16))
    lease._view = None
    event = LateEvent()
    lender._copies[lease.id] = _Copy(lease, event)
    report = lender.shutdown(force=True)
    assert report.open_leases == 1 and report.retained_staging["full"].size == 4
    event.done = True
    assert lease.view() is None
    lender.readiness("r")
    lease.release()
    assert lender.stats().regions["full"].quarantined == 4
