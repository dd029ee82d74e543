"""Checks of submissions a backend must refuse: bad rows, a foreign layout, describe() of them."""

from __future__ import annotations

import itertools

from kvxfer.contract import InvalidSubmission, LayerGroupRows, MemoryKind, SlotRegion, TransferMode, View
from kvxfer.testing.conformance.pair import PairFactory
from kvxfer.testing.conformance.refusal import _expect_refusal
from kvxfer.testing.conformance.transfers import _fill, _plan, _roles


def check_unregistered_region_refused(make_pair: PairFactory, mode: TransferMode) -> None:
    """Rows in a region the backend never registered: InvalidSubmission, nothing touched."""
    for local_op, local_is_source in _roles():
        pair = make_pair(mode)
        try:
            plan = _plan(pair, f"unreg-{local_op}", rows=4, seed=4)
            _fill(pair, plan, local_is_source)
            peer_hint = pair.peer.describe(plan.peer_view)
            g = plan.local_view.groups[0]
            stranger = SlotRegion("not-registered", g.region.address, g.region.slot_bytes, g.region.slots,
                                  MemoryKind.HOST if g.region.memory_kind is MemoryKind.DEVICE else MemoryKind.DEVICE)
            bad = View(plan.local_view.request, plan.local_view.tokens,
                       (LayerGroupRows(g.layer_group, g.kind, stranger, g.slots, g.ordinals),) + plan.local_view.groups[1:],
                       plan.local_view.layout)
            _expect_refusal(pair, plan, local_op, local_is_source, bad, peer_hint)
        finally:
            pair.close()


def check_unknown_slot_refused(make_pair: PairFactory, mode: TransferMode) -> None:
    """A slot beyond the registered region is not skipped: InvalidSubmission, nothing touched."""
    # One past the end, and negative (numpy would wrap it around to the last slot).
    for (local_op, local_is_source), past_end in itertools.product(_roles(), (True, False)):
        pair = make_pair(mode)
        try:
            plan = _plan(pair, f"oob-{local_op}", rows=4, seed=5)
            _fill(pair, plan, local_is_source)
            peer_hint = pair.peer.describe(plan.peer_view)
            g = plan.local_view.groups[0]
            slots = g.slots.copy()
            slots[-1] = g.region.slots if past_end else -1
            bad = View(plan.local_view.request, plan.local_view.tokens,
                       (LayerGroupRows(g.layer_group, g.kind, g.region, slots, g.ordinals),) + plan.local_view.groups[1:],
                       plan.local_view.layout)
            _expect_refusal(pair, plan, local_op, local_is_source, bad, peer_hint)
        finally:
            pair.close()


def check_overlapping_fetch_refused(make_pair: PairFactory, mode: TransferMode) -> None:
    """Two rows of one fetch in the same slot: InvalidSubmission, nothing touched."""
    pair = make_pair(mode)
    try:
        plan = _plan(pair, "overlap", rows=4, seed=6)
        _fill(pair, plan, False)
        peer_hint = pair.peer.describe(plan.peer_view)
        g = plan.local_view.groups[0]
        slots = g.slots.copy()
        slots[1] = slots[0]
        bad = View(plan.local_view.request, plan.local_view.tokens,
                   (LayerGroupRows(g.layer_group, g.kind, g.region, slots, g.ordinals),) + plan.local_view.groups[1:],
                   plan.local_view.layout)
        _expect_refusal(pair, plan, "fetch", False, bad, peer_hint)
    finally:
        pair.close()


def check_describe_refuses_what_a_submission_would(make_pair: PairFactory, mode: TransferMode) -> None:
    """describe() refuses every view that fetch() or publish() would refuse (overlapping rows,
    an unregistered region, a slot out of bounds), so that no hint ever exposes such rows: in
    push mode the fetcher's hint lets the peer WRITE before the fetch itself is checked."""
    pair = make_pair(mode)
    try:
        plan = _plan(pair, "describe-bad", rows=4, seed=23)
        g = plan.local_view.groups[0]
        overlapping = g.slots.copy()
        overlapping[1] = overlapping[0]
        stranger = SlotRegion("not-registered", g.region.address + g.region.nbytes * 64, g.region.slot_bytes,
                              g.region.slots, g.region.memory_kind, g.region.device_id)
        bad_groups = {
            "overlapping rows": LayerGroupRows(g.layer_group, g.kind, g.region, overlapping, g.ordinals),
            "an unregistered region": LayerGroupRows(g.layer_group, g.kind, stranger, g.slots, g.ordinals),
            "a slot out of bounds": LayerGroupRows(g.layer_group, g.kind, g.region,
                                                   g.slots + g.region.slots, g.ordinals),
        }
        for what, group in bad_groups.items():
            bad = View(plan.local_view.request, plan.local_view.tokens, (group,) + plan.local_view.groups[1:],
                       plan.local_view.layout)
            try:
                hint = pair.local.describe(bad)
            except InvalidSubmission:
                continue
            raise AssertionError(f"describe() of a view with {what} returned a hint for transfer {hint.transfer_id}")
    finally:
        pair.close()


def check_layout_mismatch_refused(make_pair: PairFactory, mode: TransferMode) -> None:
    """A peer of another layout identity is refused before any byte moves."""
    for local_op, local_is_source in _roles():
        pair = make_pair(mode)
        try:
            plan = _plan(pair, f"layout-{local_op}", rows=4, seed=7)
            _fill(pair, plan, local_is_source)
            other = View(plan.peer_view.request, plan.peer_view.tokens, plan.peer_view.groups, b"another-layout")
            peer_hint = pair.peer.describe(other)
            _expect_refusal(pair, plan, local_op, local_is_source, plan.local_view, peer_hint)
        finally:
            pair.close()
