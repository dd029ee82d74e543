"""ExternalLender keeps the pool lender's rules over an engine's own KV: the engine's frees go
through the lender (busy blocks refused by name, or deferred and handed back once safe), a
reset stops lending, prefix-shared blocks are not lent for writing, masks are bool only,
and one lender per memory (the pool's too). The kit's shared checks are in
test_lender_conformance.py; these are the engine's own calls."""

from __future__ import annotations

import gc
import threading
import weakref

import numpy as np
import pytest
import torch

from kvxfer.backends.common.attempt import TrackedAttempt
from kvxfer.contract import BlockOrder, Delivered, HeadOrder, InvalidSubmission
from kvxfer.lender import (
    AlreadyLent,
    BlocksBusy,
    EngineKV,
    ExternalLender,
    InPlaceLender,
    LeaseError,
    LendingDisabled,
    claims,
)
from kvxfer.pool import LayerGroupSpec, PagedKVPool

BT, BLOCKS = 4, 16


def engine_kv(name: str = "engine") -> EngineKV:
    tensors = [torch.zeros(2, BLOCKS, BT, 2, 8) for _ in range(2)]
    return EngineKV.per_layer(tensors, kv_heads=2, name=name)


def ended(attempt: TrackedAttempt, rows: int) -> None:
    attempt.conclude(Delivered((np.ones(rows, dtype=np.bool_),)))
    attempt.mark_quiesced()


def test_freeing_busy_blocks_is_refused_by_name_or_deferred_until_they_quiesce() -> None:
    lender = ExternalLender(engine_kv())
    table = np.array([7, 3, 9])
    lease = lender.lend_write("r", table, (0, 3 * BT))
    attempt = TrackedAttempt(label="fetch")
    lease.track(attempt)
    lease.release()
    with pytest.raises(BlocksBusy, match=r"blocks \[7, 3, 9\] are busy") as caught:
        lender.free(table)
    assert caught.value.blocks.tolist() == [7, 3, 9]
    assert lender.busy(table).all()  # nothing was recorded: still the attempt's
    with pytest.raises(BlocksBusy, match=r"blocks \[3\] are busy") as caught:
        lender.free([1, 3])  # one busy block refuses the whole call
    assert caught.value.blocks.tolist() == [3] and not lender.busy([1]).any()
    assert lender.free([1, 7, 3, 9, 2], defer=True).tolist() == [1, 2]  # the rest are held back
    assert lender.reclaim().size == 0 and lender.busy(table).all()
    ended(attempt, 3)
    assert sorted(lender.reclaim().tolist()) == [3, 7, 9]
    assert lender.reclaim().size == 0  # handed back once
    assert not lender.busy(table).any()
    assert lender.free(table).tolist() == [7, 3, 9]  # nothing busy: all may be reused now


def test_blocks_handed_to_the_lender_cannot_be_lent_or_freed_again_until_they_come_back() -> None:
    lender = ExternalLender(engine_kv())
    lease = lender.lend_read("r", [4, 5], (0, 2 * BT))
    assert lender.free([4, 5], defer=True).size == 0
    with pytest.raises(LeaseError, match=r"blocks \[4, 5\] were freed by the engine"):
        lender.lend_write("s", [4, 5, 6], (0, 3 * BT))
    with pytest.raises(BlocksBusy, match=r"\[5\] were freed already"):
        lender.free([5])
    lease.release()  # no attempt: safe at once
    assert lender.reclaim().tolist() == [4, 5]
    lender.lend_write("s", [4, 5, 6], (0, 3 * BT)).release()


def test_an_open_lease_whose_blocks_the_engine_freed_counts_no_arrival() -> None:
    lender = ExternalLender(engine_kv())
    lease = lender.lend_write("r", [2, 3], (0, 2 * BT))
    assert lender.free([3], defer=True).size == 0
    lease.mark_arrived([np.ones(2, dtype=np.bool_)])
    assert lease.usable_until == 0
    assert lender.reclaim().size == 0  # the lease is still open
    lease.release()
    assert lender.reclaim().tolist() == [3]


def test_reset_stops_lending_and_holds_back_what_is_busy() -> None:
    lender = ExternalLender(engine_kv())
    write = lender.lend_write("r", [1, 2], (0, 2 * BT))
    attempt = TrackedAttempt(label="fetch")
    write.track(attempt)
    read = lender.lend_read("q", [6], (0, BT))
    assert lender.reset().tolist() == [1, 2, 6]
    with pytest.raises(LendingDisabled, match="reset its KV"):
        lender.lend_read("q", [6], (0, BT))
    write.mark_arrived([np.ones(2, dtype=np.bool_)])
    assert write.usable_until == 0  # the bytes that arrived mean the old KV
    read.release()
    write.release()
    assert lender.reclaim().tolist() == [6]
    ended(attempt, 2)
    assert lender.reclaim().tolist() == [1, 2]
    assert not lender.shutdown().retained_anything


