"""Checks of transfers that run: bytes, masks, wakes, conclusion, cancel, faults and shutdown."""

from __future__ import annotations

import time

import numpy as np

from kvxfer.contract import (
    Cancelled,
    Delivered,
    Failed,
    InvalidSubmission,
    MemoryKind,
    SlotRegion,
    SubmissionRejected,
    TransferMode,
)
from kvxfer.testing.conformance.pair import TIMEOUT, Pair, PairFactory
from kvxfer.testing.conformance.transfers import (
    _check_masks_honest,
    _dest_rows,
    _fill,
    _finish,
    _groups,
    _plan,
    _roles,
    _source_rows,
    _start,
    _Waker,
)


def check_round_trip_exact(make_pair: PairFactory, mode: TransferMode) -> None:
    """Scattered rows in two groups arrive byte for byte; masks are all True at both ends."""
    for local_op, local_is_source in _roles():
        pair = make_pair(mode)
        try:
            plan = _plan(pair, f"rt-{local_op}", rows=24, seed=1)
            _fill(pair, plan, local_is_source)
            outcome, peer_outcome = _finish(pair, _start(pair, plan, local_op))
            assert isinstance(outcome, Delivered), outcome
            assert isinstance(peer_outcome, Delivered), peer_outcome
            assert all(m.dtype == np.bool_ and m.all() for m in outcome.masks)
            assert [m.size for m in outcome.masks] == [len(g) for g in plan.local_view.groups]
            for name, region, _ in _groups(pair):
                assert _dest_rows(pair, plan, local_is_source, name) == _source_rows(plan, name, region.slot_bytes)
        finally:
            pair.close()


def check_wake_after_visible(make_pair: PairFactory, mode: TransferMode) -> None:
    """wake runs only once a change is visible; the last wake sees outcome and quiescence."""
    for local_op, local_is_source in _roles():
        pair = make_pair(mode)
        try:
            plan = _plan(pair, f"wake-{local_op}", rows=8, seed=2)
            _fill(pair, plan, local_is_source)
            run = _start(pair, plan, local_op)
            _finish(pair, run)
            seen = [s for s in run.waker.seen]
            assert seen and seen[-1] == (True, True), seen
            # Visible state only moves forward between wakes.
            for before, after in zip(seen, seen[1:]):
                assert after[0] >= before[0] and after[1] >= before[1], seen
        finally:
            pair.close()


def check_outcome_is_final(make_pair: PairFactory, mode: TransferMode) -> None:
    """Once set, poll() returns the same outcome object forever."""
    pair = make_pair(mode)
    try:
        plan = _plan(pair, "final", rows=4, seed=3)
        _fill(pair, plan, False)
        run = _start(pair, plan, "fetch")
        outcome, _ = _finish(pair, run)
        run.local_attempt.cancel()  # cancelling a concluded attempt changes nothing
        for _ in range(50):
            assert run.local_attempt.poll() is outcome
        assert run.local_attempt.quiesced()
    finally:
        pair.close()


def check_register_skips_unreachable_kinds(make_pair: PairFactory, mode: TransferMode) -> None:
    """register() given a batch of mixed memory kinds registers those it reaches and returns
    the others (by the seed's contract), and moving rows of the reachable ones still works."""
    pair = make_pair(mode)
    try:
        reached = pair.local.capabilities.memory_kinds
        far = 1 << 56  # far from any real allocation, so only its kind can decide
        others = tuple(SlotRegion(f"unreachable-{kind.value}", far + i * (1 << 40), 4096, 4, kind)
                       for i, kind in enumerate(MemoryKind) if kind not in reached)
        skipped = pair.local.register(list(pair.local_regions) + list(others))
        assert tuple(skipped) == others, f"register() of a mixed batch returned {skipped!r}, expected {others!r}"
    finally:
        pair.close()
    check_round_trip_exact(lambda m: _registered_again(make_pair(m)), mode)


def _registered_again(pair: Pair) -> Pair:
    """``pair`` after its local end registered its own regions once more (taken as they are)."""
    skipped = pair.local.register(pair.local_regions)
    assert not skipped, f"register() skipped regions it had taken: {skipped!r}"
    return pair


