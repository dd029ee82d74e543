"""NIXL between two real processes over host memory: byte-exact push and pull of scattered
rows in two layer groups, prefix-holding fetches, and hints refused before any byte moves.
Hints cross between the processes as kvxfer.wire bytes, as the router carries them. Every
test runs with the packed path forced on (pushes go packed) and off."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

from kvxfer.backends.nixl import NixlBackend
from kvxfer.contract import (
    CacheKind,
    Delivered,
    InvalidSubmission,
    LayerGroupRows,
    SlotRegion,
    TokenRange,
    TransferMode,
    View,
)
from kvxfer.testing.memory import HostRows
from kvxfer.testing.nixl_pairs import host_rows
from kvxfer.testing.subprocess_peer import SubprocessPeer, live_children
from kvxfer.wire import WireError, decode_hint, encode_hint

# Two groups of unequal rows; chunks of 4 big rows, so a transfer spans several chunks.
LOCAL = (("A", 4096, 256), ("B", 1536, 200))
PEER = (("PA", 4096, 300), ("PB", 1536, 180))
CHUNK = 4 * 4096
LAYOUT = b"twoproc-layout"
# Packed: slots of one chunk, 4 landing slots, so a transfer reuses each slot several times.
PACKED = {"always": {"packed": "always", "packed_chunk_bytes": CHUNK, "arena_bytes": 8 * CHUNK},
          "never": {"packed": "never"}}


@dataclass
class Ends:
    mode: TransferMode
    local: NixlBackend
    memory: HostRows
    peer: SubprocessPeer
    packed: str
    attempts: list[Any] = field(default_factory=list)

    @property
    def expected_path(self) -> str:
        return "packed" if self.packed == "always" and self.mode is TransferMode.PUSH else "unpacked"


@pytest.fixture(scope="module")
def keeps_child() -> Iterator[SubprocessPeer]:
    peer = SubprocessPeer("kvxfer.testing.nixl_pairs:child_backend",
                          {"mode": "push", "buffers": [list(b) for b in PEER], "chunk_bytes": CHUNK})
    yield peer
    peer.close()
    assert live_children() == []


@pytest.fixture(params=[(m, p) for m in TransferMode for p in PACKED], ids=lambda mp: f"{mp[0].value}-{mp[1]}")
def ends(request: pytest.FixtureRequest, keeps_child: SubprocessPeer) -> Iterator[Ends]:
    mode, packed = request.param
    keeps_child.rebuild({"mode": mode.value, "buffers": [list(b) for b in PEER], "chunk_bytes": CHUNK,
                         **PACKED[packed]})
    memory = host_rows(LOCAL)
    local = NixlBackend(mode=mode, chunk_bytes=CHUNK, deadline_s=10.0, **PACKED[packed])  # type: ignore[arg-type]
    local.register(memory.regions)
    yield Ends(mode, local, memory, keeps_child, packed)
    assert local.shutdown() == frozenset()
    assert keeps_child.shutdown() == 0


def _slots_with_run(rng: np.random.Generator, slots: int, n: int, start: int) -> np.ndarray:
    """``n`` distinct slots: a run of 8 from ``start`` (contiguous on both ends), then scattered."""
    run = np.arange(start, start + 8, dtype=np.int64)
    rest = rng.permutation(np.setdiff1d(np.arange(slots, dtype=np.int64), run))[: n - 8]
    return np.concatenate([run, rest]).astype(np.int64)


def _views(local: tuple[SlotRegion, ...], peer: tuple[SlotRegion, ...], rows: int, seed: int,
           local_from: int = 0, layout: bytes = LAYOUT) -> tuple[View, View, dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Scattered slots with a few runs contiguous on both ends (so coalescing has work)."""
    rng = np.random.default_rng(seed)
    lg, pg, ls_all, ps_all = [], [], {}, {}
    for name, lr, pr in zip(("g0", "g1"), local, peer):
        n = min(rows, lr.slots, pr.slots)
        ls, ps = _slots_with_run(rng, lr.slots, n, 100), _slots_with_run(rng, pr.slots, n, 7)
        ordinals = np.arange(n, dtype=np.int64)
        lg.append(LayerGroupRows(name, CacheKind.PAGED, lr, ls[local_from:], ordinals[local_from:]))
        pg.append(LayerGroupRows(name, CacheKind.PAGED, pr, ps, ordinals))
        ls_all[name], ps_all[name] = ls, ps
    tokens = TokenRange(0, rows * 16)
    return View("req", tokens, tuple(lg), layout), View("req", tokens, tuple(pg), layout), ls_all, ps_all