def test_blocks_shared_by_prefix_are_refused_for_writing_unless_the_engine_allows_it() -> None:
    lender = ExternalLender(engine_kv())
    table = np.array([5, 8, 11])
    with pytest.raises(LeaseError, match=r"blocks \[5, 8\] are shared by prefix"):
        lender.lend_write("r", table, (0, 3 * BT), shared=[5, 8, 12])
    with pytest.raises(LeaseError, match=r"blocks \[5\] are shared by prefix"):
        lender.lend_write("r", table, (0, 3 * BT), shared=np.array([True, False, False]))
    assert lender.open_leases == 0 and not lender.busy(table).any()  # the refusals touched nothing
    with pytest.raises(LeaseError, match="shared mask has shape"):
        lender.lend_write("r", table, (0, 3 * BT), shared=np.array([True, False]))
    with pytest.raises(LeaseError, match="dtype float64"):
        lender.lend_write("r", table, (0, 3 * BT), shared=np.array([5.0]))
    # Only the blocks lent count: [BT, 3 BT) leaves the shared block 5 alone.
    tail = lender.lend_write("r", table, (BT, 3 * BT), shared=[5])
    assert tail.view().groups[0].slots.tolist() == [8, 11]
    tail.release()
    allowed = lender.lend_write("r", table, (0, 3 * BT), shared=[5], allow_shared=True)
    allowed.release()
    lender.lend_read("r", table, (0, 3 * BT), ).release()  # reading shared blocks is fine


def test_masks_are_refused_as_the_pool_lender_refuses_them() -> None:
    spec = LayerGroupSpec("full", layers=1, block_tokens=BT, kv_heads=2, head_dim=8)
    pool = PagedKVPool([spec], BLOCKS, scope=b"s")
    pool.allocate("r", 0)
    pool_lease = InPlaceLender(pool).lend_write("r", (0, 3 * BT))
    lease = ExternalLender(engine_kv()).lend_write("r", [0, 1, 2], (0, 3 * BT))
    for bad in ([1, 1, 0], np.array([1, 1, 0]), np.array([1.0, 1.0, 0.0]), [True, True, False]):
        texts = []
        for each in (pool_lease, lease):
            with pytest.raises(InvalidSubmission) as caught:
                each.mark_arrived([bad])
            assert isinstance(caught.value.__cause__, TypeError)
            texts.append(str(caught.value).removeprefix(f"{each!r}: "))
        assert texts[0] == texts[1], texts
    lease.mark_arrived([np.array([True, True, False])])
    assert lease.usable_until == 2 * BT


def test_one_lender_per_memory_whatever_lends_it() -> None:
    kv = engine_kv("first")
    lender = ExternalLender(kv)
    again = EngineKV.per_layer([t for t in kv.tensors], kv_heads=2, heads=(0, 2), name="again")
    with pytest.raises(AlreadyLent, match=r"engine KV again/0, again/1 is lent already by <ExternalLender of "
                                          r"engine KV first/0, first/1>"):
        ExternalLender(again)
    ExternalLender(engine_kv("other")).shutdown()  # other tensors: a lender of their own
    # A peer's KV (no tensors here) is another process's memory, even at the same addresses.
    ExternalLender(EngineKV(kv.geometry, kv.layout, ())).shutdown()
    lender.shutdown()
    ExternalLender(again).shutdown()
    # A pool and an engine's view of that pool are one memory.
    spec = LayerGroupSpec("full", layers=1, block_tokens=BT, kv_heads=2, head_dim=8)
    pool = PagedKVPool([spec], BLOCKS, scope=b"s", name="shared-pool")
    pooled = InPlaceLender(pool)
    with pytest.raises(AlreadyLent, match="pool 'shared-pool'"):
        ExternalLender(EngineKV.from_pool(pool))
    with pytest.raises(AlreadyLent, match="pool 'shared-pool' is lent already"):
        InPlaceLender(pool)
    pooled.shutdown()
    ExternalLender(EngineKV.from_pool(pool)).shutdown()


