"""CUDA pools, the in-place lender over DEVICE regions, and the staging lender's streams.

Run on the GPU machine: ``python -m pytest -q -m gpu tests/gpu/test_pool_gpu.py``.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from kvxfer.backends.loopback import LoopbackBackend, LoopbackFabric  # noqa: E402
from kvxfer.contract import CacheKind, MemoryKind, TransferMode  # noqa: E402
from kvxfer.lender import InPlaceLender, ResumeBounds, StagingLender  # noqa: E402
from kvxfer.pool import LayerGroupSpec, Layout, PagedKVPool  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

FULL = LayerGroupSpec("full", layers=4, block_tokens=16, kv_heads=2, head_dim=64)
SWA = LayerGroupSpec("swa", layers=2, block_tokens=16, kv_heads=2, head_dim=64, window=64, sink_blocks=1)
STATE = LayerGroupSpec("ssm", layers=1, block_tokens=1, kv_heads=4, head_dim=64, kind=CacheKind.STATE)


def cuda_pool(groups=(FULL, SWA, STATE), layout=Layout.BLOCK_MAJOR, blocks=256) -> PagedKVPool:
    return PagedKVPool(list(groups), blocks, device="cuda", layout=layout, scope=b"gpu-test")


def fill(pool: PagedKVPool, request: str, tokens: int, seed: int) -> None:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    pool.allocate(request, tokens)
    for spec in pool.groups:
        if spec.kind is CacheKind.STATE:
            slot = pool.state(request, spec.name)
            slot.copy_(torch.randn(slot.shape, generator=gen, device="cuda").to(slot.dtype))
            continue
        for layer in range(spec.layers):
            k = torch.randn(tokens, spec.kv_heads, spec.head_dim, generator=gen, device="cuda")
            v = torch.randn(tokens, spec.kv_heads, spec.head_dim, generator=gen, device="cuda")
            pool.write_kv(request, spec.name, layer, 0, k, v)
    pool.commit(request, tokens)


def wait_until(fn, timeout: float = 10.0):  # type: ignore[no-untyped-def]
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = fn()
        if value:
            return value
        time.sleep(0.001)
    raise AssertionError("timed out")


def test_cuda_pool_regions_are_device_memory() -> None:
    pool = cuda_pool()
    for region, t in zip(pool.slot_regions(), (pool.storage(g.name) for g in pool.groups)):
        assert region.memory_kind is MemoryKind.DEVICE
        assert region.device_id == torch.cuda.current_device() and region.address == t.data_ptr()
        assert region.nbytes == t.numel() * t.element_size()
    pool.allocate("r", 100)
    k = torch.randn(100, 2, 64, device="cuda")
    pool.write_kv("r", "full", 3, 0, k, k)
    assert torch.equal(pool.read_kv("r", "full", 3, 0, 100)[0], k.half())


def test_inplace_lender_lends_device_rows() -> None:
    pool = cuda_pool()
    lender = InPlaceLender(pool)
    fill(pool, "r", 200, seed=1)
    lease = lender.lend_read("r", (0, 200))
    view = lease.view()
    assert view is not None and all(g.region.memory_kind is MemoryKind.DEVICE for g in view.groups)
    assert view.groups[0].slots.tolist() == pool.block_table("r", "full").tolist()
    lease.release()
    pool.allocate("w", 0)
    write = lender.lend_write("w", (0, 200))
    write.mark_arrived(write.view().row_masks(True))
    write.release()
    assert lender.readiness("w") == ResumeBounds(200, 200)


@pytest.mark.parametrize("layout", list(Layout), ids=lambda x: x.value)
@pytest.mark.parametrize("mode", list(TransferMode), ids=lambda m: m.value)
def test_staging_round_trip_between_cuda_pools(layout: Layout, mode: TransferMode) -> None:
    p, d = cuda_pool(layout=layout), cuda_pool(layout=layout)
    lp, ld = StagingLender(p, 512, 2, 1 << 28), StagingLender(d, 512, 2, 1 << 28)
    assert all(b.is_pinned() for b in lp._buffers.values())
    fill(p, "r", 300, seed=2)
    d.allocate("r", 0)
    read, write = lp.lend_read("r", (0, 300)), ld.lend_write("r", (0, 300))
    view_p = wait_until(read.view)  # appears once the device-to-host copy event completes
    view_d = write.view()
    fabric = LoopbackFabric()
    bp, bd = LoopbackBackend(fabric, "P", mode), LoopbackBackend(fabric, "D", mode)
    try:
        bp.register(lp.regions)
        bd.register(ld.regions)
        hp, hd = bp.describe(view_p), bd.describe(view_d)
        pub, fet = bp.publish(view_p, hd), bd.fetch(view_d, hp)
        assert pub.wait(10) and fet.wait(10)
        assert fet.poll().all_delivered
        write.mark_arrived(fet.poll().masks)
        assert wait_until(lambda: ld.readiness("r") == ResumeBounds(300, 300))
    finally:
        read.release()
        write.release()
        assert not bp.shutdown() and not bd.shutdown()
    for spec in (FULL, SWA):
        for layer in range(spec.layers):
            lo = 0 if spec.window is None else 256  # the window group moved its sink and window
            src = p.read_kv("r", spec.name, layer, lo, 300)
            dst = d.read_kv("r", spec.name, layer, lo, 300)
            assert torch.equal(src[0], dst[0]) and torch.equal(src[1], dst[1])
    assert torch.equal(p.state("r", "ssm"), d.state("r", "ssm"))
    assert ld.open_leases == 0 and d.stats()["full"]["pinned"] == 0
    assert all(s.free == s.capacity for s in ld.stats().regions.values())


def test_staging_copy_waits_for_model_writes_on_the_current_stream() -> None:
    pool = cuda_pool(groups=(FULL,), blocks=4096)
    lender = StagingLender(pool, 16 * 4096, 1, 1 << 30)
    pool.allocate("r", 16 * 4096)
    big = torch.full_like(pool.storage("full"), 3.0)
    pool.storage("full").copy_(big)  # queued on the current stream just before the lend
    pool.commit("r", 16 * 4096)
    lease = lender.lend_read("r", (0, 16 * 4096))
    view = wait_until(lease.view)
    slots = torch.from_numpy(view.groups[0].slots.copy())
    assert bool((lender._buffers["full"][slots] == 3.0).all())
    lease.release()


def test_injected_copy_fault_on_cuda_of_unknown_end_quarantines_slots_and_retains_pages() -> None:
    pool = cuda_pool(groups=(FULL,))
    lender = StagingLender(pool, 64, 1, 1 << 24)
    fill(pool, "r", 64, seed=3)
    lender.inject_copy_faults(1, end_unknown=True)
    lease = lender.lend_read("r", (0, 64))
    assert lease.view() is None and lease.failure
    lease.release()
    assert lender.stats().regions["full"].quarantined == 4
    assert pool.stats()["full"]["retained"] == 4
    torch.cuda.synchronize()
    np.testing.assert_array_equal(pool.allocator("full").retained[pool.block_table("r", "full")], True)


def test_copy_fault_on_cuda_gives_slots_and_pages_back_once_the_copy_stream_synchronized() -> None:
    # The copy raised after the lender's stream had work queued (a large copy just before):
    # once that stream synchronizes nothing of it can run, and slots and pages come back.
    pool = cuda_pool(groups=(FULL,))
    lender = StagingLender(pool, 64, 1, 1 << 24)
    fill(pool, "r", 64, seed=3)
    warm = lender.lend_read("r", (0, 64))
    wait_until(warm.view)
    warm.release()
    lender.inject_copy_faults(1)
    lease = lender.lend_read("r", (0, 64))
    assert lease.view() is None and lease.failure
    stats = lender.stats()
    assert (stats.regions["full"].quarantined, stats.reclaimed) == (0, 4)
    assert pool.stats()["full"]["retained"] == 0
    lease.release()
    assert lender.stats().regions["full"].free == lender.stats().regions["full"].capacity
    again = lender.lend_read("r", (0, 64))
    assert wait_until(again.view) is not None
    again.release()
