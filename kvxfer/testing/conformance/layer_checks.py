"""Checks of layer-wise streaming (``kvxfer serve --layerwise``): one request moved as one
transfer per layer group, each group under a hint of its own (named ``rid/group``), its
publish submitted only once that group is ready, which may be after the peer's fetch was
submitted.

Not in ``CHECKS``: a backend is asked to pass these where the workers stream layer groups
over it (loopback, NIXL); a store (the blob backend) has no fetch that waits for a later put.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from kvxfer.contract import Attempt, Delivered, Hint, Outcome, TransferMode, View
from kvxfer.testing.conformance.pair import TIMEOUT, Pair, PairFactory
from kvxfer.testing.conformance.transfers import _dest_rows, _groups, _Plan, _plan, _roles, _source_rows


def _per_group(view: View) -> list[View]:
    return [View(f"{view.request}/{g.layer_group}", view.tokens, (g,), view.layout) for g in view.groups]


def _write(pair: Pair, plan: _Plan, name: str, source: bool, local_is_source: bool, data: bytes) -> None:
    """Write ``data`` into group ``name``'s rows at the source end (``source``) or the
    destination end."""
    local_region, peer_region = next((lr, pr) for g, lr, pr in _groups(pair) if g == name)
    local_side = local_is_source == source
    slots = (plan.local_slots if local_side else plan.peer_slots)[name]
    if local_side:
        pair.local_memory.write(local_region.name, slots, data)
    else:
        pair.peer.write(peer_region.name, slots, data)


def check_group_published_after_the_fetch(make_pair: PairFactory, mode: TransferMode) -> None:
    """Two groups of one request, one hint each: both fetches are submitted first; the first
    group's rows are then written and published and arrive (in push mode the second group's
    fetch meanwhile waits, concluding nothing); only then are the second group's rows written
    (push) and published. Both arrive byte for byte with full masks, at both ends."""
    for local_op, local_is_source in _roles():
        pair = make_pair(mode)
        try:
            plan = _plan(pair, f"layers-{local_op}", rows=12, seed=11)
            names = [name for name, _, _ in _groups(pair)]
            assert len(names) == 2, "the case needs two groups (two regions at each end)"
            _prepare(pair, plan, mode, local_is_source)
            local_views, peer_views = _per_group(plan.local_view), _per_group(plan.peer_view)
            local_hints = [pair.local.describe(v) for v in local_views]
            peer_hints = [pair.peer.describe(v) for v in peer_views]
            fetch, publish = _ops(pair, local_op, local_views, peer_views, local_hints, peer_hints)
            fetches = [fetch(i) for i in range(2)]
            outcomes: list[tuple[Outcome | None, Outcome | None]] = []
            for i, name in enumerate(names):
                if mode is TransferMode.PUSH:
                    if i == 1:
                        # The second group is not published yet: its fetch has concluded nothing.
                        assert fetches[1][0]() is None, "a fetch concluded before its group was published"
                    _write(pair, plan, name, True, local_is_source, plan.payload[name])
                published = publish(i)
                outcomes.append((_settle(fetches[i][0]), _settle(published)))
            for (fetched, pub), name in zip(outcomes, names):
                _check_group(pair, plan, local_is_source, name, fetched, pub)
            for _, quiet in fetches:
                assert quiet(), "a group's fetch did not quiesce"
        finally:
            pair.close()


def _prepare(pair: Pair, plan: _Plan, mode: TransferMode, local_is_source: bool) -> None:
    """Destination rows get a sentinel. Pull: the fetcher READs the rows hint P shows, so the
    source holds them before it is described; push: each group's rows are written just
    before its publish, after the fetches were submitted."""
    for name, region, _ in _groups(pair):
        sentinel = bytes([0xA5]) * (plan.local_slots[name].size * region.slot_bytes)
        _write(pair, plan, name, False, local_is_source, sentinel)
        if mode is TransferMode.PULL:
            _write(pair, plan, name, True, local_is_source, plan.payload[name])


def _check_group(pair: Pair, plan: _Plan, local_is_source: bool, name: str, fetched: Outcome | None,
                 published: Outcome | None) -> None:
    assert isinstance(fetched, Delivered), fetched
    assert isinstance(published, Delivered), published
    assert fetched.masks[0].all() and published.masks[0].all()
    region = next(r for g, r, _ in _groups(pair) if g == name)
    assert _dest_rows(pair, plan, local_is_source, name) == _source_rows(plan, name, region.slot_bytes)


Poll = Callable[[], Outcome | None]


def _ops(pair: Pair, local_op: str, local_views: list[View], peer_views: list[View], local_hints: list[Hint],
         peer_hints: list[Hint]) -> tuple[Callable[[int], tuple[Poll, Callable[[], bool]]], Callable[[int], Poll]]:
    """``fetch(i)`` and ``publish(i)`` of group i, whichever end runs which: each gives a
    poll of the attempt's outcome (and the fetch, of its quiescence)."""
    def local(op: str, i: int) -> Attempt:
        submit = pair.local.fetch if op == "fetch" else pair.local.publish
        return submit(local_views[i], peer_hints[i])

    def peer(op: str, i: int) -> tuple[Poll, Callable[[], bool]]:
        handle = pair.peer.start(op, peer_views[i], local_hints[i])
        return (lambda: pair.peer.result(handle, 0.0)[0]), (lambda: pair.peer.result(handle, TIMEOUT)[1])

    def fetch(i: int) -> tuple[Poll, Callable[[], bool]]:
        if local_op == "fetch":
            attempt = local("fetch", i)
            return attempt.poll, lambda: _quiet(attempt)
        return peer("fetch", i)

    def publish(i: int) -> Poll:
        if local_op == "publish":
            return local("publish", i).poll
        return peer("publish", i)[0]

    return fetch, publish


def _quiet(attempt: Attempt) -> bool:
    end = time.monotonic() + TIMEOUT
    while time.monotonic() < end and not attempt.quiesced():
        time.sleep(0.001)
    return attempt.quiesced()


def _settle(poll: Poll) -> Outcome | None:
    end = time.monotonic() + TIMEOUT
    while time.monotonic() < end:
        outcome = poll()
        if outcome is not None:
            return outcome
        time.sleep(0.001)
    return None


STREAMING_CHECKS: tuple[Callable[[PairFactory, TransferMode], None], ...] = (check_group_published_after_the_fetch,)

__all__ = ["STREAMING_CHECKS", "check_group_published_after_the_fetch"]