def _run(ends: Ends, local_view: View, peer_view: View, local_op: str) -> tuple[object, object]:
    """Both ends describe, exchange hints as wire bytes, submit, and conclude."""
    local_hint_bytes = encode_hint(ends.local.describe(local_view))
    peer_hint = decode_hint(ends.peer.describe_bytes(peer_view))
    handle = ends.peer.start_bytes("publish" if local_op == "fetch" else "fetch", peer_view, local_hint_bytes)
    attempt = (ends.local.fetch if local_op == "fetch" else ends.local.publish)(local_view, peer_hint)
    ends.attempts.append(attempt)
    assert attempt.wait(20.0), "local attempt did not conclude and quiesce"
    peer_outcome, quiet = ends.peer.result(handle, 20.0)
    assert quiet
    return attempt.poll(), peer_outcome


@pytest.mark.parametrize("local_op", ["fetch", "publish"])
def test_scattered_rows_two_groups_byte_exact(ends: Ends, local_op: str) -> None:
    local_view, peer_view, ls, ps = _views(ends.memory.regions, ends.peer.regions, rows=120, seed=1)
    rng = np.random.default_rng(2)
    payload = {}
    for g, lr, pr in zip(("g0", "g1"), ends.memory.regions, ends.peer.regions):
        payload[g] = rng.integers(0, 256, ls[g].size * lr.slot_bytes, dtype=np.uint8).tobytes()
        if local_op == "publish":
            ends.memory.write(lr.name, ls[g], payload[g])
            ends.peer.write(pr.name, ps[g], b"\x5a" * len(payload[g]))
        else:
            ends.peer.write(pr.name, ps[g], payload[g])
            ends.memory.write(lr.name, ls[g], b"\x5a" * len(payload[g]))
    outcome, peer_outcome = _run(ends, local_view, peer_view, local_op)
    assert isinstance(outcome, Delivered) and outcome.all_delivered, outcome
    assert isinstance(peer_outcome, Delivered) and peer_outcome.all_delivered, peer_outcome
    for g, lr, pr in zip(("g0", "g1"), ends.memory.regions, ends.peer.regions):
        got = ends.peer.read(pr.name, ps[g]) if local_op == "publish" else ends.memory.read(lr.name, ls[g])
        assert got == payload[g], f"group {g}: destination bytes differ"
    assert ends.local.path_of(ends.attempts[-1]) == ends.expected_path


def test_fetch_holding_a_prefix_gets_only_the_rest(ends: Ends) -> None:
    held = 40
    local_view, peer_view, ls, ps = _views(ends.memory.regions, ends.peer.regions, rows=100, seed=3, local_from=held)
    rng = np.random.default_rng(4)
    payload = {}
    for g, lr, pr in zip(("g0", "g1"), ends.memory.regions, ends.peer.regions):
        payload[g] = rng.integers(0, 256, ls[g].size * lr.slot_bytes, dtype=np.uint8).tobytes()
        ends.peer.write(pr.name, ps[g], payload[g])
        ends.memory.write(lr.name, ls[g], b"\x5a" * len(payload[g]))
    outcome, peer_outcome = _run(ends, local_view, peer_view, "fetch")
    assert isinstance(outcome, Delivered) and outcome.all_delivered
    for gi, (g, lr, _) in enumerate(zip(("g0", "g1"), ends.memory.regions, ends.peer.regions)):
        size = lr.slot_bytes
        got = ends.memory.read(lr.name, ls[g])
        assert got[held * size:] == payload[g][held * size:], "the missing rows did not arrive"
        assert got[:held * size] == b"\x5a" * (held * size), "rows the fetcher already held were written"
        mask = peer_outcome.masks[gi]  # the publisher learns exactly which of its rows were taken
        assert not mask[:held].any() and mask[held:].all()
    assert ends.local.path_of(ends.attempts[-1]) == ends.expected_path


