"""The lender checks: the rules a lease holder relies on, kept alike by every lender.

Each check is ``check_x(make_rig)``, where ``make_rig()`` returns a fresh ``LenderRig``
(``kvxfer.testing.conformance.lender_rigs``: the pool lenders and ``ExternalLender`` have
one each). ``LENDER_CHECKS`` lists them::

    @pytest.mark.parametrize("check", LENDER_CHECKS, ids=lambda c: c.__name__)
    @pytest.mark.parametrize("kind", RIG_KINDS)
    def test_lender_conformance(check, kind):
        check(lambda: make_rig(kind))

The rules: arrival is reported once, before release, as bool masks (``[1, 1, 0]`` is not a
mask) and is refused by name otherwise, counting nothing; a block a transfer may still touch
is not reused when its owner frees it, and comes back once the transfer quiesced; a block
shared by prefix with another request is never lent for writing; one lender per memory;
shutdown refuses while leases hold memory, and a forced one reports what stays retained,
which never comes back.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np

from kvxfer.backends.common.attempt import TrackedAttempt
from kvxfer.contract import Failed, InvalidSubmission
from kvxfer.lender import AlreadyLent, LeaseError, LenderBusy, LendingDisabled
from kvxfer.testing.conformance.lender_rigs import BLOCK_TOKENS, LenderRig

RigFactory = Callable[[], LenderRig]


def _rows(lease: Any) -> int:
    view = lease.view()
    assert view is not None, f"{lease!r} has no view: the rig's lender should grant it at once"
    assert len(view.groups) == 1, f"the rigs lend one group, {lease!r}'s view has {len(view.groups)}"
    return len(view.groups[0])


def _refused(kind: type[Exception], call: Callable[[], Any], *needles: str) -> str:
    try:
        call()
    except kind as exc:
        text = str(exc)
        for needle in needles:
            assert needle in text, f"{type(exc).__name__} {text!r} does not say {needle!r}"
        return text
    except Exception as exc:  # noqa: BLE001 - any other error is the finding
        raise AssertionError(f"expected {kind.__name__}, got {type(exc).__name__}: {exc}") from exc
    raise AssertionError(f"expected {kind.__name__}, the call was accepted")


def _quiesce(attempt: TrackedAttempt, rows: int) -> None:
    attempt.conclude(Failed("the check ended it", [np.zeros(rows, dtype=np.bool_)]))
    attempt.mark_quiesced()


def check_bool_masks_only(make_rig: RigFactory) -> None:
    """A mask of ints, floats or Python bools is refused (InvalidSubmission naming the lease
    and the mask) and counts nothing; the lease then takes its one bool report."""
    rig = make_rig()
    lease = rig.lend_write("w", 3)
    n = _rows(lease)
    bad_masks: list[Any] = [[1] * n, [True] * n, np.ones(n, dtype=np.int64), np.array([1.0] * n, dtype=np.float32)]
    for bad in bad_masks:
        text = _refused(InvalidSubmission, partial(lease.mark_arrived, [bad]), f"{lease!r}: malformed masks: mask 0")
        assert "bool" in text, text
        assert rig.usable("w", lease) == 0, f"a refused mask {bad!r} counted arrival"
    _refused(InvalidSubmission, lambda: lease.mark_arrived(np.ones((1, n), dtype=np.bool_)), "malformed masks")
    _refused(InvalidSubmission, lambda: lease.mark_arrived([np.ones(n + 1, dtype=np.bool_)]), "malformed masks")
    mask = np.zeros(n, dtype=np.bool_)
    mask[:2] = True
    lease.mark_arrived([mask])
    assert rig.usable("w", lease) == 2 * BLOCK_TOKENS, "the bool report after refusals was not counted exactly"
    lease.release()


def check_marks_once_before_release_on_write_leases(make_rig: RigFactory) -> None:
    """A second report, a report after release, and a report on a read lease are refused by
    name (LeaseError) and count nothing."""
    rig = make_rig()
    rig.commit("a", 2)
    read = rig.lend_read("a", 2)
    _refused(LeaseError, lambda: read.mark_arrived([np.ones(_rows(read), dtype=np.bool_)]), "read lease")
    read.release()
    once = rig.lend_write("once", 2)
    none = np.zeros(_rows(once), dtype=np.bool_)
    once.mark_arrived([none])
    _refused(LeaseError, lambda: once.mark_arrived([~none]), "already called")
    assert rig.usable("once", once) == 0, "a second report was counted"
    once.release()
    late = rig.lend_write("late", 2)
    every = np.ones(_rows(late), dtype=np.bool_)
    late.release()
    _refused(LeaseError, lambda: late.mark_arrived([every]), "released", "before release")
    assert rig.usable("late", late) == 0, "a report after release was counted"


def check_freed_blocks_wait_for_quiescence(make_rig: RigFactory) -> None:
    """The owner frees a request whose released lease's attempt has not quiesced: its blocks
    are not reused until the attempt quiesced, then they come back."""
    rig = make_rig()
    lease = rig.lend_write("w", 3)
    blocks = rig.blocks_of("w")
    attempt = TrackedAttempt(label="conformance")
    lease.track(attempt)
    lease.release()
    rig.free("w")
    rig.reclaim()
    assert not rig.reusable(blocks).any(), "blocks a transfer may still write were handed out again"
    _quiesce(attempt, _rows(lease))
    rig.reclaim()
    assert rig.reusable(blocks).all(), "blocks whose transfer quiesced did not come back"


def check_freed_under_an_open_lease(make_rig: RigFactory) -> None:
    """The owner frees a request while its write lease is open: the blocks stay out of use
    until the lease is released and its attempt quiesced; its report counts nothing."""
    rig = make_rig()
    lease = rig.lend_write("w", 2)
    blocks = rig.blocks_of("w")
    attempt = TrackedAttempt(label="conformance")
    lease.track(attempt)
    rig.free("w")
    rig.reclaim()
    assert not rig.reusable(blocks).any(), "blocks of an open lease were handed out again"
    _quiesce(attempt, _rows(lease))
    lease.mark_arrived([np.ones(_rows(lease), dtype=np.bool_)])
    assert rig.usable("w", lease) == 0, "arrival into freed blocks was counted"
    rig.reclaim()
    assert not rig.reusable(blocks).any(), "blocks of a lease still open were handed out again"
    lease.release()
    rig.reclaim()
    assert rig.reusable(blocks).all(), "blocks did not come back after release and quiescence"


def check_shared_prefix_never_lent_for_writing(make_rig: RigFactory) -> None:
    """A block shared by prefix with another request is never in a write lease's view:
    lending it is refused by name (touching nothing), or the lease leaves it out."""
    rig = make_rig()
    rig.commit("donor", 2)
    shared = rig.blocks_of("donor")[:1]
    try:
        lease = rig.lend_write_shared("w", "donor", 3)
    except LeaseError as exc:
        assert "shared" in str(exc), f"the refusal {exc} does not say the blocks are shared"
        # Nothing was pinned: the donor's blocks can still be lent for reading.
        read = rig.lend_read("donor", 2)
        read.release()
        return
    view = lease.view()
    assert view is not None
    assert 0 not in view.groups[0].ordinals.tolist(), "the shared first block was lent for writing"
    assert not np.isin(shared, rig.blocks_of("w")[view.groups[0].ordinals]).any()
    lease.release()


def check_one_lender_per_memory(make_rig: RigFactory) -> None:
    """A second lender over the same memory is refused (AlreadyLent); once the first shut
    down, a new one is accepted."""
    rig = make_rig()
    _refused(AlreadyLent, rig.new_lender, "lent already", repr(rig.lender))
    assert not rig.lender.shutdown().retained_anything
    rig.lender = rig.new_lender()
    _refused(AlreadyLent, rig.new_lender, "lent already")


def check_shutdown_reports_what_stays_retained(make_rig: RigFactory) -> None:
    """Shutdown with a lease open is refused (LenderBusy); forced, it reports the lease's
    blocks as retained, refuses lending and reports (LendingDisabled), and those blocks
    never come back, even once the owner frees them."""
    rig = make_rig()
    lease = rig.lend_write("w", 2)
    blocks = rig.blocks_of("w")
    _refused(LenderBusy, rig.lender.shutdown, "1 leases open")
    report = rig.lender.shutdown(force=True)
    assert report.open_leases == 1 and report.retained_anything, f"a forced shutdown retained nothing: {report}"
    retained = np.unique(np.concatenate(list(report.retained_blocks.values())))
    assert retained.tolist() == np.unique(blocks).tolist(), f"retained {retained}, the lease held {blocks}"
    _refused(LendingDisabled, lambda: rig.lend_write("after", 1), "shut down")
    _refused(LendingDisabled, lambda: lease.mark_arrived([np.ones(_rows(lease), dtype=np.bool_)]), "shut down")
    lease.release()
    rig.free("w")
    rig.reclaim()
    assert not rig.reusable(blocks).any(), "blocks a forced shutdown retained came back"


LENDER_CHECKS: tuple[Callable[[RigFactory], None], ...] = (
    check_bool_masks_only,
    check_marks_once_before_release_on_write_leases,
    check_freed_blocks_wait_for_quiescence,
    check_freed_under_an_open_lease,
    check_shared_prefix_never_lent_for_writing,
    check_one_lender_per_memory,
    check_shutdown_reports_what_stays_retained,
)
