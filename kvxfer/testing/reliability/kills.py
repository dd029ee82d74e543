"""Experiment 1: SIGKILL of a NIXL peer mid-transfer, many rounds, as
tests/chaos/test_nixl_peer_kill.py does it once per case.

A local NixlBackend in this process, the peer a NixlBackend in a child process
(SubprocessPeer over ``kvxfer.testing.nixl_pairs:child_backend``), host rows at both ends,
paced chunks. Rounds cycle over push and pull and over the local end fetching and
publishing, so the local end is the active end (it moves the bytes) in half of them and
the passive end (it waits for the peer's record) in the other half:

- active: the local progress thread is held at its first step after a chunk was proven,
  the peer killed, the thread let go; the kill lands after that chunk and before the last.
- passive: the peer pauses for an hour after its first chunk; once that chunk's bytes are
  in the destination, the peer is killed.

What a round records is what a user relies on: the rows the local outcome claims, whether
the claimed rows hold the source's bytes (where the destination is still readable: local
memory; a killed peer's memory is gone), and how long the local attempt took to conclude
and quiesce after the kill.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvxfer.backends.nixl import NixlBackend
from kvxfer.contract import CacheKind, LayerGroupRows, TokenRange, TransferMode, View
from kvxfer.testing.memory import HostRows, retain_if_unquiesced
from kvxfer.testing.nixl_pairs import host_rows
from kvxfer.testing.progress_hold import hold_progress
from kvxfer.testing.reliability.common import Progress, max_ms, ms
from kvxfer.testing.subprocess_peer import SubprocessPeer
from kvxfer.testing.waiting import settle
from kvxfer.wire import decode_hint, encode_hint

ROW = 16 << 10
ROWS = 96              # per round, over two layer groups
CHUNK_ROWS = 4
PAUSE_S = 0.04         # between the active end's chunk posts: about 1 s for the whole transfer
STALL_S = 3600.0       # a passive round's peer pauses this long after its first chunk
PROGRESS_S = 15.0      # for a first chunk to be proven or to land (a loaded 2-core machine)
WAIT_S = 30.0          # the longest this harness waits for a concluded, quiesced attempt
LOCAL = (("A", ROW, 128), ("B", ROW, 128))
PEER = (("PA", ROW, 128), ("PB", ROW, 128))
CASES = ((TransferMode.PUSH, "fetch"), (TransferMode.PULL, "fetch"),
         (TransferMode.PUSH, "publish"), (TransferMode.PULL, "publish"))


@dataclass(frozen=True)
class KillRound:
    index: int
    mode: str
    local_op: str          # "fetch" | "publish"
    local_end: str         # "active" (moves the bytes) | "passive" (waits for the peer's record)
    kill_after_chunks: int  # chunks proven (active) or landed (passive: always the peer's first) before the kill
    outcome: str           # "failed" | "delivered" | "cancelled" | "none" (no outcome within WAIT_S)
    reason: str
    rows: int
    rows_claimed: int      # True in the local outcome's masks
    rows_checked: int      # claimed rows whose destination bytes were read and compared
    rows_wrong: int        # checked rows whose bytes differ from the source's
    detection_s: float | None  # kill -> concluded and quiesced; None if not within WAIT_S
    quiesced: bool
    shutdown_clean: bool | None  # local shutdown() returned an empty set (None: the round raised first)
    setup_error: str = ""  # the kill could not be placed mid-transfer: the round measures nothing


@dataclass(frozen=True)
class KillSummary:
    rounds: int
    rounds_measured: int
    rows: int
    rows_claimed: int
    rows_checkable: int    # claimed rows whose destination is local memory, readable after the kill
    rows_checked: int
    rows_wrong: int
    detection_p50_ms: float | None
    detection_max_ms: float | None
    not_concluded: int     # rounds whose attempt had no outcome and quiescence within WAIT_S
    unquiesced_at_shutdown: int
    claimed_by_case: dict[str, int]
    details: tuple[KillRound, ...]


def _child(mode: TransferMode, pause_s: float) -> SubprocessPeer:
    kwargs = {"mode": mode.value, "buffers": [list(b) for b in PEER], "chunk_bytes": CHUNK_ROWS * ROW,
              "chunk_pause_s": pause_s, "deadline_s": 20.0}
    return SubprocessPeer("kvxfer.testing.nixl_pairs:child_backend", kwargs)


def _views(memory: HostRows, peer: SubprocessPeer, request: str, rng: np.random.Generator) -> tuple[View, View]:
    """Half of each region's slots, scattered at random, at each end; ordinals 0..n."""
    half = ROWS // 2
    local, remote = [], []
    ordinals = np.arange(half, dtype=np.int64)
    for name, lr, pr in zip(("g0", "g1"), memory.regions, peer.regions):
        local.append(LayerGroupRows(name, CacheKind.PAGED, lr, rng.permutation(lr.slots)[:half], ordinals))
        remote.append(LayerGroupRows(name, CacheKind.PAGED, pr, rng.permutation(pr.slots)[:half], ordinals))
    tokens = TokenRange(0, ROWS * 16)
    return View(request, tokens, tuple(local), b"chaos"), View(request, tokens, tuple(remote), b"chaos")


