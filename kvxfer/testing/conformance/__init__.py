"""The conformance kit: checks that a backend keeps the rules of DESIGN.md §3.

Give it a factory for a connected pair: the backend under test (``local``, driven by the
kit in this process) and the other end (``peer``, a :class:`PeerEnd`, which may live in
another process). Each check is a function ``check_x(make_pair, mode)``; ``CHECKS`` lists
them for ``pytest.mark.parametrize``::

    @pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
    @pytest.mark.parametrize("mode", list(TransferMode), ids=lambda m: m.value)
    def test_conformance(check, mode):
        check(make_my_pair, mode)

The kit runs the local backend both as publisher and as fetcher, and asserts what a lease
holder relies on: destination bytes, exact masks, named rejections that touch nothing and
tell the peer nothing, a peer's hint moving bytes once, conclusion and quiescence without
polling, honest partial delivery and shutdown sets.

Lenders have checks of their own (``lender_checks.LENDER_CHECKS``, over the rigs of
``lender_rigs``: in place, staging and an engine's own KV); they are not imported here,
since lenders bring torch.
"""

from __future__ import annotations

from collections.abc import Callable

from kvxfer.contract import TransferMode
from kvxfer.testing.conformance.delivery_checks import (
    check_cancel,
    check_cancel_before_peer_starts,
    check_missing_counterpart_false,
    check_only_requested_rows_move,
    check_outcome_is_final,
    check_partial_failure_exact,
    check_register_skips_unreachable_kinds,
    check_round_trip_exact,
    check_shutdown,
    check_wake_after_visible,
)
from kvxfer.testing.conformance.geometry_checks import (
    check_geometry_block_outside_refused,
    check_geometry_heads_refused,
    check_geometry_mismatch_refused,
)
from kvxfer.testing.conformance.hint_checks import (
    check_hint_only_for_its_audience,
    check_hint_used_once,
    check_withdraw,
)
from kvxfer.testing.conformance.pair import REFUSAL_GRACE, TIMEOUT, Index, InProcessPeer, Pair, PairFactory, PeerEnd
from kvxfer.testing.conformance.refusal_checks import (
    check_describe_refuses_what_a_submission_would,
    check_layout_mismatch_refused,
    check_overlapping_fetch_refused,
    check_unknown_slot_refused,
    check_unregistered_region_refused,
)

CHECKS: tuple[Callable[[PairFactory, TransferMode], None], ...] = (
    check_round_trip_exact,
    check_wake_after_visible,
    check_outcome_is_final,
    check_unregistered_region_refused,
    check_unknown_slot_refused,
    check_overlapping_fetch_refused,
    check_describe_refuses_what_a_submission_would,
    check_register_skips_unreachable_kinds,
    check_layout_mismatch_refused,
    check_geometry_mismatch_refused,
    check_geometry_block_outside_refused,
    check_geometry_heads_refused,
    check_hint_used_once,
    check_hint_only_for_its_audience,
    check_withdraw,
    check_missing_counterpart_false,
    check_only_requested_rows_move,
    check_partial_failure_exact,
    check_cancel,
    check_cancel_before_peer_starts,
    check_shutdown,
)

__all__ = [
    "TIMEOUT",
    "REFUSAL_GRACE",
    "Index",
    "PeerEnd",
    "InProcessPeer",
    "Pair",
    "PairFactory",
    "CHECKS",
    "check_round_trip_exact",
    "check_wake_after_visible",
    "check_outcome_is_final",
    "check_unregistered_region_refused",
    "check_unknown_slot_refused",
    "check_overlapping_fetch_refused",
    "check_describe_refuses_what_a_submission_would",
    "check_register_skips_unreachable_kinds",
    "check_layout_mismatch_refused",
    "check_hint_used_once",
    "check_hint_only_for_its_audience",
    "check_withdraw",
    "check_missing_counterpart_false",
    "check_only_requested_rows_move",
    "check_partial_failure_exact",
    "check_cancel",
    "check_cancel_before_peer_starts",
    "check_shutdown",
]
