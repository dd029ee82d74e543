"""BlobBackend over a driver that fails the ways real ones do (issue 36, item 1): it raises
something other than StoreError, answers with too few or too many statuses or with something
that is not one, or blocks. Each fails that batch's rows, naming what happened, and the
backend's thread serves the next submission; shutdown() returns the attempt whose call is in
the driver, and closes the driver once, after that call returned."""

from __future__ import annotations

import errno
import itertools
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from kvxfer.backends.blob import BlobBackend, BlobDriver, MemoryDriver, MemoryStore, ShmDriver
from kvxfer.contract import (
    Attempt,
    Cancelled,
    Delivered,
    Failed,
    SubmissionRejected,
)
from kvxfer.testing.blob_pairs import blob_view
from kvxfer.testing.faulty_driver import Fault, FaultyDriver
from kvxfer.testing.memory import HostBuffer, HostRows
from kvxfer.testing.waiting import ended, settle

ROW = 1024
_n = itertools.count()
MADE: list[tuple[BlobBackend, FaultyDriver]] = []


@pytest.fixture(autouse=True)
def _shut_down() -> Iterator[None]:
    yield
    while MADE:
        backend, driver = MADE.pop()
        driver.release()
        assert backend.shutdown() == frozenset()
        assert driver.closes == 1 and not driver.closed_during_call
    assert not [t for t in threading.enumerate() if t.name.startswith("kvxfer-blob-faults")]


Inner = Callable[[], BlobDriver]


@pytest.fixture(params=["memory", "shm"])
def inner(request: pytest.FixtureRequest, tmp_path: Path) -> Inner:
    """A real driver on one store for both ends: in this process, or files in a directory."""
    if request.param == "memory":
        store = MemoryStore()
        return lambda: MemoryDriver(store)
    return lambda: ShmDriver(tmp_path / "store")


def _end(inner: Inner, **kw: object) -> tuple[BlobBackend, FaultyDriver, HostRows]:
    driver = FaultyDriver(inner())
    n = next(_n)
    memory = HostRows([HostBuffer(f"m{n}", ROW, 32)])
    backend = BlobBackend(driver, name=f"faults-{n}", **kw)  # type: ignore[arg-type]
    backend.register(memory.regions)
    MADE.append((backend, driver))
    return backend, driver, memory


def _payload(rows: int, seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, rows * ROW, dtype=np.uint8).tobytes()


def _put(backend: BlobBackend, memory: HostRows, request: str, slots: list[int], seed: int) -> Attempt:
    view = blob_view(memory, request, slots)
    memory.write(view.groups[0].region.name, view.groups[0].slots, _payload(len(slots), seed))
    return backend.publish(view, backend.describe(view))


def _get(backend: BlobBackend, memory: HostRows, request: str, slots: list[int]) -> Attempt:
    view = blob_view(memory, request, slots)
    return backend.fetch(view, backend.describe(view))


def _read(memory: HostRows, slots: list[int]) -> bytes:
    return memory.read(next(iter(memory.buffers)), np.asarray(slots, dtype=np.int64))


def _serves(prefill: BlobBackend, pm: HostRows, decode: BlobBackend, dm: HostRows, request: str) -> None:
    """The thread is alive and moves rows byte for byte."""
    assert isinstance(ended(_put(prefill, pm, request, [20, 21, 22], seed=99)), Delivered)
    assert isinstance(ended(_get(decode, dm, request, [25, 26, 27])), Delivered)
    assert _read(dm, [25, 26, 27]) == _payload(3, 99)


@pytest.mark.parametrize("error", [
    lambda: FileNotFoundError(errno.ENOENT, "No such file or directory", "/dev/shm/kvxfer-store/ab12"),
    lambda: OSError(errno.EIO, "Input/output error"),
    lambda: RuntimeError("client connection reset"),
], ids=["FileNotFoundError", "OSError", "RuntimeError"])
@pytest.mark.parametrize("when", [Fault.RAISE, Fault.RAISE_AFTER])
def test_a_driver_that_raises_anything_fails_that_batch_by_name_and_the_thread_serves_on(
        inner: Inner, error: Callable[[], BaseException], when: Fault) -> None:
    prefill, pd, pm = _end(inner, batch_rows=2)
    decode, dd, dm = _end(inner, batch_rows=2)
    pd.error = dd.error = error
    name = type(error()).__name__
    pd.plan("put", None, when)  # the second batch of the put: rows 2 and 3
    outcome = ended(_put(prefill, pm, "r1", [0, 1, 2, 3, 4, 5], seed=1))
    assert isinstance(outcome, Failed)
    assert outcome.masks[0].tolist() == [True, True, False, False, True, True]
    assert f"2 of 6 rows not stored (2 failed; first: store 'memory': put raised {name}: " in outcome.reason
    assert str(error()) in outcome.reason
    dd.plan("get", when)  # the first batch of the get: rows 0 and 1
    outcome = ended(_get(decode, dm, "r1", [10, 11, 12, 13, 14, 15]))
    assert isinstance(outcome, Failed) and f"get raised {name}" in outcome.reason
    put_anyway = when is Fault.RAISE_AFTER  # rows 2 and 3 are in the store, though the put failed them
    assert outcome.masks[0].tolist() == [False, False, put_anyway, put_anyway, True, True]
    assert _read(dm, [14, 15]) == _payload(6, 1)[4 * ROW:]
    _serves(prefill, pm, decode, dm, "r2")


