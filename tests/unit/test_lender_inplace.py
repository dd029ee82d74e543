"""InPlaceLender over two CPU pools, bytes moved by the real loopback backend."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from test_lender_helpers import FULL, MLA, STATE, SWA, block_bytes, fill, link, move

from kvxfer.contract import InvalidSubmission, TokenRange, TransferMode
from kvxfer.lender import InPlaceLender, LeaseError, LenderBusy, LendingDisabled, ResumeBounds
from kvxfer.pool import Layout, PagedKVPool, PoolExhausted

MIXES = {
    "full": ([FULL], Layout.BLOCK_MAJOR),
    "full+swa": ([FULL, SWA], Layout.BLOCK_MAJOR),
    "full+state": ([FULL, STATE], Layout.BLOCK_MAJOR),
    "mla+swa+state": ([MLA, SWA, STATE], Layout.BLOCK_MAJOR),
    "layer-major full+swa": ([FULL, SWA], Layout.LAYER_MAJOR),
}


def pools(groups, layout=Layout.BLOCK_MAJOR, blocks=64):
    p = PagedKVPool(groups, blocks, layout=layout, scope=b"m")
    d = PagedKVPool(groups, blocks, layout=layout, scope=b"m")
    return p, d, InPlaceLender(p), InPlaceLender(d)


@pytest.mark.parametrize("mode", list(TransferMode), ids=lambda m: m.value)
@pytest.mark.parametrize("mix", list(MIXES))
def test_round_trip_is_byte_exact(mix: str, mode: TransferMode) -> None:
    groups, layout = MIXES[mix]
    p, d, lp, ld = pools(groups, layout)
    n = 37
    fill(p, "r", n, seed=1)
    d.allocate("r", 0)
    read = lp.lend_read("r", (0, n))
    write = ld.lend_write("r", TokenRange(0, n))
    view = write.view()
    assert view is not None and view.layout == d.identity == p.identity
    lnk = link(lp, ld, mode)
    try:
        _, out = move(lnk, read, write)
        assert out.all_delivered
    finally:
        read.release()
        write.release()
        lnk.close()
    for g in view.groups:
        group = next(s.name for s in groups if g.layer_group.startswith(s.name))
        assert block_bytes(d, "r", group, g.ordinals) == block_bytes(p, "r", group, g.ordinals)
    has_swa = any(s.window for s in groups)
    has_state = any(s.kind.name == "STATE" for s in groups)
    # a window group gets its sink block and blocks 2..4 = tokens [16, 37): p >= 16 + window;
    # a state group's state is at exactly 37
    expected_floor = n if has_state else 32 if has_swa else 0
    assert ld.readiness("r") == ResumeBounds(n, expected_floor)
    if has_state:
        assert torch.equal(d.state("r", "ssm"), p.state("r", "ssm"))
    assert lp.open_leases == ld.open_leases == 0 and d.stats()["full" if "full" in mix else "mla"]["pinned"] == 0


def test_partial_arrival_stops_resume_at_first_gap() -> None:
    p, d, lp, ld = pools([FULL])
    fill(p, "r", 40)
    d.allocate("r", 0)
    read, write = lp.lend_read("r", (0, 40)), ld.lend_write("r", (0, 40))
    lnk = link(lp, ld, TransferMode.PUSH, fail_after_rows=4)
    try:
        _, out = move(lnk, read, write)
    finally:
        read.release()
        write.release()
        lnk.close()
    assert out.masks[0].tolist() == [True] * 4 + [False] * 6
    assert ld.readiness("r") == ResumeBounds(16, 0)
    assert block_bytes(d, "r", "full", np.arange(4)) == block_bytes(p, "r", "full", np.arange(4))


def test_arrival_with_a_gap_counts_only_the_prefix() -> None:
    _, d, _, ld = pools([FULL])
    d.allocate("r", 0)
    write = ld.lend_write("r", (0, 18))  # 5 blocks, the last partial
    mask = np.array([True, True, False, True, True])
    write.mark_arrived([mask])
    write.release()
    assert ld.readiness("r") == ResumeBounds(8, 0)
    assert d.filled("r", "full").tolist() == [4, 8, 8, 16, 18]


def test_shrink_then_regrow_voids_arrived_rows() -> None:
    _, d, _, ld = pools([FULL], blocks=32)
    d.allocate("r", 0)
    write = ld.lend_write("r", (0, 40))
    old = d.block_table("r", "full")
    d.shrink("r", 10)
    d.grow("r", 40)
    new = d.block_table("r", "full")
    assert (new[:3] == old[:3]).all() and not np.isin(new[3:], old[3:]).any()  # pinned blocks not reused
    write.mark_arrived(write.view().row_masks(True))
    write.release()
    assert ld.readiness("r") == ResumeBounds(10, 0)
    assert d.stats()["full"]["free"] == 32 - 10


def test_free_during_lease_is_deferred_until_release() -> None:
    p, _, lp, _ = pools([FULL], blocks=16)
    fill(p, "r", 16)
    lease = lp.lend_read("r", (0, 16))
    p.free("r")
    assert p.stats()["full"]["free"] == 12  # four leased blocks still held
    assert lp.readiness("r") is None
    with pytest.raises(LeaseError, match="does not hold it"):
        lp.lend_read("r", (0, 4))
    lease.release()
    lease.release()  # idempotent
    assert p.stats()["full"]["free"] == 16


def test_mark_arrived_after_free_counts_nothing_and_blocks_come_back() -> None:
    _, d, _, ld = pools([FULL], blocks=16)
    d.allocate("r", 0)
    write = ld.lend_write("r", (0, 8))
    d.free("r")
    write.mark_arrived(write.view().row_masks(True))
    write.release()
    assert ld.readiness("r") is None and d.stats()["full"]["free"] == 16


def test_prefix_sharing_request_fetches_only_missing_ordinals() -> None:
    p, d, lp, ld = pools([FULL])
    ids = np.arange(500, 520)
    fill(p, "r", 20, seed=3, token_ids=ids)
    # decode already holds the first two blocks of this prefix from an earlier request
    fill(d, "old", 8, seed=3, token_ids=ids[:8], of=20)
    assert d.allocate("r", 20, ids) == 8
    write = ld.lend_write("r", (0, 20))
    assert write.view().groups[0].ordinals.tolist() == [2, 3, 4]
    read = lp.lend_read("r", (0, 20))
    lnk = link(lp, ld, TransferMode.PULL)
    try:
        out_p, out_d = move(lnk, read, write)
    finally:
        read.release()
        write.release()
        lnk.close()
    assert out_d.all_delivered and out_d.rows_delivered == 3
    assert ld.readiness("r") == ResumeBounds(20, 0)
    assert block_bytes(d, "r", "full", np.arange(5)) == block_bytes(p, "r", "full", np.arange(5))


def test_release_waits_for_tracked_attempt_to_quiesce() -> None:
    p, d, lp, ld = pools([FULL], blocks=8)
    fill(p, "r", 8)
    d.allocate("r", 0)
    read, write = lp.lend_read("r", (0, 8)), ld.lend_write("r", (0, 8))
    lnk = link(lp, ld, TransferMode.PUSH)
    # The publisher's copy waits for ``copy_may_run``: the fetch stays unquiesced meanwhile.
    copy_may_run = threading.Event()
    copy_runs = lnk.prefill._copy_runs

    def held_copy(*args, **kwargs):  # type: ignore[no-untyped-def]
        copy_may_run.wait(10)
        return copy_runs(*args, **kwargs)

    lnk.prefill._copy_runs = held_copy  # type: ignore[method-assign]
    try:
        vp, vd = read.view(), write.view()
        hd, hp = lnk.decode.describe(vd), lnk.prefill.describe(vp)
        pub, fet = lnk.prefill.publish(vp, hd), lnk.decode.fetch(vd, hp)
        write.track(fet)
        write.release()
        assert d.stats()["full"]["pinned"] == 2  # the fetch may still be written into
        with pytest.raises(LenderBusy, match="1 attempts not quiesced"):
            ld.shutdown()
        copy_may_run.set()
        assert fet.wait(5) and pub.wait(5)
        ld.readiness("r")  # any call drives deferred releases
        assert d.stats()["full"]["pinned"] == 0
    finally:
        copy_may_run.set()
        read.release()
        lnk.close()


def test_misuse_errors_are_named() -> None:
    p, d, lp, ld = pools([FULL])
    fill(p, "r", 8)
    d.allocate("w", 0)
    read = lp.lend_read("r", (0, 8))
    write = ld.lend_write("w", (0, 8))
    with pytest.raises(LeaseError, match="read lease"):
        read.mark_arrived(read.view().row_masks(True))
    with pytest.raises(InvalidSubmission, match="malformed masks"):
        write.mark_arrived([np.ones(3, dtype=bool)])
    with pytest.raises(InvalidSubmission, match="dtype bool"):
        write.mark_arrived([np.ones(2, dtype=np.int8)])
    with pytest.raises(InvalidSubmission, match="1 groups"):
        write.mark_arrived([])
    write.mark_arrived(write.view().row_masks(True))
    with pytest.raises(LeaseError, match="already called"):
        write.mark_arrived(write.view().row_masks(True))
    with pytest.raises(LeaseError, match="another lender"):
        ld.release(read)
    with pytest.raises(LeaseError, match="does not hold committed KV"):
        lp.lend_read("r", (0, 9)) if p.grow("r", 12) is None else None
    with pytest.raises(LeaseError, match="already lent for writing"):
        d.allocate("x", 0)
        ld.lend_write("x", (0, 8))
        ld.lend_write("x", (0, 8))
    with pytest.raises(LeaseError, match="never allocated"):
        ld.lend_write("nobody", (0, 4))
    with pytest.raises(LeaseError, match=r"'r' holds 12 tokens, \[0, 40\) reaches past them"):
        lp.lend_read("r", (0, 40))
    read.release()
    write.release()


def test_reuse_reset_disables_lending_with_a_clear_error() -> None:
    p, _, lp, _ = pools([FULL])
    fill(p, "r", 8)
    lease = lp.lend_read("r", (0, 8))
    p.reset_reuse(b"new-weights")
    with pytest.raises(LendingDisabled, match="reset its reuse scope"):
        lp.lend_read("r", (0, 8))
    lease.release()  # open leases still end normally
    assert lp.shutdown().retained_anything is False
    with pytest.raises(LendingDisabled, match="reset its reuse scope"):  # for that pool, for good
        InPlaceLender(p).lend_read("r", (0, 8))


def test_shutdown_refuses_with_open_leases_and_force_retains() -> None:
    p, _, lp, _ = pools([FULL], blocks=8)
    fill(p, "r", 8)
    lease = lp.lend_read("r", (0, 8))
    with pytest.raises(LenderBusy, match="1 leases open"):
        lp.shutdown()
    report = lp.shutdown(force=True)
    assert report.open_leases == 1
    assert report.retained_blocks["full"].tolist() == sorted(p.block_table("r", "full").tolist())
    p.free("r")
    lease.release()  # the lender forgot it; memory stays retained
    assert p.stats()["full"]["retained"] == 2 and p.stats()["full"]["free"] == 6
    with pytest.raises(LendingDisabled, match="shut down"):
        lp.lend_read("r", (0, 8))


def test_prefix_naming_waits_for_write_lease_release() -> None:
    _, d, _, ld = pools([FULL])
    ids = np.arange(8)
    d.allocate("r", 0)
    write = ld.lend_write("r", (0, 8))
    write.mark_arrived(write.view().row_masks(True))
    d.commit("r", 8, ids)  # the engine names the blocks while the lease is still open
    assert d.allocate("probe", 8, ids) == 0  # a late write could still land: not shareable yet
    d.free("probe")
    write.release()
    assert d.allocate("again", 8, ids) == 8


def test_eviction_skips_blocks_a_read_lease_pins() -> None:
    p, _, lp, _ = pools([FULL], blocks=4)
    fill(p, "r", 8, token_ids=np.arange(8))
    lease = lp.lend_read("r", (0, 8))
    p.free("r")  # named blocks, but pinned: neither cached nor free
    assert p.stats()["full"]["cached"] == 0 and p.stats()["full"]["free"] == 2
    with pytest.raises(PoolExhausted, match="needs 4 new blocks"):
        p.allocate("big", 16)
    lease.release()
    assert p.stats()["full"]["cached"] == 2
    assert p.allocate("again", 8, np.arange(8)) == 8  # the prefix survived until reuse


def test_arrival_for_a_freed_then_reallocated_name_counts_nothing() -> None:
    _, d, _, ld = pools([FULL, STATE], blocks=16)
    d.allocate("r", 0)
    write = ld.lend_write("r", (0, 8))
    d.free("r")
    d.allocate("r", 8)  # same name, new blocks (the leased ones are still pinned)
    write.mark_arrived(write.view().row_masks(True))
    write.release()
    assert ld.readiness("r") == ResumeBounds(0, 0)
    assert d.filled("r", "ssm").tolist() == [-1]


def test_forced_shutdown_keeps_retained_blocks_out_of_prefix_reuse() -> None:
    p, d, lp, ld = pools([FULL], blocks=16)
    ids = np.arange(8)
    # a read lease over named blocks, and a write lease whose naming was deferred
    fill(p, "r", 8, token_ids=ids)
    read = lp.lend_read("r", (0, 8))
    d.allocate("r", 0)
    write = ld.lend_write("r", (0, 8))
    write.mark_arrived(write.view().row_masks(True))
    d.commit("r", 8, ids)
    lp.shutdown(force=True)
    ld.shutdown(force=True)
    p.free("r")
    read.release()
    write.release()  # the deferred names would apply here
    # an attempt may still touch retained blocks: no request may be handed them again
    assert p.allocate("probe", 8, ids) == 0 and d.allocate("probe", 8, ids) == 0
    for pool in (p, d):
        assert not pool.allocator("full").retained[pool.block_table("probe", "full")].any()
    assert p.stats()["full"]["retained"] == d.stats()["full"]["retained"] == 2


def test_release_of_something_that_is_not_a_lease_says_so() -> None:
    _, _, lp, _ = pools([FULL])
    with pytest.raises(LeaseError, match="release takes a Lease, got str"):
        lp.release("r")  # type: ignore[arg-type]


def test_lend_write_into_a_named_block_once_exclusive_unnames_it() -> None:
    pool, _, lender, _ = pools([FULL], blocks=8)
    ids = np.arange(100, 112)
    pool.allocate("a", 8)
    pool.commit("a", 8, ids)
    pool.allocate("b", 8, ids)
    pool.shrink("b", 6)
    pool.commit("a", 8, ids)
    pool.free("a")
    lease = lender.lend_write("b", (0, 8))  # block 1 is lent: the peer rewrites it
    assert lease.view().groups[0].ordinals.tolist() == [1]
    lease.release()
    assert pool.allocate("c", 8, ids) == 4
