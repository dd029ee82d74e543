"""IpcBackend scenarios with the peer in a child process, run over real CUDA by
``tests/gpu/test_ipc.py`` and over ``kvxfer.testing.host_cuda`` by
``tests/twoproc/test_ipc_emulated.py`` (``cuda`` picks which: None is kvxfer._native).
Each raises AssertionError naming what went wrong, and closes everything it started first.
The scenarios between engine geometries (``geometry_ends``) are run by
``tests/gpu/test_ipc_geometry_gpu.py`` and ``tests/twoproc/test_ipc_geometry.py``.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np

from kvxfer.backends.common.transform import Rows, TransformPlan, plan_transform
from kvxfer.backends.ipc import IpcBackend
from kvxfer.backends.ipc.doorbells import EXTRA_BELL
from kvxfer.contract import (
    CacheKind,
    Delivered,
    Failed,
    KVGeometry,
    LayerGroupRows,
    LayoutMismatch,
    Outcome,
    SlotRegion,
    TokenRange,
    TransferMode,
    View,
)
from kvxfer.testing.ipc_pairs import ChildPeer, DeviceKV, DeviceRows, PeerSpec


def views(local: SlotRegion, peer: SlotRegion, n: int, seed: int,
          request: str = "r") -> tuple[View, View, np.ndarray, np.ndarray]:
    """A view of ``n`` scattered rows on each end, ordinals 0..n-1, and the slots of each."""
    rng = np.random.default_rng(seed)
    ls = rng.permutation(local.slots)[:n].astype(np.int64)
    ps = rng.permutation(peer.slots)[:n].astype(np.int64)
    ords = np.arange(n, dtype=np.int64)
    tokens = TokenRange(0, n * 16)
    lv = View(request, tokens, (LayerGroupRows("g", CacheKind.PAGED, local, ls, ords),), b"L")
    pv = View(request, tokens, (LayerGroupRows("g", CacheKind.PAGED, peer, ps, ords),), b"L")
    return lv, pv, ls, ps


def close_all(local: IpcBackend, peers: list[ChildPeer], memory: DeviceRows | DeviceKV) -> None:
    """Close everything, then assert that the backend's shutdown left no attempt unquiesced."""
    try:
        left = local.shutdown()
    finally:
        for peer in peers:
            peer.close()
        memory.close()
    assert left == frozenset(), f"attempts not quiesced at shutdown: {left}"


@dataclass(frozen=True)
class ScatteredMove:
    ours: Outcome | None
    theirs: Outcome | None
    quiet: bool  # the peer's attempt quiesced
    slots: np.ndarray  # where the rows landed, in row order
    source: bytes  # the bytes sent, row after row
    landed: bytes  # the bytes where they landed


def move_scattered(mode: TransferMode, local: IpcBackend, memory: DeviceRows, peer: ChildPeer, *, rows: int,
                   row_bytes: int, seed: int, request: str = "r", fill: bytes = b"\0") -> ScatteredMove:
    """``rows`` scattered rows (picked and filled from ``seed``) of the first regions, moved by
    ``local`` (the active end: push publishes, pull fetches) over destination rows holding
    ``fill``. Each end describes its view before the other submits."""
    local.register(memory.regions)
    lv, pv, ls, ps = views(memory.regions[0], peer.regions[0], rows, seed, request)
    payload = np.random.default_rng(seed + 1).integers(0, 256, rows * row_bytes, dtype=np.uint8).tobytes()
    hint = peer.describe(pv)
    if mode is TransferMode.PUSH:
        memory.write(memory.regions[0].name, ls, payload)
        peer.write(peer.regions[0].name, ps, fill * (rows * row_bytes))
        handle = peer.start("fetch", pv, local.describe(lv))
        attempt = local.publish(lv, hint)
    else:
        peer.write(peer.regions[0].name, ps, payload)
        memory.write(memory.regions[0].name, ls, fill * (rows * row_bytes))
        handle = peer.start("publish", pv, local.describe(lv))
        attempt = local.fetch(lv, hint)
    assert attempt.wait(30), "the local attempt did not end"
    theirs, quiet = peer.result(handle, 30)
    if mode is TransferMode.PUSH:
        return ScatteredMove(attempt.poll(), theirs, quiet, ps, payload, peer.read(peer.regions[0].name, ps))
    return ScatteredMove(attempt.poll(), theirs, quiet, ls, payload, memory.read(memory.regions[0].name, ls))


