"""BlobBackend over the in-memory store: what a lease holder relies on beyond the kit. Rows
come back byte for byte; a missing, lost or failed key is False and the fetch Failed, naming
it; a full store, a dead one, a deadline and a cancel end with exact masks; the queue is
bounded; layouts that differ never share a key; shutdown leaves nothing running."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest

from kvxfer.backends.blob import BlobBackend, MemoryDriver, MemoryStore, request_names
from kvxfer.contract import (
    Attempt,
    Cancelled,
    Delivered,
    Failed,
    Outcome,
    SubmissionRejected,
    View,
)
from kvxfer.testing.blob_pairs import blob_view
from kvxfer.testing.memory import HostBuffer, HostRows
from kvxfer.testing.waiting import ended

ROW = 4096
MADE: list[BlobBackend] = []


@pytest.fixture(autouse=True)
def _shut_down() -> Iterator[None]:
    yield
    while MADE:
        assert MADE.pop().shutdown() == frozenset()
    assert not [t for t in threading.enumerate() if t.name.startswith("kvxfer-blob-")]


def _end(store: MemoryStore, name: str, **kw: object) -> tuple[BlobBackend, HostRows]:
    memory = HostRows([HostBuffer(f"{name}0", ROW, 64)])
    backend = BlobBackend(MemoryDriver(store), name=name, **kw)  # type: ignore[arg-type]
    backend.register(memory.regions)
    MADE.append(backend)
    return backend, memory


def _payload(n: int, seed: int = 0) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n * ROW, dtype=np.uint8).tobytes()


def _publish(backend: BlobBackend, memory: HostRows, view: View, data: bytes) -> Outcome:
    memory.write(view.groups[0].region.name, view.groups[0].slots, data)
    return ended(backend.publish(view, backend.describe(view)))


def test_rows_put_by_one_end_come_back_byte_for_byte_at_another() -> None:
    store = MemoryStore()
    prefill, pm = _end(store, "prefill")
    decode, dm = _end(store, "decode")
    data = _payload(10)
    assert isinstance(_publish(prefill, pm, blob_view(pm, "r1", [9, 3, 5, 7, 1, 0, 2, 4, 6, 8]), data), Delivered)
    view = blob_view(dm, "r1", [40, 41, 12, 13, 14, 50, 51, 52, 53, 63])
    outcome = ended(decode.fetch(view, decode.describe(view)))
    assert isinstance(outcome, Delivered) and outcome.all_delivered
    assert dm.read("decode0", view.groups[0].slots) == data
    assert store.used == 10 * (ROW + 8) and prefill.bytes_moved == decode.bytes_moved == 10 * ROW  # each row and its digest


def test_a_missing_or_lost_key_is_false_and_the_fetch_fails_naming_it() -> None:
    store = MemoryStore()
    prefill, pm = _end(store, "prefill")
    decode, dm = _end(store, "decode")
    _publish(prefill, pm, blob_view(pm, "r1", list(range(6))), _payload(6))
    store.lose(request_names(blob_view(pm, "r1", list(range(6))))[0][4:5])  # evicted: block 4
    view = blob_view(dm, "r1", list(range(10, 18)))  # 8 blocks: 6 and 7 were never put
    outcome = ended(decode.fetch(view, decode.describe(view)))
    assert isinstance(outcome, Failed)
    assert outcome.masks[0].tolist() == [True, True, True, True, False, True, False, False]
    assert "3 of 8 rows not read (3 missing" in outcome.reason and "of row 4 is missing" in outcome.reason


def test_a_full_store_refuses_what_does_not_fit_and_a_dead_one_fails_every_row() -> None:
    store = MemoryStore(capacity_bytes=5 * ROW + 8 * 8)  # five rows, and the batch's 8 digests (put first)
    prefill, pm = _end(store, "prefill")
    outcome = _publish(prefill, pm, blob_view(pm, "r1", list(range(8))), _payload(8))
    assert isinstance(outcome, Failed) and outcome.masks[0].tolist() == [True] * 5 + [False] * 3
    assert "3 full" in outcome.reason
    store.down = True
    decode, dm = _end(store, "decode")
    view = blob_view(dm, "r1", list(range(5)))
    outcome = ended(decode.fetch(view, decode.describe(view)))
    assert isinstance(outcome, Failed) and outcome.rows_delivered == 0 and "5 failed" in outcome.reason


def test_a_fetch_waits_for_keys_a_publisher_is_still_putting_when_asked_to() -> None:
    store = MemoryStore()
    prefill, pm = _end(store, "prefill")
    decode, dm = _end(store, "decode", fetch_wait_s=5.0)
    view = blob_view(dm, "r1", list(range(4)))
    fetching = decode.fetch(view, decode.describe(view))
    time.sleep(0.2)
    assert fetching.poll() is None  # waiting, not failed
    data = _payload(4, seed=3)
    _publish(prefill, pm, blob_view(pm, "r1", [7, 6, 5, 4]), data)
    assert isinstance(ended(fetching), Delivered) and dm.read("decode0", view.groups[0].slots) == data


def test_deadline_and_cancel_end_between_batches_with_exact_masks() -> None:
    store = MemoryStore()
    prefill, pm = _end(store, "prefill", batch_rows=2, timeout_s=0.5)
    store.delay_s = 0.2  # per batch of 2 rows: 8 rows need 0.8 s
    outcome = _publish(prefill, pm, blob_view(pm, "r1", list(range(8))), _payload(8))
    assert isinstance(outcome, Failed) and "deadline of 0.5s passed" in outcome.reason
    delivered = outcome.masks[0]
    assert 0 < delivered.sum() < 8 and delivered.tolist() == sorted(delivered.tolist(), reverse=True)
    assert store.used == int(delivered.sum()) * (ROW + 8)  # what the mask says is stored (and its digest), is
    store.delay_s = 0.05
    slow, sm = _end(store, "slow", batch_rows=2)
    view = blob_view(sm, "r2", list(range(8)))
    attempt = slow.publish(view, slow.describe(view))
    time.sleep(0.08)
    attempt.cancel()
    outcome = ended(attempt)
    assert isinstance(outcome, Cancelled) and 0 < outcome.rows_delivered < 8


def test_the_queue_is_bounded_and_a_refused_submission_touches_nothing() -> None:
    store = MemoryStore()
    store.delay_s = 0.05
    prefill, pm = _end(store, "prefill", max_queued_rows=6)
    first = blob_view(pm, "r1", list(range(4)))
    attempt = prefill.publish(first, prefill.describe(first))
    second = blob_view(pm, "r2", list(range(10, 14)))
    with pytest.raises(SubmissionRejected, match="4 rows are queued; 4 more would pass max_queued_rows=6"):
        prefill.publish(second, prefill.describe(second))
    ended(attempt)
    assert store.puts == 8  # 4 rows of r1 and their digests; nothing of r2
    assert isinstance(ended(prefill.publish(second, prefill.describe(second))), Delivered)  # room again


def test_layouts_that_differ_never_share_a_key() -> None:
    store = MemoryStore()
    a, am = _end(store, "a")
    b, bm = _end(store, "b")
    _publish(a, am, blob_view(am, "r1", [0, 1], layout=b"layout-a"), _payload(2, seed=1))
    view = blob_view(bm, "r1", [5, 6], layout=b"layout-b")
    outcome = ended(b.fetch(view, b.describe(view)))
    assert isinstance(outcome, Failed) and outcome.rows_delivered == 0 and "2 missing" in outcome.reason


def test_wake_comes_after_the_outcome_is_visible_and_shutdown_stops_the_thread() -> None:
    store = MemoryStore()
    prefill, pm = _end(store, "prefill")
    seen: list[bool] = []
    holder: list[Attempt] = []
    ready = threading.Event()

    def wake() -> None:
        if holder:
            seen.append(holder[0].poll() is not None)
            if holder[0].quiesced():
                ready.set()

    view = blob_view(pm, "r1", list(range(3)))
    holder.append(prefill.publish(view, prefill.describe(view), wake))
    assert ready.wait(5) and all(seen)
    assert "kvxfer-blob-prefill" in {t.name for t in threading.enumerate()}
    assert prefill.shutdown() == frozenset()
    assert "kvxfer-blob-prefill" not in {t.name for t in threading.enumerate()}
    with pytest.raises(SubmissionRejected, match="shut down"):
        prefill.publish(view, prefill.describe(view))


def test_a_fetch_whose_later_blocks_fault_leaves_resume_bounds_at_the_first_gap() -> None:
    """A real pool and lender on each end, as the workers use them: prefill commits a
    request's 6 blocks and publishes them; the store loses block 3; the decode end's fetch
    marks what arrived, and the lender's resume bounds stop at block 3, not past it, though
    blocks 4 and 5 arrived byte for byte."""
    import torch

    from kvxfer.engine import ModelConfig
    from kvxfer.lender import InPlaceLender

    cfg = ModelConfig(vocab_size=64, hidden=32, layers=2, heads=2, kv_heads=2, head_dim=8, intermediate=48,
                      block_tokens=4)
    bt, n = cfg.block_tokens, 24
    store = MemoryStore()
    ends = []
    for name in ("prefill", "decode"):
        pool = cfg.make_pool(32, name=f"{name}-kv")
        lender = InPlaceLender(pool)
        backend = BlobBackend(MemoryDriver(store), name=name)
        backend.register(lender.regions)
        MADE.append(backend)
        ends.append((pool, lender, backend))
    (ppool, plend, pback), (dpool, dlend, dback) = ends
    ppool.allocate("r", n)
    storage = ppool.storage(ppool.groups[0].name)
    storage.copy_(torch.randn(storage.shape, generator=torch.Generator().manual_seed(3)).to(storage.dtype))
    ppool.commit("r", n)
    lease = plend.lend_read("r", (0, n))
    view = lease.view()
    assert view is not None
    assert isinstance(ended(pback.publish(view, pback.describe(view))), Delivered)
    lease.release()
    store.lose(request_names(view)[0][3:4])
    dpool.allocate("r", n)
    lease = dlend.lend_write("r", (0, n))
    view = lease.view()
    assert view is not None
    outcome = ended(dback.fetch(view, dback.describe(view)))
    assert isinstance(outcome, Failed) and outcome.masks[0].tolist() == [True, True, True, False, True, True]
    lease.mark_arrived(outcome.masks)
    lease.release()
    bounds = dlend.readiness("r")
    assert bounds is not None and bounds.usable_until == 3 * bt
    src, dst = ppool.storage(ppool.groups[0].name), dpool.storage(dpool.groups[0].name)
    pblocks, dblocks = ppool.block_table("r", ppool.groups[0].name), dpool.block_table("r", dpool.groups[0].name)
    for b in (0, 1, 2, 4, 5):
        assert torch.equal(src[pblocks[b]], dst[dblocks[b]])