def test_layer_groups_over_one_memory_lend_their_own_blocks_under_one_claim() -> None:
    """A hybrid cache: two groups of one tensor, each with its own block size and block ids."""
    memory = torch.zeros(BLOCKS * 2 * 2 * BT * 2 * 8)
    rows = memory.view(-1, 2, 8)
    full = [rows.as_strided((BLOCKS, BT, 2, 8), (2 * 2 * BT * 16, 16, 8, 1), (2 * i + v) * BT * 16)
            for i in range(2) for v in range(2)]  # 2 layers: blocks of 2 * 2 * BT rows
    ring = [rows.as_strided((2 * BLOCKS, BT, 2, 8), (2 * BT * 16, 16, 8, 1), v * BT * 16)
            for v in range(2)]  # 1 layer: blocks half the size, twice as many
    kvs = {"full": EngineKV.from_planes(full[0::2], full[1::2], tensors=(memory,), kv_heads=2, heads=None,
                                        head_order=HeadOrder.NHD, order=BlockOrder.BLOCK_MAJOR, name="hybrid"),
           "ring": EngineKV.from_planes(ring[:1], ring[1:], tensors=(memory,), kv_heads=2, heads=None,
                                        head_order=HeadOrder.NHD, order=BlockOrder.BLOCK_MAJOR, name="hybrid")}
    lenders = ExternalLender.for_groups(kvs)
    assert lenders["full"].regions == lenders["ring"].regions  # one memory, registered once
    with pytest.raises(AlreadyLent, match=r"lent already by <ExternalLenders of engine KV hybrid/0 \(groups full, "
                                          r"ring\)>"):
        ExternalLender(kvs["ring"])
    full_lease = lenders["full"].lend_write("r/full", [3, 5], (0, 2 * BT))
    ring_lease = lenders["ring"].lend_write("r/ring", [3], (0, BT))  # block 3 of the ring: other bytes
    assert full_lease.view().groups[0].layer_group == "full" and ring_lease.view().groups[0].layer_group == "ring"
    assert ring_lease.view().geometry.block_bytes == full_lease.view().geometry.block_bytes // 2
    assert lenders["full"].busy([3, 4, 5]).tolist() == [True, False, True]
    assert lenders["ring"].busy([3, 4, 5]).tolist() == [True, False, False]  # each group's own block ids
    full_lease.release()
    report = lenders["ring"].shutdown(force=True)
    assert report.retained_blocks["ring"].tolist() == [3]
    with pytest.raises(AlreadyLent):  # the full group's lender still holds the memory
        ExternalLender(kvs["full"])
    lenders["full"].shutdown()
    ExternalLender(kvs["full"]).shutdown()  # the last one shut down: the claim ended
    with pytest.raises(LeaseError, match="no layer group"):
        ExternalLender.for_groups({})


def test_a_lender_let_go_gives_its_memory_back_and_the_registry_keeps_nothing_alive() -> None:
    kv = engine_kv()
    lender = ExternalLender(kv)
    lender.lend_write("r", [0, 1], (0, 2 * BT))  # an open lease: a reference cycle back to the lender
    gone = weakref.ref(lender)
    del lender
    second = ExternalLender(kv)  # the abandoned one is collected, not mistaken for a live one
    assert gone() is None
    assert claims.holder(kv.regions) is second
    ref = weakref.ref(second)
    del second
    gc.collect()
    assert ref() is None and claims.holder(kv.regions) is None


def test_a_forced_shutdown_retains_leased_and_deferred_blocks_and_frees_the_memory_for_a_new_lender() -> None:
    kv = engine_kv()
    lender = ExternalLender(kv)
    lease = lender.lend_write("r", [3, 4], (0, 2 * BT))
    attempt = TrackedAttempt(label="fetch")
    lease.track(attempt)
    lease.release()
    assert lender.free([3, 4, 5], defer=True).tolist() == [5]
    report = lender.shutdown(force=True)
    assert report.unquiesced_attempts == 1 and report.retained_blocks["kv"].tolist() == [3, 4]
    assert lender.busy([3, 4, 5]).tolist() == [True, True, False]
    ended(attempt, 2)
    assert lender.reclaim().size == 0  # retained for good
    with pytest.raises(BlocksBusy, match=r"blocks \[3, 4\] are retained for good: a forced shutdown") as caught:
        lender.free([3, 4])
    assert caught.value.blocks.tolist() == [3, 4] and "freed already" not in str(caught.value)
    assert lender.free([3, 4, 5], defer=True).tolist() == [5]
    with pytest.raises(LendingDisabled, match="shut down"):
        lender.lend_read("r", [5], (0, BT))
    ExternalLender(kv).shutdown()


def test_the_collection_a_claim_runs_holds_no_lock_a_finalizer_may_wait_for() -> None:
    """A clash makes claim() collect garbage (a lender kept only by a cycle is let go): the
    finalizers that collection runs may wait for a thread that asks the registry."""
    kv = engine_kv()
    lender = ExternalLender(kv)  # live: the second claim clashes, and collects
    answered: list[object] = []

    class WaitsForAThread:
        def __del__(self) -> None:
            asker = threading.Thread(target=lambda: answered.append(claims.holder(kv.regions)))
            asker.start()
            asker.join(10.0)  # over the registry's lock, before the fix: 10 s, then nothing answered

    gc.disable()  # the cycle is collected by claim(), not before
    try:
        cycle = WaitsForAThread()
        cycle.me = cycle  # type: ignore[attr-defined]
        del cycle
        with pytest.raises(AlreadyLent):
            ExternalLender(kv)
    finally:
        gc.enable()
    assert answered == [lender]
    lender.shutdown()
