"""SIGKILL of the peer in the middle of a packed push, with the peer in a child process: the
attempt fails within bounded time, its masks claim exactly whole chunks that were scattered
at the destination (byte-exact where we can read them), it quiesces, and shutdown strands
nothing. Both sides: we send packed (the receiver dies while we wait for its credits and
acknowledgements) and we receive packed (the sender dies; our rows are those we scattered)."""

from __future__ import annotations

import time

import numpy as np
import pytest

from kvxfer.backends.nixl import NixlBackend
from kvxfer.contract import CacheKind, Failed, LayerGroupRows, TokenRange, TransferMode, View
from kvxfer.testing.memory import HostRows
from kvxfer.testing.nixl_pairs import host_rows
from kvxfer.testing.progress_hold import hold_progress
from kvxfer.testing.subprocess_peer import SubprocessPeer
from kvxfer.wire import decode_hint, encode_hint

ROW = 16 << 10
ROWS = 96               # per group
CHUNK_ROWS = 4
PAUSE = 0.03            # between packed chunks: about 1.5 s for the whole transfer
PROGRESS = 15.0         # seconds for a first chunk to be proven (a loaded 2-core VM)
BOUND = 5.0
PACKED = {"packed": "always", "packed_chunk_bytes": CHUNK_ROWS * ROW, "arena_bytes": 8 * CHUNK_ROWS * ROW,
          "deadline_s": 20.0, "heartbeat_s": 0.1}
LOCAL = (("A", ROW, 128), ("B", ROW, 128))
PEER = [["PA", ROW, 128], ["PB", ROW, 128]]


def _views(memory: HostRows, peer: SubprocessPeer, request: str) -> tuple[View, View]:
    rng = np.random.default_rng(len(request))
    ordinals = np.arange(ROWS, dtype=np.int64)
    lg = tuple(LayerGroupRows(f"g{i}", CacheKind.PAGED, r, rng.permutation(r.slots)[:ROWS].astype(np.int64), ordinals)
               for i, r in enumerate(memory.regions))
    pg = tuple(LayerGroupRows(f"g{i}", CacheKind.PAGED, r, rng.permutation(r.slots)[:ROWS].astype(np.int64), ordinals)
               for i, r in enumerate(peer.regions))
    tokens = TokenRange(0, ROWS * 16)
    return View(request, tokens, lg, b"kill"), View(request, tokens, pg, b"kill")


def _whole_chunks(masks: list[np.ndarray]) -> int:
    """Proven rows are whole chunks in posting order: a prefix of group 0, then of group 1."""
    counts = []
    for mask in masks:
        n = int(mask.sum())
        assert mask[:n].all() and not mask[n:].any(), "proven rows are not a prefix in posting order"
        assert n % CHUNK_ROWS == 0, f"{n} rows is not a whole number of chunks"
        counts.append(n)
    assert counts[1] == 0 or counts[0] == ROWS, "group 1 started before group 0 ended"
    return sum(counts)


@pytest.mark.parametrize("we", ["send", "receive"])
def test_kill_peer_mid_packed_push(we: str) -> None:
    memory = host_rows(LOCAL)
    pause = PAUSE if we == "send" else 0.0
    local = NixlBackend(mode=TransferMode.PUSH, chunk_pause_s=pause, **PACKED)  # type: ignore[arg-type]
    local.register(memory.regions)
    if we == "send":  # a chunk the receiver acknowledged
        held, gate = hold_progress(local, ready=lambda: any(job.done for job in list(local._active)))
    else:  # a chunk we scattered
        held, gate = hold_progress(local, ready=lambda: local.stats().chunks_scattered > 0)
    peer = SubprocessPeer("kvxfer.testing.nixl_pairs:child_backend",
                          {"mode": "push", "buffers": PEER, "chunk_pause_s": PAUSE if we == "receive" else 0.0,
                           **PACKED})
    try:
        lview, pview = _views(memory, peer, f"kill-{we}")
        rng = np.random.default_rng(3)
        payload = {g.layer_group: rng.integers(0, 256, ROWS * ROW, dtype=np.uint8).tobytes() for g in lview.groups}
        for lg, pg in zip(lview.groups, pview.groups):
            if we == "send":
                memory.write(lg.region.name, lg.slots, payload[lg.layer_group])
            else:
                peer.write(pg.region.name, pg.slots, payload[lg.layer_group])
                memory.write(lg.region.name, lg.slots, b"\x00" * ROWS * ROW)
        local_hint = encode_hint(local.describe(lview))
        peer_hint = decode_hint(peer.describe_bytes(pview))
        peer.start_bytes("fetch" if we == "send" else "publish", pview, local_hint)
        attempt = (local.publish if we == "send" else local.fetch)(lview, peer_hint)
        assert held.wait(PROGRESS), "no chunk was proven"
        assert attempt.poll() is None, "the transfer ended before the kill"
        peer.kill()
        killed = time.monotonic()
        gate.set()
        assert attempt.wait(BOUND), f"no outcome and quiescence within {BOUND}s of the kill"
        assert time.monotonic() - killed < BOUND
        outcome = attempt.poll()
        assert isinstance(outcome, Failed) and "disconnect" in outcome.reason, outcome
        proven = _whole_chunks(list(outcome.masks))
        assert 0 < proven < 2 * ROWS, f"the kill did not land mid-transfer ({proven} rows proven)"
        assert local.path_of(attempt) == "packed"
        if we == "receive":  # the rows we report are in place, the others untouched
            for g, mask in zip(lview.groups, outcome.masks):
                n = int(mask.sum())
                got = memory.read(g.region.name, g.slots)
                assert got[: n * ROW] == payload[g.layer_group][: n * ROW]
                assert got[n * ROW:] == b"\x00" * ((ROWS - n) * ROW)
        assert local.shutdown() == frozenset(), "an attempt was left unquiesced"
    finally:
        gate.set()
        peer.kill()
        peer.close()
        local.shutdown()