def _filled(ends: Ends, seed: int, layout: bytes = LAYOUT) -> tuple[View, View, dict[str, bytes], dict[str, bytes]]:
    local_view, peer_view, ls, ps = _views(ends.memory.regions, ends.peer.regions, rows=16, seed=seed, layout=layout)
    for g, lr, pr in zip(("g0", "g1"), ends.memory.regions, ends.peer.regions):
        ends.memory.write(lr.name, ls[g], b"\x11" * (ls[g].size * lr.slot_bytes))
        ends.peer.write(pr.name, ps[g], b"\x22" * (ps[g].size * pr.slot_bytes))
    before_local = {g.layer_group: ends.memory.read(g.region.name, g.slots) for g in local_view.groups}
    before_peer = {g.layer_group: ends.peer.read(g.region.name, g.slots) for g in peer_view.groups}
    return local_view, peer_view, before_local, before_peer


def _untouched(ends: Ends, local_view: View, peer_view: View, before_local: dict[str, bytes],
               before_peer: dict[str, bytes]) -> None:
    for g in local_view.groups:
        assert ends.memory.read(g.region.name, g.slots) == before_local[g.layer_group], "local rows touched"
    for g in peer_view.groups:
        assert ends.peer.read(g.region.name, g.slots) == before_peer[g.layer_group], "peer rows touched"


@pytest.mark.parametrize("cut", ["truncated", "flipped", "garbage"])
def test_malformed_hint_bytes_refused(ends: Ends, cut: str) -> None:
    local_view, peer_view, before_local, before_peer = _filled(ends, seed=5)
    good = ends.peer.describe_bytes(peer_view)
    bad = {"truncated": good[: len(good) // 2], "flipped": good[:10] + bytes([good[10] ^ 0xFF]) + good[11:],
           "garbage": b"\x93\x01\x02\x03not a hint"}[cut]
    with pytest.raises(WireError):
        decode_hint(bad)  # here, where the router would decode it
    with pytest.raises(WireError):  # and in the child, which refuses before submitting anything
        ends.peer.start_bytes("fetch", peer_view, encode_hint(ends.local.describe(local_view))[:-3])
    _untouched(ends, local_view, peer_view, before_local, before_peer)


def test_unsigned_hint_refused_when_a_key_is_set(ends: Ends, monkeypatch: pytest.MonkeyPatch) -> None:
    local_view, peer_view, before_local, before_peer = _filled(ends, seed=6)
    unsigned = ends.peer.describe_bytes(peer_view)  # the child has no KVXFER_HINT_KEY
    monkeypatch.setenv("KVXFER_HINT_KEY", "ab" * 32)
    with pytest.raises(WireError):
        decode_hint(unsigned)
    signed = encode_hint(ends.local.describe(local_view))  # signed with our key: the child has none
    with pytest.raises(WireError):
        decode_hint(signed, key=bytes.fromhex("cd" * 32))
    assert decode_hint(signed).agent == ends.local.name
    _untouched(ends, local_view, peer_view, before_local, before_peer)


def test_wrong_layout_refused_before_any_byte_moves(ends: Ends) -> None:
    local_view, peer_view, before_local, before_peer = _filled(ends, seed=7)
    other = View(peer_view.request, peer_view.tokens, peer_view.groups, b"another-model")
    peer_hint = decode_hint(ends.peer.describe_bytes(other))
    for submit in (ends.local.fetch, ends.local.publish):
        ends.local.describe(local_view)
        with pytest.raises(InvalidSubmission, match="layout mismatch"):
            submit(local_view, peer_hint)
    with pytest.raises(InvalidSubmission, match="layout mismatch"):  # the child refuses ours alike
        ends.peer.start_bytes("fetch", other, encode_hint(ends.local.describe(local_view)))
    _untouched(ends, local_view, peer_view, before_local, before_peer)


def test_hint_with_foreign_or_broken_metadata_refused(ends: Ends) -> None:
    local_view, peer_view, before_local, before_peer = _filled(ends, seed=8)
    hint = decode_hint(ends.peer.describe_bytes(peer_view))
    for endpoint, match in ((b"\x00" * 64, "refused the metadata"), (ends.local.describe(local_view).endpoint, "metadata")):
        forged = dataclasses.replace(hint, endpoint=endpoint)
        ends.local.describe(local_view)
        with pytest.raises(InvalidSubmission, match=match):
            ends.local.fetch(local_view, forged)
    _untouched(ends, local_view, peer_view, before_local, before_peer)