def check_missing_counterpart_false(make_pair: PairFactory, mode: TransferMode) -> None:
    """Rows the peer does not have are False in the fetcher's masks, never guessed."""
    pair = make_pair(mode)
    try:
        plan = _plan(pair, "prefix", rows=12, seed=8, peer_missing=3)
        _fill(pair, plan, False)
        outcome, _ = _finish(pair, _start(pair, plan, "fetch"))
        assert not isinstance(outcome, Cancelled), outcome
        for gi, group in enumerate(plan.local_view.groups):
            peer_ordinals = set(plan.peer_view.groups[gi].ordinals.tolist())
            expected = np.array([o in peer_ordinals for o in group.ordinals.tolist()], dtype=np.bool_)
            assert np.array_equal(outcome.masks[gi], expected), (outcome.masks[gi], expected)
        _check_masks_honest(pair, plan, False, outcome, plan.local_view)
    finally:
        pair.close()


def check_only_requested_rows_move(make_pair: PairFactory, mode: TransferMode) -> None:
    """A fetcher that already holds a prefix asks for the rest; its prefix rows stay untouched."""
    pair = make_pair(mode)
    try:
        plan = _plan(pair, "rest", rows=12, seed=9, local_missing=5)
        _fill(pair, plan, False)
        outcome, peer_outcome = _finish(pair, _start(pair, plan, "fetch"))
        assert all(m.all() for m in outcome.masks), outcome
        for name, region, _ in _groups(pair):
            dst = _dest_rows(pair, plan, False, name)
            src = _source_rows(plan, name, region.slot_bytes)
            assert dst[5:] == src[5:]
            assert all(row == bytes([0xA5]) * region.slot_bytes for row in dst[:5]), "held prefix rows were written"
        assert peer_outcome is not None
        for gi in range(len(plan.peer_view.groups)):
            assert peer_outcome.masks[gi][:5].sum() == 0 and peer_outcome.masks[gi][5:].all()
    finally:
        pair.close()


def check_partial_failure_exact(make_pair: PairFactory, mode: TransferMode) -> None:
    """A fault after k rows: Failed, exactly k rows True, each of them byte-exact. (Over a store
    the two ends' outcomes are their own: a fault while fetching leaves the publish Delivered.)"""
    k = 7
    for local_op, local_is_source in _roles():
        pair = make_pair(mode)
        try:
            # The active end (the one that moves bytes) is the one whose fault matters.
            local_active = (local_op == "publish") == (mode is TransferMode.PUSH)
            if local_active:
                if pair.inject_local_fault is None:
                    continue
                pair.inject_local_fault(k)
            elif not pair.peer.inject_fault(k):
                continue
            plan = _plan(pair, f"fault-{local_op}", rows=10, seed=10)
            _fill(pair, plan, local_is_source)
            outcome, peer_outcome = _finish(pair, _start(pair, plan, local_op))
            if not pair.peer_hears and (local_op == "fetch") == local_active:
                # A store's publisher stored every row; only the fetch with the fault failed.
                outcome, peer_outcome = (peer_outcome, outcome) if local_active else (outcome, peer_outcome)
                assert isinstance(outcome, Delivered) and outcome.all_delivered, outcome
                assert isinstance(peer_outcome, Failed) and peer_outcome.rows_delivered == k, peer_outcome
                _check_masks_honest(pair, plan, local_is_source, peer_outcome,
                                    plan.local_view if local_active else plan.peer_view)
                continue
            assert isinstance(outcome, Failed), outcome
            assert outcome.rows_delivered == k, f"{outcome.rows_delivered} rows delivered, expected {k}"
            assert isinstance(peer_outcome, Failed) and peer_outcome.rows_delivered == k, peer_outcome
            _check_masks_honest(pair, plan, local_is_source, outcome, plan.local_view)
            _check_masks_honest(pair, plan, local_is_source, peer_outcome, plan.peer_view)
        finally:
            pair.close()


def check_cancel(make_pair: PairFactory, mode: TransferMode) -> None:
    """cancel() ends in Cancelled (or an outcome already set), honest masks, then quiescence."""
    for local_op, local_is_source in _roles():
        pair = make_pair(mode)
        try:
            plan = _plan(pair, f"cancel-{local_op}", rows=16, seed=11)
            _fill(pair, plan, local_is_source)
            run = _start(pair, plan, local_op)
            before = run.local_attempt.poll()
            run.local_attempt.cancel()
            outcome, _ = _finish(pair, run)
            if before is None:
                assert isinstance(outcome, (Cancelled, Delivered)), outcome
            else:
                assert outcome is before
            _check_masks_honest(pair, plan, local_is_source, outcome, plan.local_view)
        finally:
            pair.close()


