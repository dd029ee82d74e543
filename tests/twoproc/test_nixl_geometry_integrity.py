"""Row integrity between two engine geometries over NIXL, two real processes, host memory: the
child publishes its KV (TP 1, layer-major NHD) and this process fetches it into another layout
(TP rank 1 of 2: half the heads; a block-major pool of 32-token blocks), pushed packed and
unpacked, with destination blocks damaged where they landed before the check (the test kit's
``Corruptor``). The publisher sums each destination block's digest from the source segments it
sent; the fetcher checks its blocks with its own plan. Every damaged block is False, every
clean block True and byte for byte the source's KV, and the push is Failed with a reason
starting "digest mismatch", never Delivered. Ends that disagree behave as for pool rows: a
fetcher that checks refuses blocks that came with no digests; one that does not check
delivers. A pull between geometries carries no digests and is not checked (documented)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

from kvxfer.backends.common.integrity import MISMATCH
from kvxfer.backends.nixl import NixlBackend
from kvxfer.contract import Delivered, Failed, TransferMode, View
from kvxfer.lender.engine_kv import EngineKV
from kvxfer.lender.external import ExternalLender
from kvxfer.testing.corruption import Corruptor
from kvxfer.testing.nixl_geometry import build_kv, kv_tokens, local_bytes, peer_kv, read_all
from kvxfer.testing.subprocess_peer import SubprocessPeer, live_children
from kvxfer.wire import decode_hint, encode_hint

pytest.importorskip("nixl")

CHILD = "kvxfer.testing.nixl_geometry:child_engine"
TOKENS = 100
SRC = {"kind": "layers", "layers": 2, "kv_heads": 4, "head_dim": 8, "blocks": 12, "heads": [0, 4],
       "order": "nhd", "block_tokens": 16}
CASES = {  # the destination (this process)
    "tp1-to-rank1of2": {**SRC, "heads": [2, 4]},
    "tp1-layer-major-to-rank1of2-block-major": {**SRC, "kind": "pool", "block_tokens": 32, "heads": [2, 4],
                                                "pool_layout": "block_major"},
}
PATHS = {
    "push-packed": {"packed": "always", "packed_chunk_bytes": 4096, "arena_bytes": 8 * 4096},
    "push-unpacked": {"packed": "never", "chunk_bytes": 4096},
}


@pytest.fixture(scope="module")
def keeps_child() -> Iterator[SubprocessPeer]:
    peer = SubprocessPeer(CHILD, {"mode": "push", "spec": SRC, "seed": 5})
    yield peer
    peer.close()
    assert live_children() == []


@dataclass
class Push:
    local: NixlBackend
    peer: SubprocessPeer
    src: EngineKV  # the child's, as seen from here
    dst: EngineKV
    read: View
    write: View
    s_table: np.ndarray
    d_table: np.ndarray

    def run(self) -> Any:
        """The child publishes, this process fetches: this end's outcome."""
        src_hint = decode_hint(self.peer.describe_bytes(self.read))
        handle = self.peer.start_bytes("publish", self.read, encode_hint(self.local.describe(self.write)))
        fetched = self.local.fetch(self.write, src_hint)
        assert fetched.wait(30.0), "the fetch did not conclude and quiesce"
        _, quiet = self.peer.result(handle, 30.0)
        assert quiet
        return fetched.poll()

    def expected(self) -> np.ndarray:
        """[planes, tokens, heads, unit] of the source, narrowed to the destination's heads."""
        want = kv_tokens(self.src.geometry, read_all(self.peer.read, self.src.regions), self.s_table, TOKENS)
        first = self.dst.geometry.heads[0] - self.src.geometry.heads[0]
        return want[:, :, first:first + self.dst.geometry.head_count]

    def clean_blocks_hold_the_source(self, mask: np.ndarray) -> None:
        got, want, bt = kv_tokens(self.dst.geometry, local_bytes(self.dst), self.d_table, TOKENS), self.expected(), \
            self.dst.geometry.block_tokens
        for block in np.flatnonzero(mask).tolist():
            span = slice(block * bt, min(TOKENS, (block + 1) * bt))
            assert np.array_equal(got[:, span], want[:, span]), f"destination block {block} differs"


@pytest.fixture
def pushes(keeps_child: SubprocessPeer) -> Iterator[Any]:
    made: list[NixlBackend] = []

    def make(case: str, path: str, *, child: dict[str, Any] | None = None, **local: Any) -> Push:
        options = PATHS[path]
        keeps_child.rebuild({"mode": "push", "spec": SRC, "seed": 5, **options, **(child or {})})
        dst_spec = CASES[case]
        dst = build_kv(dst_spec)
        backend = NixlBackend(mode=TransferMode.PUSH, deadline_s=10.0, **{**options, **local})
        made.append(backend)
        backend.register(dst.regions)
        src = peer_kv(SRC, keeps_child.regions)
        rng = np.random.default_rng(4)
        s_table = rng.permutation(SRC["blocks"])[: -(-TOKENS // SRC["block_tokens"])]
        d_table = rng.permutation(dst_spec["blocks"])[: -(-TOKENS // dst_spec["block_tokens"])]
        read = ExternalLender(src).lend_read("req", s_table, (0, TOKENS)).view()
        write = ExternalLender(dst).lend_write("req", d_table, (0, TOKENS)).view()
        return Push(backend, keeps_child, src, dst, read, write, s_table, d_table)

    yield make
    for backend in made:
        assert backend.shutdown() == frozenset()
    assert keeps_child.shutdown() == 0


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("case", list(CASES))
def test_damaged_destination_blocks_are_false_and_clean_ones_exact(pushes: Any, case: str, path: str) -> None:
    corruptor = Corruptor(seed=11, p_bit=0.25, p_row=0.25)
    changed_total = clean_total = counted = 0
    for _ in range(3):
        push: Push = pushes(case, path, corrupt_landed=corruptor)
        outcome = push.run()
        changed = corruptor.take()
        region = push.write.groups[0].region.name
        damaged = np.array([(region, int(b)) in changed for b in push.d_table.tolist()])
        mask = np.asarray(outcome.masks[0])
        assert mask.tolist() == (~damaged).tolist(), (changed, outcome)
        push.clean_blocks_hold_the_source(mask)
        if damaged.any():
            assert isinstance(outcome, Failed) and outcome.reason.startswith(MISMATCH), outcome
        else:
            assert isinstance(outcome, Delivered), outcome
        changed_total += int(damaged.sum())
        clean_total += int((~damaged).sum())
        counted += push.local.integrity.rows_failed  # a backend per push
    assert changed_total and clean_total, "the seeded corruptor should damage some blocks and spare others"
    assert counted == changed_total


@pytest.mark.parametrize("path", list(PATHS))
def test_a_fetcher_that_checks_refuses_blocks_sent_without_digests(pushes: Any, path: str) -> None:
    push: Push = pushes("tp1-to-rank1of2", path, child={"integrity": False})
    outcome = push.run()
    assert isinstance(outcome, Failed) and outcome.reason.startswith(MISMATCH), outcome
    assert "without a digest" in outcome.reason
    assert not np.asarray(outcome.masks[0]).any()


def test_a_fetcher_that_does_not_check_delivers_from_a_publisher_that_digests(pushes: Any) -> None:
    push: Push = pushes("tp1-layer-major-to-rank1of2-block-major", "push-unpacked", integrity=False)
    outcome = push.run()
    assert isinstance(outcome, Delivered) and outcome.all_delivered, outcome
    push.clean_blocks_hold_the_source(np.asarray(outcome.masks[0]))
