"""Region table, row matching and run coalescing shared by every backend."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import kvxfer.backends.common.transfers as transfers
from kvxfer.backends.common.attempt import TrackedAttempt
from kvxfer.backends.common.matching import check_agreement, coalesce, match_rows, proven_mask
from kvxfer.backends.common.regions import RegionTable
from kvxfer.backends.common.transfers import OwnTransfers, hint_groups
from kvxfer.contract import (
    CacheKind,
    Hint,
    InvalidSubmission,
    LayerGroupRows,
    MemoryKind,
    Peer,
    SlotRegion,
    SubmissionRejected,
    TokenRange,
    TransferMode,
    View,
    constant_mask,
)

HOST = frozenset({MemoryKind.HOST})


def reg(name: str, address: int, slots: int = 10, slot_bytes: int = 16, kind: MemoryKind = MemoryKind.HOST) -> SlotRegion:
    return SlotRegion(name, address, slot_bytes, slots, kind)


class TestRegionTable:
    def test_refuses_unreachable_kind(self) -> None:
        with pytest.raises(InvalidSubmission, match="DEVICE memory"):
            RegionTable(HOST).add([reg("d", 0, kind=MemoryKind.DEVICE)])

    def test_refuses_overlap_within_batch_and_with_registered(self) -> None:
        table = RegionTable(HOST)
        table.add([reg("a", 0)])
        with pytest.raises(InvalidSubmission, match="overlaps"):
            table.add([reg("b", 100)])
        with pytest.raises(InvalidSubmission, match="overlaps"):
            table.add([reg("c", 1000), reg("d", 1100)])
        assert {r.name for r in table} == {"a"}  # a refused batch registers nothing

    def test_same_name_other_span_refused(self) -> None:
        table = RegionTable(HOST)
        table.add([reg("a", 0)])
        table.add([reg("a", 0)])  # idempotent
        with pytest.raises(InvalidSubmission, match="already registered"):
            table.add([reg("a", 4096)])

    def test_check_view(self) -> None:
        table = RegionTable(HOST)
        a = reg("a", 0)
        table.add([a])

        def view(slots: list[int], ordinals: list[int], region: SlotRegion = a) -> View:
            return View("q", TokenRange(0, 16), (LayerGroupRows("g", CacheKind.PAGED, region, slots, ordinals),))

        table.check_view(view([1, 2], [0, 1]), for_fetch=True)
        with pytest.raises(InvalidSubmission, match="not registered"):
            table.check_view(view([1], [0], reg("x", 5000)), for_fetch=False)
        with pytest.raises(InvalidSubmission, match="not registered"):  # the registered name, another span
            table.check_view(view([1], [0], reg("a", 5000)), for_fetch=False)
        table.check_view(view([1], [0], reg("a", 0)), for_fetch=False)  # an equal region, not the same object
        with pytest.raises(InvalidSubmission, match="outside"):
            table.check_view(view([10], [0]), for_fetch=False)
        with pytest.raises(InvalidSubmission, match="repeats an ordinal"):
            table.check_view(view([1, 2], [0, 0]), for_fetch=False)
        with pytest.raises(InvalidSubmission, match="overlapping"):
            table.check_view(view([3, 3], [0, 1]), for_fetch=True)
        table.check_view(view([3, 3], [0, 1]), for_fetch=False)  # reading a slot twice is harmless


def test_coalesce_runs_contiguous_on_both_ends() -> None:
    src = np.array([0, 1, 2, 7, 8, 3], dtype=np.int64)
    dst = np.array([5, 6, 9, 10, 11, 12], dtype=np.int64)
    s, d, n = coalesce(src, dst)
    assert s.tolist() == [0, 2, 7, 3] and d.tolist() == [5, 9, 10, 12] and n.tolist() == [2, 1, 2, 1]
    assert n.sum() == src.size
    empty = coalesce(np.zeros(0, np.int64), np.zeros(0, np.int64))
    assert all(x.size == 0 for x in empty)


def _view_and_hint(local_ordinals: list[int], peer_ordinals: list[int]) -> tuple[View, Hint]:
    a, b = reg("a", 0, 64), reg("b", 10_000, 64)
    local = View("q", TokenRange(0, 256), (
        LayerGroupRows("g", CacheKind.PAGED, a, np.arange(len(local_ordinals)) + 20, local_ordinals),
    ), b"L")
    peer_view = View("q", TokenRange(0, 256), (
        LayerGroupRows("g", CacheKind.PAGED, b, np.arange(len(peer_ordinals)) * 2, peer_ordinals),
    ), b"L")
    hint = Hint("loopback", TransferMode.PUSH, "peer", "q", "t", b"L", hint_groups(peer_view))
    return local, hint


def test_a_pool_row_is_proven_only_by_a_completed_part_that_carries_it() -> None:
    rows = np.array([3, 0, 2, 1], dtype=np.int64)  # a permutation of every row
    part = proven_mask(4, [rows[:2]])  # a fault budget stopped after two rows
    assert part.tolist() == [True, False, False, True]
    assert proven_mask(6, [np.array([4, 0]), np.array([2])]).tolist() == [True, False, True, False, True, False]
    assert proven_mask(3, []).tolist() == [False, False, False]
    # Proven whole, in any order and parts: one shared read-only array per size, which the
    # wire codec sends without its bits; a partial mask is the caller's own.
    whole = proven_mask(4, [rows])
    assert whole.all() and whole is proven_mask(4, [rows[2:], rows[:2]]) is constant_mask(4, True)
    assert part is not proven_mask(4, [rows[:2]])
    for mask in (whole, part):
        with pytest.raises(ValueError):
            mask[0] = not mask[0]
    with pytest.raises(ValueError):
        whole.flags.writeable = True  # nobody can turn the shared one back into a writable array


def test_match_by_ordinal_reports_unmatched() -> None:
    local, hint = _view_and_hint([0, 1, 2, 3, 4], [4, 2, 0, 9])
    (m,) = match_rows(local, hint)
    assert m.local_rows.tolist() == [0, 2, 4]
    assert m.peer_rows.tolist() == [2, 1, 0]
    assert m.peer_slots.tolist() == [4, 2, 0]
    assert m.local_slots.tolist() == [20, 22, 24]
    assert m.unmatched.tolist() == [1, 3]


def test_agreement_refusals_named() -> None:
    local, hint = _view_and_hint([0], [0])
    check_agreement(local, hint, "loopback", TransferMode.PUSH)
    with pytest.raises(InvalidSubmission, match="backend 'loopback'"):
        check_agreement(local, hint, "nixl", TransferMode.PUSH)
    with pytest.raises(InvalidSubmission, match="push mode"):
        check_agreement(local, hint, "loopback", TransferMode.PULL)
    other = View(local.request, local.tokens, local.groups, b"M")
    with pytest.raises(InvalidSubmission, match="layout mismatch"):
        check_agreement(other, hint, "loopback", TransferMode.PUSH)


def test_transfer_ids_fresh_and_consumed() -> None:
    own = OwnTransfers("me")
    local, _ = _view_and_hint([0], [0])
    with pytest.raises(InvalidSubmission, match="no describe"):
        own.lookup(local)
    first, second = own.mint(local), own.mint(local)
    assert first != second and own.lookup(local) == second
    own.consume(local, second)
    with pytest.raises(InvalidSubmission):
        own.lookup(local)
    own.retire(second)
    assert own.is_retired(second) and not own.is_retired(first)


def test_a_hint_is_used_only_by_its_audience_before_it_expires_and_once(monkeypatch: pytest.MonkeyPatch) -> None:
    own = OwnTransfers("me", ttl_s=30.0)
    _, unbound = _view_and_hint([0], [0])
    fresh = dataclasses.replace(unbound, expires_ms=transfers.wall_ms() + 30_000)
    cases = [
        (dataclasses.replace(fresh, audience=Peer("someone-else", "r1")), "bound to 'someone-else'"),
        (dataclasses.replace(fresh, audience=Peer("me", "an-earlier-run")), "bound to run an-earlier-run"),
        (dataclasses.replace(fresh, expires_ms=0), "carries no expiry"),
        (dataclasses.replace(fresh, expires_ms=transfers.wall_ms() - 1500), r"expired 1\.\ds ago"),
        (dataclasses.replace(fresh, expires_ms=transfers.wall_ms() + 7_200_000), "over the 3600s any hint may live"),
    ]
    for hint, words in cases:
        with pytest.raises(InvalidSubmission, match=words):
            _usable(own, hint)
    mine = dataclasses.replace(fresh, audience=own.peer)
    for hint in (mine, dataclasses.replace(fresh, transfer_id="t2")):  # bound to this run, or to nobody: once
        _usable(own, hint)
        own.use(hint, TrackedAttempt())
        with pytest.raises(InvalidSubmission, match="used already"):
            _usable(own, hint)
    # A used hint is remembered until it expires, however many others are used meanwhile;
    # then it is forgotten, and refused as expired instead.
    monkeypatch.setattr(transfers, "_RETIRED_KEPT", 2)
    for i in range(10):
        own.use(dataclasses.replace(fresh, transfer_id=f"other-{i}"), TrackedAttempt())
    with pytest.raises(InvalidSubmission, match="used already"):
        _usable(own, mine)
    monkeypatch.setattr(transfers, "wall_ms", lambda: fresh.expires_ms + 1)
    with pytest.raises(InvalidSubmission, match="expired"):
        _usable(own, mine)
    assert len(own._used) == 0


def test_hints_stop_being_remembered_only_by_refusing_more(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(transfers, "_USED_LIVE_CAP", 3)
    own = OwnTransfers("me")
    _, hint = _view_and_hint([0], [0])
    live = [dataclasses.replace(hint, transfer_id=f"t{i}", expires_ms=transfers.wall_ms() + 60_000) for i in range(4)]
    for h in live[:3]:
        _usable(own, h)
        own.use(h, TrackedAttempt())
    with pytest.raises(SubmissionRejected, match="have not expired yet"):
        _usable(own, live[3])
    with pytest.raises(InvalidSubmission, match="used already"):
        _usable(own, live[0])


def test_withdraw_says_whether_a_hint_can_still_reach_the_peers_rows() -> None:
    own = OwnTransfers("me")
    _, hint = _view_and_hint([0], [0])
    never, used = (dataclasses.replace(hint, transfer_id=t, expires_ms=transfers.wall_ms() + 60_000)
                   for t in ("never", "used"))
    # Never used here: nothing can reach the rows, and from now on it is refused as used.
    assert own.withdraw(never)
    with pytest.raises(InvalidSubmission, match="used already"):
        _usable(own, never)
    # Used by an attempt: not until that attempt has quiesced.
    attempt = TrackedAttempt()
    _usable(own, used)
    own.use(used, attempt)
    assert not own.withdraw(used)
    attempt.mark_quiesced()
    assert own.withdraw(used) and own.withdraw(used)


def test_used_hints_let_go_of_their_attempts_once_they_quiesced() -> None:
    # A used hint is remembered until it expires, but not its finished attempt (with its view):
    # a worker would otherwise keep every transfer's attempt for the hints' lifetime.
    own = OwnTransfers("me")
    _, hint = _view_and_hint([0], [0])
    attempts = []
    for i in range(300):
        h = dataclasses.replace(hint, transfer_id=f"t{i}", expires_ms=transfers.wall_ms() + 60_000)
        attempt = TrackedAttempt()
        _usable(own, h)
        own.use(h, attempt)
        attempt.mark_quiesced()
        attempts.append(attempt)
    held = sum(1 for _, a in own._used.values() if a is not None)
    assert len(own._used) == 300 and held <= 2, held
    running = TrackedAttempt()
    h = dataclasses.replace(hint, transfer_id="running", expires_ms=transfers.wall_ms() + 60_000)
    own.use(h, running)
    for i in range(10):  # an attempt still running is kept, however many uses pass
        own.use(dataclasses.replace(hint, transfer_id=f"u{i}", expires_ms=h.expires_ms), attempts[0])
    assert own._used[(h.agent, "running")][1] is running and not own.withdraw(h)


def _usable(own: OwnTransfers, hint: Hint) -> None:
    """What a backend's active end checks of a peer's hint, in its order."""
    own.check_for_us(hint)
    own.check_usable(hint)