def large_rows_byte_exact(mode: TransferMode, *, cuda: ModuleType | None, row_bytes: int, slots: int,
                          rows: int, devices: tuple[int, int] = (0, 0)) -> None:
    """``rows`` scattered rows moved by this process's backend (the active end in both modes:
    push publishes, pull fetches); both outcomes Delivered for every row; bytes equal.
    ``devices``: this end's and the child's CUDA devices (two GPUs: over peer access)."""
    peer = ChildPeer(PeerSpec(mode, geometry=(("P", row_bytes, slots),), device=devices[1], emulated=cuda is not None))
    memory = DeviceRows((("L", row_bytes, slots),), devices[0], cuda=cuda)
    local = IpcBackend("local", mode, device=devices[0], cuda=cuda)
    try:
        move = move_scattered(mode, local, memory, peer, rows=rows, row_bytes=row_bytes, seed=5, request="big",
                              fill=b"\x5a")
        for outcome in (move.ours, move.theirs):
            assert isinstance(outcome, Delivered) and outcome.all_delivered, outcome
        assert move.quiet, "the peer's attempt did not quiesce"
        assert move.landed == move.source, "the destination rows differ from the source rows"
    finally:
        close_all(local, [peer], memory)


def dead_peers_fail_by_name(*, cuda: ModuleType | None) -> None:
    """A killed fetcher: our next publish fails naming it, and its mapping closes. A fetch of
    ours waiting on a publisher that dies before publishing fails and quiesces."""
    emulated = cuda is not None
    peer = ChildPeer(PeerSpec(TransferMode.PUSH, emulated=emulated))
    peer2: ChildPeer | None = None
    memory = DeviceRows((("L0", 256, 64), ("L1", 96, 40)), cuda=cuda)
    local = IpcBackend("local", TransferMode.PUSH, dead_peer_grace_s=0.1, cuda=cuda)
    try:
        local.register(memory.regions)
        lv, pv, ls, _ = views(memory.regions[0], peer.regions[0], 8, 7)
        memory.write("L0", ls, bytes(range(256)) * 8)
        prefill_hint = peer.describe(pv)
        handle = peer.start("fetch", pv, local.describe(lv))
        first = local.publish(lv, prefill_hint)
        assert first.wait(15) and isinstance(first.poll(), Delivered), first.poll()
        assert peer.result(handle, 15)[0] is not None
        assert len(local._copies.mappings) == 1, "the mapping was not cached after use"
        prefill_hint = peer.describe(pv)
        peer.kill()
        deadline = time.monotonic() + 10
        while len(local._copies.mappings) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(local._copies.mappings) == 0, "the dead peer's mapping was not closed"
        local.describe(lv)
        second = local.publish(lv, prefill_hint)
        assert second.wait(15)
        outcome = second.poll()
        assert isinstance(outcome, Failed) and "gone" in outcome.reason and not outcome.masks[0].any(), outcome

        peer2 = ChildPeer(PeerSpec(TransferMode.PUSH, emulated=emulated))
        lv2, pv2, _, _ = views(memory.regions[0], peer2.regions[0], 8, 8, "r2")
        local.describe(lv2)
        wait = local.fetch(lv2, peer2.describe(pv2))
        time.sleep(0.1)  # the progress thread connects to the peer
        peer2.kill()
        assert wait.wait(15), "a wait on a dead publisher never ended"
        assert isinstance(wait.poll(), Failed) and wait.quiesced(), wait.poll()
    finally:
        close_all(local, [peer] + ([peer2] if peer2 is not None else []), memory)


