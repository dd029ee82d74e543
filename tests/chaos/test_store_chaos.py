"""The store backend under a driver that fails at random (issue 36, item 1).

Two ends, each a real pool, its InPlaceLender and a BlobBackend whose driver (a FaultyDriver
around a MemoryDriver on one shared store) raises (FileNotFoundError, OSError, RuntimeError,
ValueError; before or after the real call), answers short, long, with a str or None, or
stalls, on 15% of its calls, over thousands of seeded random publishes, fetches, cancels and
refusals. Held throughout, and at the end:

- every attempt concludes and quiesces; a Failed one says why;
- a row is True only with the publisher's bytes; a put never changes its source rows; a
  refused fetch touches no row;
- rows of an attempt not quiesced are never free, though its lease was released at once;
- both backend threads live on and move a clean request byte for byte once the faults stop;
- shutdown() returns exactly the attempts not quiesced (one held in the driver), the driver
  is closed once, after that call returned; then every lease is released and every block
  of both pools is free (the lenders shut down without force).
"""

from __future__ import annotations

import ctypes
import errno
import random
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pytest

from kvxfer.backends.blob import BlobBackend, MemoryDriver, MemoryStore
from kvxfer.contract import Attempt, Cancelled, Delivered, Failed, SubmissionRejected, View
from kvxfer.engine import ModelConfig
from kvxfer.lender import InPlaceLender, Lease
from kvxfer.pool import PagedKVPool
from kvxfer.pool.allocator import BlockAllocator
from kvxfer.testing.faulty_driver import Fault, FaultyDriver
from kvxfer.testing.waiting import settle

SEED = 36
STEPS = 3000
ATTEMPTS = 2000  # at least, before the faults stop
RATE = 0.15
BLOCKS = 192
CFG = ModelConfig(vocab_size=64, hidden=32, layers=2, heads=2, kv_heads=2, head_dim=8, intermediate=48,
                  block_tokens=4)
BT = CFG.block_tokens
ERRORS = (lambda: FileNotFoundError(errno.ENOENT, "No such file or directory", "/dev/shm/kvxfer-store/k"),
          lambda: OSError(errno.EIO, "Input/output error"), lambda: RuntimeError("client reset"),
          lambda: ValueError("bad buffer"))
SENTINEL = 0xEE

pytestmark = pytest.mark.timeout(120)


def _slots(view: View) -> np.ndarray:
    """The memory of the view's rows (one region: the pool's one group), (rows, row bytes)."""
    group = view.groups[0]
    region = group.region
    memory = (ctypes.c_uint8 * (region.slot_bytes * region.slots)).from_address(region.address)
    return np.ctypeslib.as_array(memory).reshape(region.slots, region.slot_bytes)


def _rows(view: View) -> np.ndarray:
    return _slots(view)[view.groups[0].slots]


def _write_rows(view: View, data: np.ndarray) -> None:
    _slots(view)[view.groups[0].slots] = data


@dataclass(eq=False)
class _Live:
    end: _End
    rid: str
    lease: Lease
    view: View
    attempt: Attempt
    put: bool
    abandoned: bool  # lease released and request freed at once: the rows wait for quiescence


class _End:
    def __init__(self, name: str, store: MemoryStore, seed: int, **kw: object) -> None:
        self.name = f"chaos-{name}"
        self.pool: PagedKVPool = CFG.make_pool(BLOCKS, name=f"{name}-kv")
        self.lender = InPlaceLender(self.pool)
        self.alloc: BlockAllocator = self.pool.allocator(self.pool.groups[0].name)
        errors = random.Random(seed)  # its own: drawn on the backend's thread
        self.driver = FaultyDriver(MemoryDriver(store), error=lambda: errors.choice(ERRORS)())
        self.driver.chaos(seed, RATE)
        self.backend = BlobBackend(self.driver, name=self.name, batch_rows=3, max_queued_rows=16,
                                   timeout_s=1.0, **kw)  # type: ignore[arg-type]
        self.backend.register(self.lender.regions)

    def free_blocks(self) -> int:
        return int(self.pool.stats()[self.pool.groups[0].name]["free"])