@pytest.mark.parametrize(("fault", "said"), [
    (Fault.SHORT, "answered 1 value"),
    (Fault.LONG, "answered 3 values"),
    (Fault.NOT_A_STATUS, "answered str 'ok' for key 0"),
    (Fault.NOT_A_LIST, "answered a NoneType, not a list"),
])
def test_a_malformed_answer_fails_the_batch_naming_it_though_the_store_did_the_work(
        inner: Inner, fault: Fault, said: str) -> None:
    prefill, pd, pm = _end(inner, batch_rows=2)
    decode, dd, dm = _end(inner, batch_rows=2)
    pd.plan("put", fault)
    outcome = ended(_put(prefill, pm, "r1", [0, 1, 2, 3], seed=2))
    assert isinstance(outcome, Failed) and outcome.masks[0].tolist() == [False, False, True, True]
    assert f"store 'memory': put of 2 keys {said}" in outcome.reason
    dd.plan("get", None, fault)
    outcome = ended(_get(decode, dm, "r1", [10, 11, 12, 13]))
    assert isinstance(outcome, Failed) and outcome.masks[0].tolist() == [True, True, False, False]
    assert f"get of 2 keys {said}" in outcome.reason
    _serves(prefill, pm, decode, dm, "r2")


def test_an_exists_that_raises_or_answers_malformed_is_no_proof_that_keys_are_there(inner: Inner) -> None:
    """A fetch waiting for keys asks exists(): a short answer must not read as "all there" (a
    short list of True would), nor may a raise stop the wait; it waits on, and takes the rows
    once the publisher has put them."""
    prefill, _, pm = _end(inner)
    decode, dd, dm = _end(inner, fetch_wait_s=5.0)
    ended(_put(prefill, pm, "r1", [0, 1, 2], seed=3))
    dd.plan("exists", Fault.SHORT, Fault.NOT_A_LIST, Fault.RAISE, Fault.LONG, Fault.SHORT)
    fetching = _get(decode, dm, "r1", [10, 11, 12, 13])  # row 3 is not there yet
    assert settle(lambda: dd.calls["exists"] >= 6)
    assert fetching.poll() is None
    whole = _payload(4, 4)
    view = blob_view(pm, "r1", [0, 1, 2, 3])
    pm.write(view.groups[0].region.name, view.groups[0].slots, whole)
    assert isinstance(ended(prefill.publish(view, prefill.describe(view))), Delivered)
    assert isinstance(ended(fetching), Delivered) and _read(dm, [10, 11, 12, 13]) == whole


class _Stop(BaseException):
    """Not an Exception: what a driver might let through that no ``except Exception`` stops."""


def test_a_base_exception_ends_every_attempt_failed_and_later_submissions_are_refused_by_name(
        inner: Inner) -> None:
    prefill, pd, pm = _end(inner)
    pd.error = lambda: _Stop("the client library gave up")
    pd.plan("put", Fault.RAISE)
    pd.hold()
    running = _put(prefill, pm, "r1", [0, 1], seed=5)
    assert pd.stuck.wait(5)
    queued = _put(prefill, pm, "r2", [2, 3], seed=6)
    pd.release()
    for attempt in (running, queued):
        outcome = ended(attempt)
        assert isinstance(outcome, Failed) and outcome.rows_delivered == 0
        assert "its thread ended on _Stop: the client library gave up" in outcome.reason
    with pytest.raises(SubmissionRejected, match="moves no more rows: its thread ended on _Stop"):
        _put(prefill, pm, "r3", [4], seed=7)
    MADE.remove((prefill, pd))
    assert prefill.shutdown() == frozenset()
    assert pd.closes == 1 and len(pd.unregistered) == 2  # the region and the digest scratch; closed by shutdown: the thread had ended


def test_shutdown_returns_the_attempt_whose_get_is_blocked_in_the_driver_and_closes_it_after() -> None:
    """The seed of item 2: a get blocked past the timeout made shutdown() return nothing
    while that attempt had not quiesced."""
    store = MemoryStore()
    prefill, pd, pm = _end(lambda: MemoryDriver(store), timeout_s=0.3)
    decode, dd, dm = _end(lambda: MemoryDriver(store), timeout_s=0.3)
    ended(_put(prefill, pm, "r1", [0, 1], seed=8))
    dd.hold()
    blocked = _get(decode, dm, "r1", [10, 11])
    assert dd.stuck.wait(5)
    queued = _put(decode, dm, "r2", [12], seed=9)  # queued behind it: no call of its is in the driver
    MADE.remove((decode, dd))
    assert decode.shutdown() == frozenset({blocked})
    assert not blocked.quiesced() and dd.closes == 0 and dd.unregistered == []  # the get still runs
    assert isinstance(queued.poll(), Cancelled) and queued.quiesced() and queued.poll().rows_delivered == 0
    assert decode.shutdown() == frozenset({blocked})  # again: still running, still not closed
    assert dd.closes == 0
    dd.release()
    assert isinstance(ended(blocked), Cancelled)
    assert settle(lambda: dd.closes == 1)  # by the thread, once its get returned
    assert len(dd.unregistered) == 2 and not dd.closed_during_call  # the region and the digest scratch
    assert decode.shutdown() == frozenset() and dd.closes == 1  # idempotent: closed once
    with pytest.raises(SubmissionRejected, match="shut down"):
        _get(decode, dm, "r1", [10, 11])


def test_shutdown_with_nothing_in_the_driver_closes_it_once_however_often_it_is_called() -> None:
    backend, driver, memory = _end(lambda: MemoryDriver())
    ended(_put(backend, memory, "r1", [0], seed=10))
    MADE.remove((backend, driver))
    for _ in range(3):
        assert backend.shutdown() == frozenset()
    assert driver.closes == 1 and len(driver.unregistered) == 2  # the region and the digest scratch