def doorbells_conclude_waits(mode: TransferMode, *, cuda: ModuleType | None, doorbell: bool = True,
                             transfers: int = 3) -> None:
    """The child waits (push: it fetches; pull: it publishes) with busy_poll; every transfer
    moves all of its rows, so the doorbell rings before the record arrives: the child's waits
    are each concluded by it (none without doorbells), with bytes and masks exact."""
    peer = ChildPeer(PeerSpec(mode, emulated=cuda is not None, busy_poll=True, doorbell=doorbell))
    memory = DeviceRows((("L0", 256, 64),), cuda=cuda)
    local = IpcBackend("local", mode, cuda=cuda)
    try:
        local.register(memory.regions)
        for i in range(transfers):
            lv, pv, ls, ps = views(memory.regions[0], peer.regions[0], 8, i, f"r{i}")
            payload = bytes([i + 1]) * 256 * 8
            if mode is TransferMode.PUSH:
                memory.write("L0", ls, payload)
                peer_hint = peer.describe(pv)
                handle = peer.start("fetch", pv, local.describe(lv))
                attempt = local.publish(lv, peer_hint)
            else:
                peer.write("P0", ps, payload)
                peer_hint = peer.describe(pv)
                handle = peer.start("publish", pv, local.describe(lv))
                attempt = local.fetch(lv, peer_hint)
            assert (peer_hint.extra(EXTRA_BELL) is not None) == doorbell, "the hint's doorbell"
            assert attempt.wait(10) and isinstance(attempt.poll(), Delivered), f"local outcome {attempt.poll()!r}"
            theirs, quiet = peer.result(handle, 10)
            assert isinstance(theirs, Delivered) and theirs.all_delivered and quiet, f"peer outcome {theirs!r}"
            moved = peer.read("P0", ps) if mode is TransferMode.PUSH else memory.read("L0", ls)
            assert moved == payload, f"transfer {i}: rows differ"
        rung = peer.bells_rung()
        assert rung == (transfers if doorbell else 0), f"{rung} of {transfers} waits ended by their doorbell"
    finally:
        close_all(local, [peer], memory)


# --- engine geometries ------------------------------------------------------------------
GEO_TOKENS = 100  # not a whole number of blocks at either end
KV_BASE = {"kind": "layers", "layers": 2, "kv_heads": 4, "head_dim": 8, "heads": [0, 4], "blocks": 12,
           "block_tokens": 16, "order": "nhd"}


def kv_spec(**changes: Any) -> dict[str, Any]:
    return {**KV_BASE, **changes}


# name: (the source's KV, the destination's, the heads the destination's view narrows to)
GEOMETRY_CASES: dict[str, tuple[dict[str, Any], dict[str, Any], tuple[int, int] | None]] = {
    "tp1-to-rank1of2": (kv_spec(), kv_spec(heads=[2, 4]), None),
    "rank1of2-to-tp1-narrowed": (kv_spec(heads=[2, 4]), kv_spec(), (2, 4)),
    "bt16-to-bt32": (kv_spec(), kv_spec(block_tokens=32), None),
    "bt64-to-bt16": (kv_spec(block_tokens=64, blocks=4), kv_spec(), None),
    "nhd-to-hnd": (kv_spec(), kv_spec(order="hnd", block_tokens=32), None),
    "hnd-to-nhd": (kv_spec(order="hnd", block_tokens=32), kv_spec(heads=[1, 3]), None),
    "layer-major-to-block-major-pool": (kv_spec(), kv_spec(kind="pool", block_tokens=32, heads=[0, 2]), None),
}