class _Run:
    """The owner of both ends: the one thread that calls their pools, lenders and backends."""

    def __init__(self) -> None:
        self.rng = random.Random(SEED)
        store = MemoryStore()
        self.prefill = _End("prefill", store, SEED + 1)
        self.decode = _End("decode", store, SEED + 2, fetch_wait_s=0.01)
        self.expected: dict[str, np.ndarray] = {}  # a published request's rows, as put
        self.live: list[_Live] = []
        self.attempts: list[Attempt] = []
        self.outcomes: Counter[str] = Counter()
        self.rows_checked = 0
        self.n = 0

    # --- submissions ------------------------------------------------------------------------
    def publish(self, blocks: int | None = None, abandon: bool | None = None) -> _Live | None:
        end, blocks = self.prefill, blocks or self.rng.randint(1, 6)
        if end.free_blocks() < blocks:
            return None
        rid = f"r{self.n}"
        self.n += 1
        end.pool.allocate(rid, blocks * BT)
        end.pool.commit(rid, blocks * BT)
        lease = end.lender.lend_read(rid, (0, blocks * BT))
        view = lease.view()
        assert view is not None
        _write_rows(view, np.frombuffer(self.rng.randbytes(_rows(view).size), dtype=np.uint8).reshape(view.rows, -1))
        self.expected[rid] = _rows(view).copy()
        return self._submit(end, rid, lease, view, True, abandon)

    def fetch(self, rid: str | None = None, abandon: bool | None = None) -> _Live | None:
        end = self.decode
        if rid is None:
            known = [r for r in self.expected if not end.pool.has(r)]
            if not known:
                return None
            rid = self.rng.choice(known) if self.rng.random() < 0.9 else f"never-{self.n}"
            self.n += 1
        blocks = len(self.expected[rid]) if rid in self.expected else self.rng.randint(1, 4)
        if end.free_blocks() < blocks:
            return None
        end.pool.allocate(rid, blocks * BT)
        lease = end.lender.lend_write(rid, (0, blocks * BT))
        view = lease.view()
        assert view is not None
        _write_rows(view, np.full(_rows(view).shape, SENTINEL, dtype=np.uint8))
        return self._submit(end, rid, lease, view, False, abandon)

    def _submit(self, end: _End, rid: str, lease: Lease, view: View, put: bool, abandon: bool | None) -> _Live | None:
        try:
            hint = end.backend.describe(view)
            attempt = (end.backend.publish if put else end.backend.fetch)(view, hint)
        except SubmissionRejected:  # back-pressure: it touched nothing
            self.outcomes["refused"] += 1
            if not put:
                assert (_rows(view) == SENTINEL).all()
            lease.release()
            end.pool.free(rid)
            if put:
                del self.expected[rid]
            return None
        lease.track(attempt)
        abandoned = self.rng.random() < 0.25 if abandon is None else abandon
        if abandoned:  # rule 3: release now; the lender keeps the rows until the attempt quiesces
            lease.release()
            end.pool.free(rid)
        live = _Live(end, rid, lease, view, attempt, put, abandoned)
        self.live.append(live)
        self.attempts.append(attempt)
        return live

    def cancel_one(self) -> None:
        if self.live:
            self.rng.choice(self.live).attempt.cancel()

    # --- conclusions --------------------------------------------------------------------------
    def collect(self) -> None:
        """End what concluded and quiesced; what did not holds its rows."""
        left = []
        for live in self.live:
            if live.attempt.quiesced():
                self._conclude(live)
                continue
            if live.abandoned:  # released, yet not free: only this thread unpins, and only once quiesced
                assert (live.end.alloc.pins[live.view.groups[0].slots] > 0).all()
            left.append(live)
        self.live = left

    def _conclude(self, live: _Live) -> None:
        outcome = live.attempt.poll()
        assert outcome is not None, live.attempt
        self.outcomes[type(outcome).__name__] += 1
        assert not isinstance(outcome, Failed) or outcome.reason
        if not live.abandoned:
            mask = outcome.masks[0]
            if live.put:  # a put reads its rows, never writes them
                assert (_rows(live.view) == self.expected[live.rid]).all()
            elif mask.any():
                assert live.rid in self.expected, "a row True for keys nobody put"
                assert (_rows(live.view)[mask] == self.expected[live.rid][mask]).all(), \
                    f"{live.rid}: rows True without the publisher's bytes"
                self.rows_checked += int(mask.sum())
            if not live.put:
                live.lease.mark_arrived(outcome.masks)
            live.lease.release()
            live.end.pool.free(live.rid)
        live.end.lender.reclaim()


