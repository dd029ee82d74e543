"""The runs both ends of a ucx transfer number alike, and how packed messages split."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvxfer.backends.common.matching import match_rows
from kvxfer.backends.common.transfers import hint_groups
from kvxfer.backends.ucx.packing import split
from kvxfer.backends.ucx.runs import plan_runs
from kvxfer.contract import CacheKind, Hint, LayerGroupRows, MemoryKind, SlotRegion, TokenRange, TransferMode, View


def _view(name: str, slots: np.ndarray, ordinals: np.ndarray, slot_bytes: int = 64) -> View:
    region = SlotRegion(name, 1 << 20, slot_bytes, 4096, MemoryKind.HOST, 0)
    group = LayerGroupRows("g", CacheKind.PAGED, region, slots.astype(np.int64), ordinals.astype(np.int64))
    return View("r", TokenRange(0, 16 * len(slots)), (group,), b"L")


def _hint(view: View) -> Hint:
    return Hint(backend="ucx", mode=TransferMode.PUSH, agent="peer", request="r", transfer_id="t",
                layout=b"L", groups=hint_groups(view), expires_ms=1)


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_both_ends_number_the_same_runs(data: st.DataObject) -> None:
    n = data.draw(st.integers(1, 200))
    a = np.array(data.draw(st.permutations(range(400)))[:n])
    b = np.array(data.draw(st.permutations(range(400)))[:n])
    ordinals = np.array(data.draw(st.permutations(range(n))))
    mine, theirs = _view("A", a, ordinals), _view("B", b, ordinals)
    sender = plan_runs(mine, _hint(theirs), match_rows(mine, _hint(theirs)), pack_bytes=1 << 14)
    receiver = plan_runs(theirs, _hint(mine), match_rows(theirs, _hint(mine)), pack_bytes=1 << 14)
    assert np.array_equal(sender.lengths, receiver.lengths)
    assert np.array_equal(sender.chunk_end, receiver.chunk_end)
    assert np.array_equal(sender.local_rows, receiver.peer_rows) and np.array_equal(sender.peer_rows, receiver.local_rows)
    # Every run is consecutive slots at both ends, and every matched row is in exactly one run.
    assert sender.rows == n and sorted(sender.local_rows.tolist()) == list(range(n))


def test_a_message_splits_into_whole_rows_of_its_runs_in_order() -> None:
    slots = np.array([0, 1, 5, 6, 7, 20])
    view = _view("A", slots, np.arange(6))
    plan = plan_runs(view, _hint(_view("B", slots, np.arange(6))), match_rows(view, _hint(_view("B", slots, np.arange(6)))),
                     pack_bytes=1 << 20)
    assert plan.lengths.tolist() == [2, 3, 1] and plan.chunk_end.tolist() == [3, -1, -1]
    assert split(plan, 0, 3, 6 * 64).tolist() == [2, 3, 1]
    assert split(plan, 0, 3, 3 * 64).tolist() == [2, 1, 0]  # a message cut after 3 rows (an injected fault)
    assert split(plan, 0, 3, 3 * 64 + 10) is None  # ends inside a row
    assert split(plan, 0, 3, 7 * 64) is None  # runs past the runs
    assert split(plan, 0, 3, 0) is None


def test_a_pull_request_round_trips_and_a_forged_one_is_refused_when_a_key_is_set() -> None:
    from kvxfer.backends.ucx.control import PullRequest, decode_pull, encode_pull

    request = PullRequest("3f" * 12, "decode-0", 7)
    key = bytes(range(32))
    assert decode_pull(encode_pull(request, b"")[1:], b"") == request
    assert decode_pull(encode_pull(request, key)[1:], key) == request
    assert decode_pull(encode_pull(PullRequest("ab", "d", None), key)[1:], key) == PullRequest("ab", "d", None)
    assert decode_pull(encode_pull(request, b"")[1:], key) is None  # unsigned, while we hold a key
    assert decode_pull(encode_pull(request, bytes(32))[1:], key) is None  # signed by another key
    forged = bytearray(encode_pull(request, key)[1:])
    forged[0] ^= 1  # the limit changed in transit
    assert decode_pull(bytes(forged), key) is None
    assert decode_pull(b"\x01", b"") is None  # malformed


def test_received_rows_are_the_first_rows_of_each_run_at_both_ends() -> None:
    mine = _view("A", np.array([0, 1, 5, 6, 7, 20]), np.arange(6))
    theirs = _view("B", np.array([15, 14, 13, 12, 11, 10]), np.array([5, 4, 3, 2, 1, 0]))
    plan = plan_runs(mine, _hint(theirs), match_rows(mine, _hint(theirs)))
    assert plan.lengths.tolist() == [2, 3, 1]  # consecutive at both ends: ordinals 0-1, 2-4, 5
    counts = np.array([2, 1, 0], dtype=np.int64)  # run 1 stopped after one row, run 2 never came
    assert [m.tolist() for m in plan.local_masks(mine, counts)] == [[True, True, True, False, False, False]]
    # The peer's rows of ordinals 0, 1, 2 sit at its rows 5, 4, 3.
    assert [m.tolist() for m in plan.peer_masks(_hint(theirs), counts)] == [[False, False, False, True, True, True]]
    assert plan.rows_per_run(mine, plan.local_masks(mine, counts)).tolist() == counts.tolist()
    whole = plan.local_masks(mine, plan.lengths)
    assert whole[0].all() and not whole[0].flags.writeable


def test_an_acknowledgement_of_the_wrong_shape_fails_the_publisher_with_no_row_proven() -> None:
    from kvxfer.backends.common.attempt import TrackedAttempt
    from kvxfer.backends.ucx.jobs import Sending, acknowledged
    from kvxfer.contract import CompletionRecord, Failed, RecordStatus

    mine, theirs = _view("A", np.arange(4), np.arange(4)), _view("B", np.arange(4), np.arange(4))
    plan = plan_runs(mine, _hint(theirs), match_rows(mine, _hint(theirs)))
    job = Sending(TrackedAttempt(), mine, _hint(theirs), "me", plan, plan.lengths.copy(), 1, 0.0, True)
    record = CompletionRecord("t", "peer", "r", RecordStatus.DELIVERED, (np.ones(3, dtype=np.bool_),))
    outcome = acknowledged(job, record)
    assert isinstance(outcome, Failed) and "wrong shape" in outcome.reason
    assert [m.tolist() for m in outcome.masks] == [[False] * 4]
