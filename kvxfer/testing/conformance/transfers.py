"""Building and running the transfers the checks make: scattered rows, payloads, wakes."""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np

from kvxfer.contract import Attempt, CacheKind, Hint, LayerGroupRows, Outcome, SlotRegion, TokenRange, View
from kvxfer.testing.conformance.pair import TIMEOUT, Index, Pair


class _Waker:
    """A wake callback that records what was visible each time it was called."""

    def __init__(self) -> None:
        self.attempt: Attempt | None = None
        self.seen: list[tuple[bool, bool]] = []
        self.event = threading.Event()
        self.lock = threading.Lock()

    def __call__(self) -> None:
        with self.lock:
            attempt = self.attempt
        if attempt is None:  # called during submit, before the attempt was returned
            self.seen.append((False, False))
            return
        done = attempt.poll() is not None, attempt.quiesced()
        self.seen.append(done)
        if all(done):
            self.event.set()

    def bind(self, attempt: Attempt) -> None:
        with self.lock:
            self.attempt = attempt
        self()  # the change may have been reported before we could see the attempt

    def wait(self) -> bool:
        return self.event.wait(TIMEOUT)


def _rng(seed: int) -> np.random.Generator:
    return np.random.default_rng(seed)


def _groups(pair: Pair) -> list[tuple[str, SlotRegion, SlotRegion]]:
    n = min(2, len(pair.local_regions), len(pair.peer.regions))
    assert n >= 1, "a pair needs at least one region at each end"
    out = []
    for i in range(n):
        local, peer = pair.local_regions[i], pair.peer.regions[i]
        assert local.slot_bytes == peer.slot_bytes, "regions paired by position must have equal slots"
        out.append((f"g{i}", local, peer))
    return out


@dataclass
class _Plan:
    """One transfer: per group, which slots at each end hold which ordinals."""

    local_view: View
    peer_view: View
    payload: dict[str, bytes]          # group -> bytes of the source rows, in ordinal order
    local_slots: dict[str, Index]
    peer_slots: dict[str, Index]


def _scatter(rng: np.random.Generator, slots: int, n: int) -> Index:
    return np.sort(rng.choice(slots, size=n, replace=False)).astype(np.int64)[rng.permutation(n)]


def _plan(pair: Pair, request: str, rows: int, seed: int, local_missing: int = 0, peer_missing: int = 0) -> _Plan:
    """Scattered rows in each group; ``*_missing`` drops that many ordinals from one end's view."""
    rng = _rng(seed)
    local_groups, peer_groups = [], []
    payload, local_slots, peer_slots = {}, {}, {}
    for name, local_region, peer_region in _groups(pair):
        n = min(rows, local_region.slots, peer_region.slots)
        ordinals = np.arange(n, dtype=np.int64)
        ls, ps = _scatter(rng, local_region.slots, n), _scatter(rng, peer_region.slots, n)
        keep_local = slice(local_missing, n)
        keep_peer = slice(0, n - peer_missing)
        local_groups.append(LayerGroupRows(name, CacheKind.PAGED, local_region, ls[keep_local], ordinals[keep_local]))
        peer_groups.append(LayerGroupRows(name, CacheKind.PAGED, peer_region, ps[keep_peer], ordinals[keep_peer]))
        payload[name] = rng.integers(0, 256, size=n * local_region.slot_bytes, dtype=np.uint8).tobytes()
        local_slots[name], peer_slots[name] = ls, ps
    tokens = TokenRange(0, rows * 16)
    return _Plan(View(request, tokens, tuple(local_groups), b"kit-layout"),
                 View(request, tokens, tuple(peer_groups), b"kit-layout"), payload, local_slots, peer_slots)


def _fill(pair: Pair, plan: _Plan, local_is_source: bool) -> None:
    """Source rows get the payload; destination rows get a sentinel pattern."""
    for name, local_region, peer_region in _groups(pair):
        n = plan.local_slots[name].size
        sentinel = bytes([0xA5]) * (n * local_region.slot_bytes)
        if local_is_source:
            pair.local_memory.write(local_region.name, plan.local_slots[name], plan.payload[name])
            pair.peer.write(peer_region.name, plan.peer_slots[name], sentinel)
        else:
            pair.peer.write(peer_region.name, plan.peer_slots[name], plan.payload[name])
            pair.local_memory.write(local_region.name, plan.local_slots[name], sentinel)


def _dest_rows(pair: Pair, plan: _Plan, local_is_source: bool, name: str) -> list[bytes]:
    local_region, peer_region = next((lr, pr) for g, lr, pr in _groups(pair) if g == name)
    size = local_region.slot_bytes
    if local_is_source:
        data = pair.peer.read(peer_region.name, plan.peer_slots[name])
    else:
        data = pair.local_memory.read(local_region.name, plan.local_slots[name])
    return [data[i * size:(i + 1) * size] for i in range(len(data) // size)]


def _source_rows(plan: _Plan, name: str, size: int) -> list[bytes]:
    data = plan.payload[name]
    return [data[i * size:(i + 1) * size] for i in range(len(data) // size)]


@dataclass
class _Run:
    local_attempt: Attempt
    waker: _Waker
    peer_handle: int
    peer_hint: Hint


def _start(pair: Pair, plan: _Plan, local_op: str) -> _Run:
    local_hint = pair.local.describe(plan.local_view)
    peer_hint = pair.peer.describe(plan.peer_view)
    peer_op = "publish" if local_op == "fetch" else "fetch"
    waker = _Waker()
    handle = pair.peer.start(peer_op, plan.peer_view, local_hint)
    submit = pair.local.fetch if local_op == "fetch" else pair.local.publish
    attempt = submit(plan.local_view, peer_hint, waker)
    waker.bind(attempt)
    return _Run(attempt, waker, handle, peer_hint)


def _finish(pair: Pair, run: _Run) -> tuple[Outcome, Outcome | None]:
    assert run.waker.wait(), "local attempt did not conclude and quiesce by itself (nobody polled)"
    outcome = run.local_attempt.poll()
    assert outcome is not None and run.local_attempt.quiesced()
    peer_outcome, peer_quiet = pair.peer.result(run.peer_handle, TIMEOUT)
    assert peer_outcome is not None and peer_quiet, "peer attempt did not conclude and quiesce"
    return outcome, peer_outcome


def _check_masks_honest(pair: Pair, plan: _Plan, local_is_source: bool, outcome: Outcome, view: View) -> None:
    """Every row a mask says arrived has exactly the source bytes at the destination. (A row
    it says did not may still have been written: an end that stops before its peer's record
    comes, as a cancelled wait does, cannot know and reports it not proven.)"""
    for gi, group in enumerate(view.groups):
        name = group.layer_group
        region = group.region
        src = _source_rows(plan, name, region.slot_bytes)
        dst = _dest_rows(pair, plan, local_is_source, name)
        ordinals = group.ordinals
        for row in np.flatnonzero(outcome.masks[gi]).tolist():
            o = int(ordinals[row])
            assert dst[o] == src[o], f"group {name} ordinal {o} marked delivered but bytes differ"


def _roles() -> tuple[tuple[str, bool], ...]:
    return (("fetch", False), ("publish", True))
