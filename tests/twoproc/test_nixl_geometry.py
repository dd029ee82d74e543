"""NIXL between two real processes over host memory, between two different engine geometries:
push packed, push unpacked and pull move each token's heads of every layer from the parent's
layout into the child's (TP 1 -> rank 1 of 2, 16 -> 32 and 64 -> 16 token blocks, layer-major
NHD -> a block-major pool, NHD <-> HND), byte-exact; an injected fault or a cancel part-way
gives exact masks (a destination block that got only some of its runs is False), the same at
both ends; and geometries that cannot meet are refused before anything moves.

The parent is always the source (publisher), the child the destination (fetcher): push tests
the parent's sender and the child's receiver, pull the child's READs."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

from kvxfer.backends.common.transform import Rows, plan_transform
from kvxfer.backends.nixl import NixlBackend
from kvxfer.contract import Cancelled, Delivered, Failed, InvalidSubmission, LayoutMismatch, TransferMode, View
from kvxfer.lender.engine_kv import EngineKV
from kvxfer.lender.external import ExternalLender
from kvxfer.testing.nixl_geometry import build_kv, kv_tokens, local_bytes, peer_kv, read_all
from kvxfer.testing.subprocess_peer import SubprocessPeer, live_children
from kvxfer.wire import decode_hint, encode_hint

CHILD = "kvxfer.testing.nixl_geometry:child_engine"
TOKENS = 100  # not a whole number of blocks at either end
BLOCKS = 12
BASE = {"kind": "layers", "layers": 2, "kv_heads": 4, "head_dim": 8, "blocks": BLOCKS, "heads": [0, 4],
        "order": "nhd", "block_tokens": 16}


def spec(**changes: Any) -> dict[str, Any]:
    return {**BASE, **changes}


# (source, destination): the parent's KV and the child's
CASES = {
    "tp1-to-rank1of2": (spec(), spec(heads=[2, 4])),
    "bt16-to-bt32": (spec(), spec(block_tokens=32)),
    "bt64-to-bt16": (spec(block_tokens=64, blocks=4), spec()),
    "layer-major-to-block-major": (spec(), spec(kind="pool", block_tokens=32, pool_layout="block_major")),
    "nhd-to-hnd": (spec(), spec(order="hnd", block_tokens=32)),
    "hnd-to-nhd": (spec(order="hnd", block_tokens=32), spec(heads=[1, 3])),
}
# 16-token runs of 4 heads in 2 layers are 4 KiB: unpacked, a run per chunk; packed, one per
# slot (a TP rank's half-heads runs two per slot).
PATHS = {
    "push-packed": (TransferMode.PUSH, {"packed": "always", "packed_chunk_bytes": 4096, "arena_bytes": 8 * 4096}),
    "push-unpacked": (TransferMode.PUSH, {"packed": "never", "chunk_bytes": 4096}),
    "pull": (TransferMode.PULL, {"packed": "always", "chunk_bytes": 4096, "packed_chunk_bytes": 4096,
                                 "arena_bytes": 8 * 4096}),
}


@pytest.fixture(scope="module")
def keeps_child() -> Iterator[SubprocessPeer]:
    peer = SubprocessPeer(CHILD, {"mode": "push", "spec": spec()})
    yield peer
    peer.close()
    assert live_children() == []


@dataclass
class Transfer:
    """One transfer's two ends, set up and described, not submitted."""

    local: NixlBackend
    peer: SubprocessPeer
    src: EngineKV
    dst: EngineKV
    read: View
    write: View
    s_table: np.ndarray
    d_table: np.ndarray
    dst_heads: tuple[int, int]

    def plan_masks(self, runs: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        plan = plan_transform(self.read.geometry, Rows.of_view(self.read), self.write.geometry,
                              Rows.of_view(self.write))
        return plan.masks(plan.runs if runs is None else runs)

    def start(self) -> tuple[Any, int]:
        """Both ends describe and submit (hints as wire bytes); the parent's attempt and the
        child's handle."""
        dst_hint = decode_hint(self.peer.describe_bytes(self.write))
        handle = self.peer.start_bytes("fetch", self.write, encode_hint(self.local.describe(self.read)))
        return self.local.publish(self.read, dst_hint), handle

    def expected(self) -> np.ndarray:
        first = self.dst_heads[0] - self.src.geometry.heads[0]
        want = kv_tokens(self.src.geometry, local_bytes(self.src), self.s_table, TOKENS)
        return want[:, :, first:first + self.dst_heads[1] - self.dst_heads[0]]

    def got(self) -> np.ndarray:
        return kv_tokens(self.dst.geometry, read_all(self.peer.read, self.dst.regions), self.d_table, TOKENS)

    def check_rows(self, mask: np.ndarray) -> None:
        """Destination blocks marked arrived hold exactly the source's tokens."""
        got, want, bt = self.got(), self.expected(), self.dst.geometry.block_tokens
        for block in np.flatnonzero(mask):
            span = slice(block * bt, min(TOKENS, (block + 1) * bt))
            assert np.array_equal(got[:, span], want[:, span]), f"destination block {block} differs"


@pytest.fixture
def ends(keeps_child: SubprocessPeer) -> Iterator[Any]:
    made: list[NixlBackend] = []

    def make(case: str, path: str, **extra: Any) -> Transfer:
        src_spec, dst_spec = CASES[case]
        mode, options = PATHS[path]
        keeps_child.rebuild({"mode": mode.value, "spec": dst_spec, **options, **extra.get("child", {})})
        src = build_kv(src_spec, seed=7)
        local = NixlBackend(mode=mode, deadline_s=10.0, **{**options, **extra.get("local", {})})
        made.append(local)
        local.register(src.regions)
        dst = peer_kv(dst_spec, keeps_child.regions)
        rng = np.random.default_rng(3)
        s_table = rng.permutation(src_spec["blocks"])[: -(-TOKENS // src_spec["block_tokens"])]
        d_table = rng.permutation(dst_spec["blocks"])[: -(-TOKENS // dst_spec["block_tokens"])]
        read = ExternalLender(src).lend_read("req", s_table, (0, TOKENS)).view()
        write = ExternalLender(dst).lend_write("req", d_table, (0, TOKENS)).view()
        return Transfer(local, keeps_child, src, dst, read, write, s_table, d_table, tuple(dst_spec["heads"]))

    yield make
    for local in made:
        assert local.shutdown() == frozenset()
    assert keeps_child.shutdown() == 0


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("case", list(CASES))
def test_kv_lands_in_the_other_layout_byte_exact(ends: Any, case: str, path: str) -> None:
    t: Transfer = ends(case, path)
    assert not t.got().any()
    attempt, handle = t.start()
    assert attempt.wait(30.0), "the publisher did not conclude and quiesce"
    peer_outcome, quiet = t.peer.result(handle, 30.0)
    outcome = attempt.poll()
    assert quiet
    assert isinstance(outcome, Delivered) and outcome.all_delivered, outcome
    assert isinstance(peer_outcome, Delivered) and peer_outcome.all_delivered, peer_outcome
    assert np.array_equal(t.got(), t.expected())
    expected_path = "packed" if path == "push-packed" else "unpacked"
    assert t.local.path_of(attempt) == expected_path
    stats = t.local.stats()
    assert (stats.packed_submissions, stats.unpacked_submissions) == (
        (1, 0) if expected_path == "packed" else (0, 1 if path == "push-unpacked" else 0))


# Packed slots of 2 KiB split each 16-token run in two chunks (between its planes).
FAULT_PATHS = {"push-packed": {"local": {"packed_chunk_bytes": 2048}, "child": {"packed_chunk_bytes": 2048}},
               "push-unpacked": {}, "pull": {}}


@pytest.mark.parametrize("path", list(FAULT_PATHS))
def test_an_injected_fault_leaves_a_half_arrived_block_false(ends: Any, path: str) -> None:
    t: Transfer = ends("bt16-to-bt32", path, **FAULT_PATHS[path])
    runs = 3  # 16-token runs: destination block 1 gets its first run only
    if path == "pull":
        assert t.peer.inject_fault(runs)
    else:
        t.local.fail_after_rows = runs
    attempt, handle = t.start()
    assert attempt.wait(30.0)
    peer_outcome, quiet = t.peer.result(handle, 30.0)
    outcome = attempt.poll()
    assert quiet
    assert isinstance(outcome, Failed) and isinstance(peer_outcome, Failed), (outcome, peer_outcome)
    src_mask, dst_mask = t.plan_masks(runs)
    assert dst_mask.tolist() == [True, False, False, False]
    assert src_mask.tolist() == [True, True, True, False, False, False, False]
    assert outcome.masks[0].tolist() == src_mask.tolist()
    assert peer_outcome.masks[0].tolist() == dst_mask.tolist()
    t.check_rows(dst_mask)
    got, want = t.got(), t.expected()
    assert np.array_equal(got[:, 32:48], want[:, 32:48]), "block 1's first run should have arrived"
    assert not got[:, 48:].any(), "nothing past the third run may arrive"


@pytest.mark.parametrize("path", ["push-packed", "push-unpacked", "pull"])
def test_a_cancel_part_way_gives_exact_masks_at_both_ends(ends: Any, path: str) -> None:
    pace = {"chunk_pause_s": 0.1}
    extra = {"child": pace} if path == "pull" else {"local": pace}
    if path == "push-packed":
        extra = {"local": {**pace, "packed_chunk_bytes": 2048}, "child": {"packed_chunk_bytes": 2048}}
    t: Transfer = ends("bt16-to-bt32", path, **extra)
    attempt, handle = t.start()
    time.sleep(0.35)
    if path == "pull":
        t.peer.cancel(handle)
    else:
        attempt.cancel()
    assert attempt.wait(30.0)
    peer_outcome, quiet = t.peer.result(handle, 30.0)
    outcome = attempt.poll()
    assert quiet
    assert isinstance(outcome, (Cancelled, Delivered)) and isinstance(peer_outcome, (Cancelled, Delivered)), (
        outcome, peer_outcome)
    src_mask, dst_mask = np.asarray(outcome.masks[0]), np.asarray(peer_outcome.masks[0])
    # Both ends report one prefix of runs: the source rows it covers and the destination
    # blocks it covers in full.
    explained = [k for k in range(8) if [m.tolist() for m in t.plan_masks(k)] == [src_mask.tolist(),
                                                                                  dst_mask.tolist()]]
    assert explained, (src_mask, dst_mask)
    t.check_rows(dst_mask)
    if explained[0] % 2:  # an odd number of runs: a destination block got one of its two
        assert not dst_mask[explained[0] // 2]


def test_geometries_that_cannot_meet_are_refused_before_anything_moves(ends: Any) -> None:
    t: Transfer = ends("tp1-to-rank1of2", "push-unpacked")
    dst_hint = decode_hint(t.peer.describe_bytes(t.write))
    # The source holds only heads [0, 2): the destination's heads [2, 4) are not there.
    narrow_src = build_kv(spec(heads=[0, 2], name="narrow"), seed=1)
    t.local.register(narrow_src.regions)
    narrow = ExternalLender(narrow_src).lend_read("req", t.s_table, (0, TOKENS)).view()
    t.local.describe(narrow)
    with pytest.raises(LayoutMismatch, match="heads"):
        t.local.publish(narrow, dst_hint)
    # Another head_dim: the model's KV differs.
    other_src = build_kv(spec(head_dim=16, name="other"), seed=1)
    t.local.register(other_src.regions)
    other = ExternalLender(other_src).lend_read("req", t.s_table, (0, TOKENS)).view()
    t.local.describe(other)
    with pytest.raises(LayoutMismatch, match="head_dim"):
        t.local.publish(other, dst_hint)
    # A geometry whose tensors were never registered: describe() and publish() refuse it.
    unregistered = build_kv(spec(name="unregistered"), seed=1)
    view = ExternalLender(unregistered).lend_read("req", t.s_table, (0, TOKENS)).view()
    with pytest.raises(InvalidSubmission, match="not registered"):
        t.local.describe(view)
    with pytest.raises(InvalidSubmission, match="not registered"):
        t.local.publish(view, dst_hint)
    with pytest.raises(InvalidSubmission, match="not registered"):
        t.local.fetch(view, dst_hint)
    stats = t.local.stats()
    assert stats.packed_submissions == stats.unpacked_submissions == 0
    assert not t.got().any(), "the destination was written"