def kv_tokens(geometry: KVGeometry, memory: dict[str, np.ndarray], table: Any, tokens: int) -> np.ndarray:
    """``[planes, tokens, heads, unit_bytes]`` uint8 of a request whose logical block i is
    ``table[i]``, read through ``geometry`` from ``memory`` (region name -> its bytes)."""
    t = np.arange(tokens, dtype=np.int64)
    block = np.asarray(table, dtype=np.int64)[t // geometry.block_tokens]
    at = block * geometry.block_stride + (t % geometry.block_tokens) * geometry.token_stride
    at = at[:, None] + np.arange(geometry.head_count, dtype=np.int64)[None, :] * geometry.head_stride
    at = at[..., None] + np.arange(geometry.unit_bytes, dtype=np.int64)
    return np.stack([memory[geometry.regions[region].name][offset + at] for region, offset in geometry.planes])

# Cases that cannot meet: both ends refuse them by name, before anything moves.
REFUSED_CASES: dict[str, tuple[dict[str, Any], dict[str, Any], tuple[int, int] | None]] = {
    "heads-the-publisher-lacks": (kv_spec(heads=[0, 2]), kv_spec(), None),
}


@dataclass
class GeometryEnds:
    """One transfer between two engine geometries, set up, not submitted: this process's
    IpcBackend over ``memory`` and the child's, one the source (filled with random KV) and
    the other the destination (zeros); ``read`` and ``write`` are the two ends' views."""

    local: IpcBackend
    peer: ChildPeer
    memory: DeviceKV
    peer_offsets: dict[str, int]
    read: View
    write: View
    local_is_source: bool
    mode: TransferMode

    @property
    def local_active(self) -> bool:
        return self.local_is_source == (self.mode is TransferMode.PUSH)

    def start(self) -> tuple[Any, int]:
        """Each end describes its view before the other submits; (our attempt, the child's handle)."""
        mine, theirs = (self.read, self.write) if self.local_is_source else (self.write, self.read)
        peer_hint = self.peer.describe(theirs)
        handle = self.peer.start("fetch" if self.local_is_source else "publish", theirs, self.local.describe(mine))
        submit = self.local.publish if self.local_is_source else self.local.fetch
        return submit(mine, peer_hint), handle

    def _bytes(self, source: bool) -> dict[str, np.ndarray]:
        regions = (self.read if source else self.write).geometry.regions  # type: ignore[union-attr]
        if source == self.local_is_source:
            return {r.name: self.memory.bytes_of(r.name) for r in regions}
        return {r.name: np.frombuffer(self.peer.read(r.name, np.arange(r.slots, dtype=np.int64)), dtype=np.uint8)
                for r in regions}

    def expected(self) -> np.ndarray:
        """``[planes, tokens, heads, unit]`` bytes the destination's view should end with."""
        src, dst = self.read.geometry, self.write.geometry
        assert src is not None and dst is not None
        want = kv_tokens(src, self._bytes(True), self.read.groups[0].slots, GEO_TOKENS)
        first = dst.heads[0] - src.heads[0]
        return want[:, :, first:first + dst.head_count]

    def got(self) -> np.ndarray:
        assert self.write.geometry is not None
        return kv_tokens(self.write.geometry, self._bytes(False), self.write.groups[0].slots, GEO_TOKENS)

    def plan(self) -> TransformPlan:
        """The transfer's plan, as either end makes it (at its own addresses)."""
        assert self.read.geometry is not None and self.write.geometry is not None
        return plan_transform(self.read.geometry, Rows.of_view(self.read), self.write.geometry,
                              Rows.of_view(self.write))

    def plan_masks(self, runs: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(source rows, destination rows) that the first ``runs`` runs (all: None) prove."""
        plan = self.plan()
        return plan.masks(plan.runs if runs is None else runs)


@contextlib.contextmanager
def geometry_ends(mode: TransferMode, case: str, *, cuda: ModuleType | None, local_is_source: bool,
                  devices: tuple[int, int] = (0, 0), seed: int = 7, busy_poll: bool = False) -> Iterator[GeometryEnds]:
    """The ends of GEOMETRY_CASES[case] (or REFUSED_CASES[case]); ``busy_poll``: the child's
    backend busy-polls, with its doorbell. Everything is closed on the way out, and our
    backend's shutdown must leave no attempt unquiesced."""
    from kvxfer.lender.external import ExternalLender  # torch: only where an engine's KV is made

    src_spec, dst_spec, heads = {**GEOMETRY_CASES, **REFUSED_CASES}[case]
    local_spec, peer_spec = (src_spec, dst_spec) if local_is_source else (dst_spec, src_spec)
    peer = ChildPeer(PeerSpec(mode, kv=peer_spec, device=devices[1], emulated=cuda is not None, busy_poll=busy_poll))
    try:
        memory = DeviceKV(local_spec, devices[0], cuda, name="local-kv")
    except BaseException:
        peer.close()
        raise
    local = IpcBackend("local", mode, device=devices[0], cuda=cuda)
    try:
        local.register(memory.regions)
        if local_is_source:
            memory.fill(seed)
        else:
            peer.fill(seed)
        theirs, peer_offsets = peer.kv()
        src, dst = (memory.kv, theirs) if local_is_source else (theirs, memory.kv)
        rng = np.random.default_rng(seed)
        s_table = rng.permutation(src_spec["blocks"])[: -(-GEO_TOKENS // src_spec["block_tokens"])]
        d_table = rng.permutation(dst_spec["blocks"])[: -(-GEO_TOKENS // dst_spec["block_tokens"])]
        read = ExternalLender(src).lend_read("req", s_table, (0, GEO_TOKENS)).view()
        write = ExternalLender(dst).lend_write("req", d_table, (0, GEO_TOKENS), heads=heads).view()
        yield GeometryEnds(local, peer, memory, peer_offsets, read, write, local_is_source, mode)
    finally:
        close_all(local, [peer], memory)


def _finish(ends: GeometryEnds, attempt: Any, handle: int) -> tuple[Any, Any]:
    assert attempt.wait(30), "our attempt did not end"
    theirs, quiet = ends.peer.result(handle, 30)
    assert quiet, f"the child's attempt did not quiesce ({theirs!r})"
    return attempt.poll(), theirs


def geometry_moves_byte_exact(ends: GeometryEnds) -> None:
    """The whole request's KV lands in the destination's layout, byte for byte; every row of
    both ends Delivered; at least one region of each end starts inside its allocation."""
    assert not ends.got().any(), "the destination is not zeros before the transfer"
    ours, theirs = _finish(ends, *ends.start())
    for outcome in (ours, theirs):
        assert isinstance(outcome, Delivered) and outcome.all_delivered, outcome
    src_mask, dst_mask = ends.plan_masks()
    assert src_mask.all() and dst_mask.all()
    import torch

    got, want = torch.from_numpy(ends.got()), torch.from_numpy(ends.expected())
    assert torch.equal(got, want), "the destination's KV differs from the source's"
    assert any(ends.memory.offsets.values()) and any(ends.peer_offsets.values()), (
        f"no region starts inside its allocation: {ends.memory.offsets}, {ends.peer_offsets}")


def geometry_fault_marks_whole_blocks(ends: GeometryEnds, runs: int) -> None:
    """The active end copies only the first ``runs`` runs (fail_after_rows counts runs): both
    ends fail with the plan's masks, and those rows, no more, hold the source's KV."""
    if ends.local_active:
        ends.local.fail_after_rows = runs
    else:
        assert ends.peer.inject_fault(runs)
    ours, theirs = _finish(ends, *ends.start())
    assert isinstance(ours, Failed) and isinstance(theirs, Failed), (ours, theirs)
    src_mask, dst_mask = ends.plan_masks(runs)
    local_mask, peer_mask = (src_mask, dst_mask) if ends.local_is_source else (dst_mask, src_mask)
    assert np.array_equal(ours.masks[0], local_mask), (ours.masks[0], local_mask)
    assert np.array_equal(theirs.masks[0], peer_mask), (theirs.masks[0], peer_mask)
    # Runs go in token order from the request's first token: these tokens, no more, arrived.
    copied = int(ends.plan().run_tokens[:runs].sum())
    got, want = ends.got(), ends.expected()
    assert np.array_equal(got[:, :copied], want[:, :copied]), "the runs copied do not hold the source's KV"
    assert not got[:, copied:].any(), "bytes past the runs copied arrived"


def geometry_refused_touching_nothing(ends: GeometryEnds, match: str) -> None:
    """Both ends refuse the submission with a LayoutMismatch naming ``match`` (ours before the
    child's, whichever is active), and the destination's KV stays zeros."""
    mine, theirs = (ends.read, ends.write) if ends.local_is_source else (ends.write, ends.read)
    peer_hint = ends.peer.describe(theirs)
    local_hint = ends.local.describe(mine)
    submit = ends.local.publish if ends.local_is_source else ends.local.fetch
    refusals: list[Exception] = []
    for attempt in (lambda: submit(mine, peer_hint),
                    lambda: ends.peer.start("fetch" if ends.local_is_source else "publish", theirs, local_hint)):
        try:
            attempt()
        except LayoutMismatch as exc:
            refusals.append(exc)
    assert len(refusals) == 2, f"refused by {len(refusals)} of the two ends: {refusals}"
    assert all(match in str(exc) for exc in refusals), refusals
    time.sleep(0.1)
    assert not ends.got().any(), "a refused transfer wrote the destination"