def check_cancel_before_peer_starts(make_pair: PairFactory, mode: TransferMode) -> None:
    """Cancelling a wait whose peer never submitted concludes Cancelled, and the peer's later
    submission of that transfer is refused or ends without writing the cancelled rows."""
    pair = make_pair(mode)
    try:
        plan = _plan(pair, "early-cancel", rows=6, seed=12)
        _fill(pair, plan, False)
        local_hint = pair.local.describe(plan.local_view)
        peer_hint = pair.peer.describe(plan.peer_view)
        waker = _Waker()
        attempt = pair.local.fetch(plan.local_view, peer_hint, waker)
        waker.bind(attempt)
        attempt.cancel()
        end = time.monotonic() + TIMEOUT
        while attempt.poll() is None and time.monotonic() < end:
            time.sleep(0.001)
        outcome = attempt.poll()
        assert isinstance(outcome, (Cancelled, Delivered, Failed)), outcome
        if mode is TransferMode.PUSH:
            # Passive, and its peer never published: nothing can have arrived, so the only
            # honest end is Cancelled (a deadline's Failed would mean cancel did nothing).
            assert isinstance(outcome, Cancelled), f"a cancelled wait whose peer never published ended {outcome!r}"
        if isinstance(outcome, Cancelled):
            assert outcome.rows_delivered == 0 or mode is TransferMode.PULL
        if mode is TransferMode.PUSH and isinstance(outcome, Cancelled):
            # Usually the withdrawal reaches the peer first and its publish is refused or writes
            # nothing. A peer that publishes before the withdrawal reaches it (a loaded machine)
            # may still write: the rule is that it never writes once the wait says it quiesced,
            # for only then may the rows be reused.
            time.sleep(0.2)
            before = {n: pair.local_memory.read(lr.name, plan.local_slots[n]) for n, lr, _ in _groups(pair)}
            quiesced_before = attempt.quiesced()
            try:
                handle = pair.peer.start("publish", plan.peer_view, local_hint)
            except InvalidSubmission:
                pass
            else:
                pair.peer.result(handle, TIMEOUT)
                after = {n: pair.local_memory.read(lr.name, plan.local_slots[n]) for n, lr, _ in _groups(pair)}
                assert after == before or not quiesced_before, \
                    "peer wrote rows of a cancelled transfer after the fetcher's wait said it had quiesced"
        end = time.monotonic() + TIMEOUT
        while not attempt.quiesced() and time.monotonic() < end:
            time.sleep(0.001)
        assert attempt.quiesced(), "cancelled wait never quiesced"
    finally:
        pair.close()


def check_shutdown(make_pair: PairFactory, mode: TransferMode) -> None:
    """shutdown() returns exactly the attempts not proven quiesced; later submissions are rejected."""
    pair = make_pair(mode)
    try:
        plan = _plan(pair, "shutdown-done", rows=4, seed=13)
        _fill(pair, plan, False)
        done_run = _start(pair, plan, "fetch")
        _finish(pair, done_run)
        waiting_plan = _plan(pair, "shutdown-waiting", rows=4, seed=14)
        pair.local.describe(waiting_plan.local_view)
        peer_hint = pair.peer.describe(waiting_plan.peer_view)
        waiting = pair.local.fetch(waiting_plan.local_view, peer_hint)  # the peer never publishes
        unquiesced = pair.local.shutdown()
        attempts = {done_run.local_attempt, waiting}
        assert unquiesced <= attempts
        assert done_run.local_attempt not in unquiesced
        assert unquiesced == {a for a in attempts if not a.quiesced()}, (unquiesced, attempts)
        assert waiting.poll() is not None, "shutdown left an attempt without an outcome"
        for call in (lambda: pair.local.describe(plan.local_view),
                     lambda: pair.local.fetch(plan.local_view, peer_hint),
                     lambda: pair.local.publish(plan.local_view, peer_hint)):
            try:
                call()
            except SubmissionRejected:
                continue
            raise AssertionError("a call after shutdown() did not raise SubmissionRejected")
    finally:
        pair.close()
