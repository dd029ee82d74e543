"""Loopback specifics beyond the kit: deadlines, a vanished peer, stale records, threads;
and proof that the kit itself fails on a backend that breaks the rules."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from kvxfer.backends.loopback import LoopbackBackend, LoopbackFabric
from kvxfer.contract import (
    CacheKind,
    CompletionRecord,
    Delivered,
    Failed,
    InvalidSubmission,
    LayerGroupRows,
    RecordStatus,
    TokenRange,
    TransferMode,
    View,
)
from kvxfer.testing import conformance
from kvxfer.testing.memory import HostBuffer, HostRows
from kvxfer.testing.pairs import loopback_pair as make_pair
from kvxfer.testing.waiting import settle


def _view(buf: HostBuffer, slots: list[int], request: str = "q") -> View:
    return View(request, TokenRange(0, 16 * len(slots)),
                (LayerGroupRows("g", CacheKind.PAGED, buf.region, slots, list(range(len(slots)))),), b"L")


def _two(mode: TransferMode = TransferMode.PUSH, **kw: float) -> tuple[LoopbackBackend, LoopbackBackend, HostBuffer, HostBuffer]:
    fabric = LoopbackFabric()
    a = LoopbackBackend(fabric, "a", mode, **kw)  # type: ignore[arg-type]
    b = LoopbackBackend(fabric, "b", mode, **kw)  # type: ignore[arg-type]
    ba, bb = HostBuffer("A", 32, 8), HostBuffer("B", 32, 8)
    a.register([ba.region])
    b.register([bb.region])
    return a, b, ba, bb


def test_passive_wait_times_out_with_named_failure() -> None:
    a, b, ba, bb = _two(deadline_s=0.2)
    try:
        va, vb = _view(ba, [0, 1]), _view(bb, [2, 3])
        a.describe(va)
        hint_b = b.describe(vb)
        attempt = a.fetch(va, hint_b)  # nobody publishes
        assert attempt.wait(5)
        outcome = attempt.poll()
        assert isinstance(outcome, Failed) and "timeout" in outcome.reason and outcome.rows_delivered == 0
        assert attempt.quiesced()  # the peer confirmed it never started
    finally:
        a.shutdown()
        b.shutdown()


def test_peer_leaving_fails_waiters() -> None:
    a, b, ba, bb = _two()
    va, vb = _view(ba, [0, 1]), _view(bb, [2, 3])
    a.describe(va)
    hint_b = b.describe(vb)
    attempt = a.fetch(va, hint_b)
    assert b.shutdown() == frozenset()
    assert attempt.wait(5)
    outcome = attempt.poll()
    assert isinstance(outcome, Failed) and "left" in outcome.reason
    a.shutdown()


def _handled_so_far(backend: LoopbackBackend, marker: str) -> bool:
    """Deliver a record for a transfer nobody waits on (``backend`` stashes it): once it is
    stashed, every record delivered before it was handled too (the inbox is in order)."""
    backend._fabric.deliver(backend.name, CompletionRecord(marker, "b", "q", RecordStatus.DELIVERED, []))
    return settle(lambda: marker in backend._stashed)


def test_stale_and_foreign_records_ignored() -> None:
    a, b, ba, bb = _two(delay_s=0.0)
    fabric_deliver = a._fabric.deliver
    try:
        va, vb = _view(ba, [0, 1]), _view(bb, [2, 3])
        hint_a = a.describe(va)
        hint_b = b.describe(vb)
        attempt = a.fetch(va, hint_b)
        # A record from a stranger for our transfer id is ignored.
        fabric_deliver("a", CompletionRecord(hint_a.transfer_id, "mallory", "q", RecordStatus.DELIVERED,
                                             [np.ones(2, bool)]))
        assert _handled_so_far(a, "marker-1")
        assert attempt.poll() is None
        bb.array[[2, 3]] = 7
        b.publish(vb, hint_a)
        assert attempt.wait(5) and isinstance(attempt.poll(), Delivered)
        first = attempt.poll()
        # A replay of the real record after conclusion changes nothing.
        fabric_deliver("a", CompletionRecord(hint_a.transfer_id, "b", "q", RecordStatus.FAILED, [np.zeros(2, bool)],
                                             "replayed"))
        assert _handled_so_far(a, "marker-2")
        assert attempt.poll() is first
        assert (ba.array[[0, 1]] == 7).all()
    finally:
        a.shutdown()
        b.shutdown()


def test_shutdown_stops_progress_threads() -> None:
    before = {t.name for t in threading.enumerate()}
    a, b, _, _ = _two()
    assert any(t.name.startswith("kvxfer-loopback") for t in threading.enumerate())
    a.shutdown()
    b.shutdown()
    left = {t.name for t in threading.enumerate()} - before
    assert not [n for n in left if n.startswith("kvxfer-loopback")], left


def test_raising_wake_does_not_stop_progress() -> None:
    a, b, ba, bb = _two(delay_s=0.0)
    try:
        va, vb = _view(ba, [0]), _view(bb, [1])
        hint_a = a.describe(va)
        hint_b = b.describe(vb)

        def bad_wake() -> None:
            raise RuntimeError("owner bug")

        fetch = a.fetch(va, hint_b, bad_wake)
        publish = b.publish(vb, hint_a, bad_wake)
        assert fetch.wait(5) and publish.wait(5)
    finally:
        a.shutdown()
        b.shutdown()


# --- the kit fails on broken backends -------------------------------------------------

class _LyingBackend(LoopbackBackend):
    """Reports every row delivered even when the copy stopped part-way."""

    def _run_active(self, job):  # type: ignore[no-untyped-def]
        real = job.attempt.conclude

        def conclude(outcome):  # type: ignore[no-untyped-def]
            masks = [np.ones_like(m) for m in outcome.masks]
            return real(Failed(outcome.reason, masks) if isinstance(outcome, Failed) else Delivered(masks))

        job.attempt.conclude = conclude
        super()._run_active(job)


def _make_broken(cls: type[LoopbackBackend]):  # type: ignore[no-untyped-def]
    def factory(mode: TransferMode) -> conformance.Pair:
        pair = make_pair(mode)
        pair.local.__class__ = cls
        return pair
    return factory


def test_kit_catches_lying_masks() -> None:
    with pytest.raises(AssertionError, match="rows delivered, expected"):
        conformance.check_partial_failure_exact(_make_broken(_LyingBackend), TransferMode.PUSH)


def test_kit_catches_skipped_registration_check() -> None:
    def factory(mode: TransferMode) -> conformance.Pair:
        pair = make_pair(mode)
        pair.local._regions.check_view = lambda view, for_fetch: None  # type: ignore[attr-defined]
        return pair

    with pytest.raises(AssertionError, match="touched|instead of raising"):
        conformance.check_unregistered_region_refused(factory, TransferMode.PUSH)


class _CancelIgnored(LoopbackBackend):
    """Returns attempts whose cancel() does nothing: a wait then ends only at its deadline."""

    def fetch(self, view, hint, wake=None):  # type: ignore[no-untyped-def]
        attempt = super().fetch(view, hint, wake)
        attempt.cancel = lambda: None  # type: ignore[method-assign]
        return attempt


def test_kit_catches_a_cancel_that_does_nothing() -> None:
    def factory(mode: TransferMode) -> conformance.Pair:
        pair = make_pair(mode, deadline_s=0.5)
        pair.local.__class__ = _CancelIgnored
        return pair

    with pytest.raises(AssertionError, match="whose peer never published ended"):
        conformance.check_cancel_before_peer_starts(factory, TransferMode.PUSH)


def test_host_rows_round_trip() -> None:
    buf = HostBuffer("X", 8, 4)
    rows = HostRows([buf])
    rows.write("X", np.array([3, 1]), bytes(range(16)))
    assert rows.read("X", np.array([1, 3])) == bytes(range(8, 16)) + bytes(range(8))


def test_a_used_hint_and_a_swapped_view_are_refused() -> None:
    # A hint moves bytes once: publishing again with the same hint (the peer may have reused
    # those rows since) is refused by name, before anything moves. A fetch of a view holding
    # other rows than the one described (its hint showed the peer those) is refused too.
    a, b, ba, bb = _two(delay_s=0.0)
    try:
        va, vb = _view(ba, [0, 1]), _view(bb, [2, 3])
        hint_a = a.describe(va)
        b.describe(vb)
        waiting = a.fetch(va, b.describe(vb))
        sending = b.publish(vb, hint_a)
        assert sending.wait(5) and waiting.wait(5) and isinstance(waiting.poll(), Delivered)
        ba.array[[0, 1]] = 0
        b.describe(vb)
        with pytest.raises(InvalidSubmission, match="was used already"):
            b.publish(vb, hint_a)
        # A negative, with nothing to wait for (a refused publish queues nothing): give a copy
        # that went ahead anyway a moment to show.
        time.sleep(0.05)
        assert (ba.array[[0, 1]] == 0).all()  # nothing moved
        a.describe(_view(ba, [0, 1], "r"))
        with pytest.raises(InvalidSubmission, match="holds other rows than the one described"):
            a.fetch(_view(ba, [4, 5], "r"), b.describe(_view(bb, [2, 3], "r")))
    finally:
        a.shutdown()
        b.shutdown()