def _hold_once_proven(backend: NixlBackend, chunks: int) -> tuple[threading.Event, threading.Event]:
    """Hold the progress thread once ``chunks`` chunks of its active job are proven, until the
    gate is set (``kvxfer.testing.progress_hold.hold_progress``): the kill lands after them and before
    the last chunk, whatever the load; varying ``chunks`` moves it over the whole transfer."""
    return hold_progress(backend, ready=lambda: any(len(job.done) >= chunks for job in list(backend._active)))


def _landed(read: Callable[[str, np.ndarray], bytes], view: View) -> bool:
    """Chunks go in view order: a first chunk no longer all zeros means bytes landed."""
    return any(any(read(g.region.name, g.slots[:CHUNK_ROWS])) for g in view.groups)


def _outcome_name(outcome: object) -> str:
    return type(outcome).__name__.lower() if outcome is not None else "none"


def run_round(index: int, mode: TransferMode, local_op: str, rng: np.random.Generator) -> KillRound:
    active = (mode is TransferMode.PUSH) == (local_op == "publish")
    memory = host_rows(LOCAL)
    local = NixlBackend(mode=mode, chunk_bytes=CHUNK_ROWS * ROW, chunk_pause_s=PAUSE_S if active else 0.0,
                        deadline_s=20.0)
    gate = threading.Event()
    peer: SubprocessPeer | None = None
    target = int(rng.integers(1, ROWS // CHUNK_ROWS)) if active else 1
    result = functools.partial(KillRound, index=index, mode=mode.value, local_op=local_op,
                               local_end="active" if active else "passive", kill_after_chunks=target)
    try:
        local.register(memory.regions)
        held, gate = _hold_once_proven(local, target) if active else (threading.Event(), gate)
        peer = _child(mode, 0.0 if active else STALL_S)
        local_view, peer_view = _views(memory, peer, f"kill-{index}", rng)
        payload = {g.layer_group: rng.integers(0, 256, len(g) * ROW, dtype=np.uint8).tobytes()
                   for g in local_view.groups}
        local_is_dest = local_op == "fetch"
        _fill(memory, peer, local_view, peer_view, payload, local_is_dest)
        attempt = _start_both(local, peer, local_op, local_view, peer_view)
        dest_read, dest_view = (memory.read, local_view) if local_is_dest else (peer.read, peer_view)
        if not _kill_placed(attempt, held if active else None, dest_read, dest_view):
            gate.set()
            attempt.wait(WAIT_S)
            return result(outcome=_outcome_name(attempt.poll()), reason="", rows=ROWS, rows_claimed=0,
                          rows_checked=0, rows_wrong=0, detection_s=None, quiesced=attempt.quiesced(),
                          shutdown_clean=not local.shutdown(),
                          setup_error=f"no chunk proven or landed within {PROGRESS_S:g}s, or done before the kill")
        killed = time.monotonic()
        peer.kill()
        gate.set()
        finished = attempt.wait(WAIT_S)
        detection = round(time.monotonic() - killed, 6) if finished else None
        outcome = attempt.poll()
        masks = [np.asarray(m, dtype=bool) for m in outcome.masks] if outcome is not None else []
        claimed = int(sum(int(m.sum()) for m in masks))
        # Only local memory can still be read: a killed peer's is gone.
        checked, wrong = _check_claimed(memory, local_view, masks, payload) if local_is_dest else (0, 0)
        return result(outcome=_outcome_name(outcome), reason=getattr(outcome, "reason", "")[:200],
                      rows=ROWS, rows_claimed=claimed, rows_checked=checked, rows_wrong=wrong,
                      detection_s=detection,
                      quiesced=attempt.quiesced(), shutdown_clean=not local.shutdown())
    finally:
        gate.set()  # a held progress thread must run on, or shutdown() waits for it
        if peer is not None:
            peer.kill()
        retain_if_unquiesced(local.shutdown(), memory)


def _start_both(local: NixlBackend, peer: SubprocessPeer, local_op: str, local_view: View, peer_view: View
                ) -> Any:
    """The peer's attempt, then the local one; hints cross as wire bytes, as a router carries them."""
    local_hint = encode_hint(local.describe(local_view))
    peer_hint = decode_hint(peer.describe_bytes(peer_view))
    peer.start_bytes("publish" if local_op == "fetch" else "fetch", peer_view, local_hint)
    return (local.fetch if local_op == "fetch" else local.publish)(local_view, peer_hint)


def _fill(memory: HostRows, peer: SubprocessPeer, local_view: View, peer_view: View, payload: dict[str, bytes],
          local_is_dest: bool) -> None:
    """Random bytes at the source, zeros at the destination: a claimed row that did not land reads wrong."""
    for lg, pg in zip(local_view.groups, peer_view.groups):
        data, zeros = payload[lg.layer_group], b"\x00" * len(payload[lg.layer_group])
        if local_is_dest:
            peer.write(pg.region.name, pg.slots, data)
            memory.write(lg.region.name, lg.slots, zeros)
        else:
            memory.write(lg.region.name, lg.slots, data)
            peer.write(pg.region.name, pg.slots, zeros)


def _kill_placed(attempt: Any, held: threading.Event | None, dest_read: Callable[[str, np.ndarray], bytes],
                 dest_view: View) -> bool:
    """Whether the kill can land mid-transfer. Active (``held`` given): the progress thread is
    held after its target chunk. Passive: the peer's first chunk landed, the attempt still open."""
    if held is not None:
        return settle(lambda: held.is_set() or attempt.poll() is not None, PROGRESS_S) and held.is_set()
    return settle(lambda: _landed(dest_read, dest_view), PROGRESS_S) and attempt.poll() is None


def _check_claimed(memory: HostRows, view: View, masks: list[np.ndarray], payload: dict[str, bytes]
                   ) -> tuple[int, int]:
    """(rows checked, rows wrong): the claimed rows of ``view`` in local memory against the source's bytes."""
    checked = wrong = 0
    for g, mask in zip(view.groups, masks):
        rows = np.flatnonzero(mask)
        if rows.size == 0:
            continue
        got = np.frombuffer(memory.read(g.region.name, g.slots[rows]), dtype=np.uint8).reshape(rows.size, ROW)
        want = np.frombuffer(payload[g.layer_group], dtype=np.uint8).reshape(-1, ROW)[rows]
        checked += int(rows.size)
        wrong += int((got != want).any(axis=1).sum())
    return checked, wrong


def run_kills(rounds: int, *, seed: int = 0, progress: bool = True) -> KillSummary:
    rng = np.random.default_rng(seed)
    shown = Progress("kills", rounds, enabled=progress)
    details: list[KillRound] = []
    for i in range(rounds):
        mode, op = CASES[i % len(CASES)]
        try:
            details.append(run_round(i, mode, op, rng))
        except Exception as exc:  # e.g. a peer that did not start: the round is reported, the rest run
            details.append(KillRound(i, mode.value, op, "?", 0, "none", "", ROWS, 0, 0, 0, None, False, None,
                                     setup_error=f"{type(exc).__name__}: {exc}"[:300]))
        last = details[-1]
        shown.tick(i + 1, f"last: {last.mode} {last.local_op} {last.outcome}, {last.rows_claimed} rows claimed")
    measured = [r for r in details if not r.setup_error]
    detections = [r.detection_s for r in measured if r.detection_s is not None]
    by_case: dict[str, int] = {}
    for r in measured:
        key = f"{r.mode}-{r.local_op}"
        by_case[key] = by_case.get(key, 0) + r.rows_claimed
    summary = KillSummary(
        rounds=len(details), rounds_measured=len(measured), rows=sum(r.rows for r in measured),
        rows_claimed=sum(r.rows_claimed for r in measured),
        rows_checkable=sum(r.rows_claimed for r in measured if r.local_op == "fetch"),
        rows_checked=sum(r.rows_checked for r in measured), rows_wrong=sum(r.rows_wrong for r in measured),
        detection_p50_ms=ms(detections, 50), detection_max_ms=max_ms(detections),
        not_concluded=sum(r.detection_s is None for r in measured),
        unquiesced_at_shutdown=sum(r.shutdown_clean is False for r in details), claimed_by_case=by_case,
        details=tuple(details))
    shown.finish(f"{summary.rows_claimed} rows claimed, {summary.rows_wrong} wrong of {summary.rows_checked} checked")
    return summary
