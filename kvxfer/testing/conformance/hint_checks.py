"""Checks of a hint's reach: used once, only by its audience, before it expires, until withdrawn."""

from __future__ import annotations

import dataclasses
import time

from kvxfer.contract import Delivered, Peer, TransferMode
from kvxfer.testing.conformance.pair import PairFactory
from kvxfer.testing.conformance.refusal import _expect_refusal
from kvxfer.testing.conformance.transfers import (
    _dest_rows,
    _fill,
    _finish,
    _groups,
    _plan,
    _Run,
    _source_rows,
    _start,
    _Waker,
)


def check_hint_used_once(make_pair: PairFactory, mode: TransferMode) -> None:
    """A peer's hint moves bytes once: after a transfer, the active end's second submission
    with the same hint (a replay, or a retry after the peer reused its rows) is refused with
    InvalidSubmission and the destination keeps the first transfer's bytes."""
    local_op = "publish" if mode is TransferMode.PUSH else "fetch"  # the end that moves bytes
    local_is_source = local_op == "publish"
    pair = make_pair(mode)
    try:
        plan = _plan(pair, f"once-{local_op}", rows=8, seed=15)
        _fill(pair, plan, local_is_source)
        run = _start(pair, plan, local_op)
        outcome, peer_outcome = _finish(pair, run)
        assert isinstance(outcome, Delivered) and isinstance(peer_outcome, Delivered), (outcome, peer_outcome)
        first = {name: _dest_rows(pair, plan, local_is_source, name) for name, _, _ in _groups(pair)}
        for name, region, _ in _groups(pair):
            assert first[name] == _source_rows(plan, name, region.slot_bytes), f"first transfer: group {name} differs"
        # New source bytes, so that a replay that moved rows would show at the destination.
        for name, local_region, peer_region in _groups(pair):
            fresh = bytes(b ^ 0xFF for b in plan.payload[name])
            if local_is_source:
                pair.local_memory.write(local_region.name, plan.local_slots[name], fresh)
            else:
                pair.peer.write(peer_region.name, plan.peer_slots[name], fresh)
        # The peer has described its rows again (as it would to reuse them): its new
        # transfer, not the replayed one, is what may write or read them now.
        pair.peer.describe(plan.peer_view)
        _expect_refusal(pair, plan, local_op, local_is_source, plan.local_view, run.peer_hint,
                        what="a replayed hint", warm=False)
        for name, _, _ in _groups(pair):
            assert _dest_rows(pair, plan, local_is_source, name) == first[name], \
                f"a replayed hint overwrote group {name} at the destination"
    finally:
        pair.close()


def check_hint_only_for_its_audience(make_pair: PairFactory, mode: TransferMode) -> None:
    """A hint moves bytes only at the peer it is bound to, and only before it expires: the
    active end takes a hint bound to itself, and refuses one bound to another peer, to an
    earlier run of its own agent (a restart), or past its expiry, letting nothing escape."""
    local_op = "publish" if mode is TransferMode.PUSH else "fetch"  # the end that moves bytes
    local_is_source = local_op == "publish"
    pair = make_pair(mode)
    try:
        plan = _plan(pair, f"bound-{local_op}", rows=6, seed=21)
        _fill(pair, plan, local_is_source)
        peer_op = "publish" if local_op == "fetch" else "fetch"
        local_hint = pair.local.describe(plan.local_view)
        bound = pair.peer.describe(plan.peer_view, pair.local.peer)
        handle = pair.peer.start(peer_op, plan.peer_view, local_hint)
        waker = _Waker()
        attempt = (pair.local.fetch if local_op == "fetch" else pair.local.publish)(plan.local_view, bound, waker)
        waker.bind(attempt)
        _finish(pair, _Run(attempt, waker, handle, bound))
        assert isinstance(attempt.poll(), Delivered), f"a hint bound to this end was not taken: {attempt.poll()!r}"
    finally:
        pair.close()
    for what in ("a hint bound to another peer", "a hint bound to an earlier run of this agent", "an expired hint"):
        pair = make_pair(mode)
        try:
            me = pair.local.peer
            plan = _plan(pair, f"unbound-{local_op}", rows=6, seed=22)
            _fill(pair, plan, local_is_source)
            if what == "an expired hint":
                hint = dataclasses.replace(pair.peer.describe(plan.peer_view, me),
                                           expires_ms=time.time_ns() // 1_000_000 - 1000)
            else:
                stranger = Peer("a-stranger", "0" * 16) if "another" in what else Peer(me.agent, "an-earlier-run")
                hint = pair.peer.describe(plan.peer_view, stranger)
            _expect_refusal(pair, plan, local_op, local_is_source, plan.local_view, hint, what=what)
        finally:
            pair.close()


def check_withdraw(make_pair: PairFactory, mode: TransferMode) -> None:
    """withdraw() of a peer's hint: True once the attempt that used it has quiesced; True for
    a hint never used, which is then refused as used, letting nothing escape."""
    local_op = "publish" if mode is TransferMode.PUSH else "fetch"  # the end that moves bytes
    local_is_source = local_op == "publish"
    pair = make_pair(mode)
    try:
        plan = _plan(pair, f"withdraw-used-{local_op}", rows=6, seed=24)
        _fill(pair, plan, local_is_source)
        run = _start(pair, plan, local_op)
        _finish(pair, run)
        assert pair.local.withdraw(run.peer_hint), "withdraw() of a hint whose attempt quiesced returned False"
    finally:
        pair.close()
    pair = make_pair(mode)
    try:
        plan = _plan(pair, f"withdraw-unused-{local_op}", rows=6, seed=25)
        _fill(pair, plan, local_is_source)
        hint = pair.peer.describe(plan.peer_view)
        assert pair.local.withdraw(hint), "withdraw() of a hint never used returned False"
        _expect_refusal(pair, plan, local_op, local_is_source, plan.local_view, hint, what="a withdrawn hint")
    finally:
        pair.close()
