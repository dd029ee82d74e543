"""What every refusal must keep: nothing written, nothing told, nothing left behind."""

from __future__ import annotations

import time

from kvxfer.contract import Cancelled, Hint, InvalidSubmission, TransferMode, View
from kvxfer.testing.conformance.pair import REFUSAL_GRACE, TIMEOUT, Pair
from kvxfer.testing.conformance.transfers import _fill, _finish, _groups, _Plan, _plan, _start, _Waker


def _expect_refusal(pair: Pair, plan: _Plan, local_op: str, local_is_source: bool, view: View, hint: Hint,
                    what: str = "a bad submission", warm: bool = True, peer_waits: bool = True,
                    match: str | None = None) -> None:
    """``local_op`` of ``view`` with ``hint`` raises InvalidSubmission and lets nothing escape:
    no row at either end changes, wake never runs, no attempt is left behind, and the peer is
    told nothing. The last is only observable while the peer has an attempt for this
    transfer running, so when the local end is the active one the peer's passive attempt (its
    fetch in push, its publish in pull) waits during the refusal and must not conclude. (When
    the local end is passive the peer would be the active end, which moves bytes whatever
    this end does; it is not started.) ``warm=False``: the ends have moved rows together
    already, and the caller's rows are kept as they are. ``peer_waits=False``: the peer has
    no attempt it could wait with (its own view does not meet ``view`` either), so that the
    peer heard nothing is not observed; the rest is checked the same."""
    local_active = (local_op == "publish") == (pair.mode is TransferMode.PUSH)
    peer_op = "fetch" if local_op == "publish" else "publish"
    if local_active and warm:
        _introduce(pair, plan, local_op, local_is_source)
    before = _rows_at_both_ends(pair, plan)
    waits = local_active and peer_waits and pair.peer_hears
    handle = pair.peer.start(peer_op, plan.peer_view, pair.local.describe(plan.local_view)) if waits else None
    waker = _submit_refused(pair, local_op, view, hint, what, match)
    if handle is None:
        time.sleep(0.05)
    else:
        # Anything the refusing end sent about this transfer would reach the waiting peer well
        # within the grace (the other checks see whole transfers conclude in less).
        told, _ = pair.peer.result(handle, REFUSAL_GRACE)
        assert told is None, f"refusing {what} told the peer: its waiting {peer_op} concluded {told!r}"
    assert not waker.seen, "a refused submission called wake"
    _assert_rows_kept(pair, plan, before, what, "just after the refusal")
    if handle is not None:
        _withdraw_peer_wait(pair, handle, peer_op)
    # Whatever a backend might still do later, it has done once it has shut down.
    assert pair.local.shutdown() == frozenset(), "a refused submission left an attempt behind"
    _assert_rows_kept(pair, plan, before, what, "once this end shut down")
    assert not waker.seen, "a refused submission called wake"


def _introduce(pair: Pair, plan: _Plan, local_op: str, local_is_source: bool) -> None:
    """A transfer first, so that the two ends know each other: an end that has never
    reached its peer could not tell it anything, nor answer its withdrawal (a NIXL end
    answers only peers whose metadata it loaded). ``plan``'s rows are filled again after."""
    earlier = _plan(pair, f"{plan.local_view.request}-warm", rows=4, seed=99)
    _fill(pair, earlier, local_is_source)
    _finish(pair, _start(pair, earlier, local_op))
    _fill(pair, plan, local_is_source)


_Rows = tuple[dict[str, bytes], dict[str, bytes]]  # per group: the plan's rows at the local end, at the peer


def _rows_at_both_ends(pair: Pair, plan: _Plan) -> _Rows:
    return ({n: pair.local_memory.read(lr.name, plan.local_slots[n]) for n, lr, _ in _groups(pair)},
            {n: pair.peer.read(pr.name, plan.peer_slots[n]) for n, _, pr in _groups(pair)})


def _assert_rows_kept(pair: Pair, plan: _Plan, before: _Rows, what: str, when: str) -> None:
    before_local, before_peer = before
    for n, lr, pr in _groups(pair):
        assert pair.local_memory.read(lr.name, plan.local_slots[n]) == before_local[n], \
            f"refusal of {what} touched local rows ({when})"
        assert pair.peer.read(pr.name, plan.peer_slots[n]) == before_peer[n], \
            f"refusal of {what} touched peer rows ({when})"


def _submit_refused(pair: Pair, local_op: str, view: View, hint: Hint, what: str, match: str | None = None) -> _Waker:
    """Submit ``view`` at the local end, which must raise InvalidSubmission (naming ``match``
    when given: refused for the right reason); the wake callback given."""
    try:
        pair.local.describe(view)
    except InvalidSubmission:
        pass  # a backend may refuse to describe rows it does not recognize, too
    submit = pair.local.fetch if local_op == "fetch" else pair.local.publish
    waker = _Waker()
    try:
        attempt = submit(view, hint, waker)
    except InvalidSubmission as exc:
        assert match is None or match in str(exc), f"{local_op} of {what} was refused for another reason: {exc}"
        return waker
    raise AssertionError(f"{local_op} of {what} returned {attempt!r} instead of raising InvalidSubmission")


def _withdraw_peer_wait(pair: Pair, handle: int, peer_op: str) -> None:
    """Withdrawn while this end is up to answer, so that the check ends quiesced; withdrawn
    by the peer itself, so any other ending came from the refusing end."""
    pair.peer.cancel(handle)
    outcome, quiet = pair.peer.result(handle, TIMEOUT)
    assert outcome is not None and quiet, "the peer's withdrawn wait did not conclude and quiesce"
    assert isinstance(outcome, Cancelled) and not outcome.by_peer, \
        f"the peer's withdrawn {peer_op} ended {outcome!r}: the refusing end told it something"
