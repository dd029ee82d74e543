"""The kit's refusal and hint checks fail on loopback backends that break those rules (the
real backends pass them: tests/unit/test_*_conformance.py, tests/twoproc/)."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import numpy as np
import pytest

from kvxfer.backends.common.attempt import TrackedAttempt
from kvxfer.backends.loopback import LoopbackBackend
from kvxfer.contract import (
    CompletionRecord,
    Hint,
    InvalidSubmission,
    Peer,
    RecordStatus,
    SlotRegion,
    TransferMode,
    View,
    WakeFn,
)
from kvxfer.testing import conformance
from kvxfer.testing.pairs import loopback_pair

MODES = pytest.mark.parametrize("mode", list(TransferMode), ids=lambda m: m.value)


class _TellsPeerOnRefusal(LoopbackBackend):
    """Refuses what it should, but first sends the peer a FAILED record for the transfer:
    the peer's wait then ends although the submission 'let nothing escape'."""

    def _submit(self, view: View, hint: Hint, wake: WakeFn | None, *, fetching: bool) -> TrackedAttempt:
        try:
            return super()._submit(view, hint, wake, fetching=fetching)
        except InvalidSubmission as exc:
            masks = [np.zeros(g.ordinals.size, dtype=np.bool_) for g in hint.groups]
            self._fabric.deliver(hint.agent, CompletionRecord(
                hint.transfer_id, self.name, view.request, RecordStatus.FAILED, masks, f"refused: {exc}"))
            raise


class _ForgetsUsedHints(LoopbackBackend):
    """Keeps no record of the peers' hints it has acted on, so a replay moves bytes again."""

    def _submit(self, view: View, hint: Hint, wake: WakeFn | None, *, fetching: bool) -> TrackedAttempt:
        self._own._used.clear()
        return super()._submit(view, hint, wake, fetching=fetching)


class _TakesAnyHint(LoopbackBackend):
    """Uses a hint whoever it is bound to and however old: the replay hole of a decode hint."""

    def _submit(self, view: View, hint: Hint, wake: WakeFn | None, *, fetching: bool) -> TrackedAttempt:
        self._own.check_for_us = lambda hint: None  # type: ignore[method-assign]
        return super()._submit(view, hint, wake, fetching=fetching)


class _DescribesOverlaps(LoopbackBackend):
    """Checks a described view as a source only: a hint exposes rows that name one slot twice."""

    def describe(self, view: View, audience: Peer | None = None) -> Hint:
        check_view = self._regions.check_view
        self._regions.check_view = lambda view, for_fetch: check_view(view, for_fetch=False)  # type: ignore[method-assign]
        try:
            return super().describe(view, audience)
        finally:
            self._regions.check_view = check_view  # type: ignore[method-assign]


class _RefusesMixedKinds(LoopbackBackend):
    """Refuses a whole batch for one region of a kind it cannot reach (kvxfer's old register)."""

    def register(self, regions: Iterable[SlotRegion]) -> tuple[SlotRegion, ...]:
        self._regions.add(regions)
        return ()


def _broken(cls: type[LoopbackBackend]) -> Callable[[TransferMode], conformance.Pair]:
    def factory(mode: TransferMode) -> conformance.Pair:
        pair = loopback_pair(mode)
        pair.local.__class__ = cls
        return pair
    return factory


@MODES
@pytest.mark.parametrize("check", [conformance.check_layout_mismatch_refused, conformance.check_unknown_slot_refused,
                                   conformance.check_unregistered_region_refused],
                         ids=lambda c: c.__name__)
def test_kit_catches_a_refusal_that_tells_the_peer(check, mode):  # type: ignore[no-untyped-def]
    with pytest.raises(AssertionError, match="told the peer"):
        check(_broken(_TellsPeerOnRefusal), mode)


@MODES
def test_kit_catches_a_reused_hint(mode: TransferMode) -> None:
    with pytest.raises(AssertionError, match="of a replayed hint returned"):
        conformance.check_hint_used_once(_broken(_ForgetsUsedHints), mode)


@MODES
def test_kit_catches_a_hint_taken_from_anyone(mode: TransferMode) -> None:
    with pytest.raises(AssertionError, match="of a hint bound to another peer returned"):
        conformance.check_hint_only_for_its_audience(_broken(_TakesAnyHint), mode)


@MODES
def test_kit_catches_a_described_overlap(mode: TransferMode) -> None:
    with pytest.raises(AssertionError, match="describe\\(\\) of a view with overlapping rows returned a hint"):
        conformance.check_describe_refuses_what_a_submission_would(_broken(_DescribesOverlaps), mode)


@MODES
def test_kit_catches_a_register_that_refuses_a_mixed_batch(mode: TransferMode) -> None:
    with pytest.raises(InvalidSubmission, match="DEVICE memory, which this backend cannot reach"):
        conformance.check_register_skips_unreachable_kinds(_broken(_RefusesMixedKinds), mode)


@MODES
def test_broken_backends_pass_what_they_do_not_break(mode: TransferMode) -> None:
    # Each failure above comes from the rule broken, not from a pair the subclass cannot run.
    conformance.check_round_trip_exact(_broken(_TellsPeerOnRefusal), mode)
    conformance.check_hint_used_once(_broken(_TellsPeerOnRefusal), mode)
    conformance.check_layout_mismatch_refused(_broken(_ForgetsUsedHints), mode)
    conformance.check_hint_used_once(_broken(_TakesAnyHint), mode)