def _settled(run: _Run, live: _Live | None) -> Delivered:
    assert live is not None and settle(live.attempt.quiesced, 5.0)
    outcome = live.attempt.poll()
    assert isinstance(outcome, Delivered) and outcome.all_delivered, outcome
    run.collect()
    return outcome


@pytest.fixture
def run() -> Iterator[_Run]:
    made = _Run()
    yield made
    for end in (made.prefill, made.decode):  # a failed test too leaves no thread (shutdown is idempotent)
        end.driver.release()
        end.backend.shutdown()


def test_a_driver_failing_at_random_never_stops_the_store_backend_nor_leaks_a_row(run: _Run) -> None:
    began = time.monotonic()
    # STEPS steps, and on until ATTEMPTS attempts were made: a step finds no free block while
    # abandoned leases wait for their attempts to quiesce, which a loaded machine makes longer.
    steps = 0
    while steps < STEPS or (len(run.attempts) < ATTEMPTS and steps < 3 * STEPS):
        steps += 1
        choice = run.rng.random()
        if choice < 0.5:
            run.publish()
        elif choice < 0.92:
            run.fetch()
        else:
            run.cancel_one()
        run.collect()
    assert settle(lambda: all(live.attempt.quiesced() for live in run.live), 10.0)
    run.collect()
    assert not run.live
    injected = run.prefill.driver.injected + run.decode.driver.injected
    print(f"\n{len(run.attempts)} attempts: {dict(run.outcomes)}; {run.rows_checked} fetched rows checked; "
          f"faults: {dict((f.value, n) for f, n in injected.items())}; {time.monotonic() - began:.1f}s")
    assert len(run.attempts) >= ATTEMPTS and run.rows_checked > 500
    assert min(run.outcomes[k] for k in ("Delivered", "Failed", "Cancelled")) > 20  # refusals come as timing has it
    assert set(injected) == set(Fault) and min(injected.values()) > 20

    # The faults stop: both threads live on and move a clean request byte for byte.
    run.prefill.driver.chaos(0, 0.0)
    run.decode.driver.chaos(0, 0.0)
    threads = {t.name for t in threading.enumerate()}
    assert {f"kvxfer-blob-{run.prefill.name}", f"kvxfer-blob-{run.decode.name}"} <= threads
    clean = run.publish(blocks=3, abandon=False)
    _settled(run, clean)
    assert clean is not None
    _settled(run, run.fetch(clean.rid, abandon=False))

    # A fetch held in the driver (its lease released at once), another queued behind it:
    # shutdown returns exactly the first, and closes the driver only once its call returned.
    run.decode.driver.hold()
    held = run.fetch(clean.rid, abandon=True)
    assert held is not None and run.decode.driver.stuck.wait(5)
    queued = run.fetch(clean.rid, abandon=False)
    assert queued is not None
    left = run.decode.backend.shutdown()
    assert left == {held.attempt} == {a for a in run.attempts if not a.quiesced()}
    assert isinstance(queued.attempt.poll(), Cancelled) and run.decode.driver.closes == 0
    run.collect()
    assert run.prefill.backend.shutdown() == frozenset() and run.prefill.driver.closes == 1
    run.decode.driver.release()
    assert settle(lambda: held.attempt.quiesced() and run.decode.driver.closes == 1, 5.0)
    assert not run.decode.driver.closed_during_call and run.decode.backend.shutdown() == frozenset()
    run.collect()
    for end in (run.prefill, run.decode):
        report = end.lender.shutdown()  # without force: refused while a lease is open or holds rows
        assert not report.retained_anything and end.free_blocks() == BLOCKS and not end.alloc.pins.any()
