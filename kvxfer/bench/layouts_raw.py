"""The engine-layouts baseline: raw NIXL, one descriptor per layer, K/V, prefill block and
decode rank, as serving engines move KV between mismatched TP degrees.

No kvxfer code is on the path (``nixl_raw.NixlPair``: an initiator agent here, a target
agent in a child process, one registered buffer each). Here lies the prefill's tensor per
layer, there both decode ranks' block-major pools one after the other; the prefill's block
ids are the kvxfer cases' (the same table), every end's a random choice from a pool twice
the request's blocks.

The layouts are the ones this practice needs, not the kvxfer cases' (facts ``prefill`` and
``decode`` say so): HND with 16-token blocks at both ends (prefill ``[2, blocks, 8, 16, 128]``
per layer, each rank ``[blocks, layers, 2, 4, 16, 128]``). Then a rank's heads of one block of
one layer's K (or V) are one contiguous run of 16 tokens x 4 heads x 256 B = 16 KiB, in the
same order at both ends: one descriptor per piece, the fewest this practice can post, and
the bytes land exactly. With the kvxfer cases' NHD prefill a piece would be 16 runs of 1 KiB,
and into their NHD 32-token pools an HND piece would be 64 runs of 256 B.

Both ranks' transfers (one prepared handle each, to the two ranks' address ranges of the one
target agent) are posted together and polled until both are DONE at the initiator.
Sampled pieces are checksummed at both ends after fresh bytes move once more.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from kvxfer.bench.cases import Measurement, Skip
from kvxfer.bench.config import BenchConfig, LatencySweep, OverheadSweep, Point
from kvxfer.bench.layouts import (
    DST_BLOCK_TOKENS,
    ELEMENT_BYTES,
    HEAD_DIM,
    RANKS,
    SEED_OFFSET,
    SRC_BLOCK_TOKENS,
    Workload,
)
from kvxfer.bench.nixl_raw import NixlPair, shared_pair
from kvxfer.bench.timing import check_fresh_bytes, time_runs

PIECE_BLOCK_TOKENS = SRC_BLOCK_TOKENS  # the decode ranks' block size here: a prefill block is a decode block


def source_spec(wl: Workload) -> Any:
    """The prefill's KV as this baseline lays it out (HND), for tests and facts."""
    return wl.source_spec("hnd")


def rank_specs(wl: Workload) -> tuple[Any, ...]:
    """Each decode rank's KV as this baseline lays it out (block-major HND, 16-token blocks)."""
    from kvxfer.testing.kv_ranks import KVSpec

    return tuple(KVSpec("pool", wl.layers, wl.kv_heads, heads, HEAD_DIM, wl.src_pool, PIECE_BLOCK_TOKENS,
                        order="hnd", name=f"rank{r}") for r, heads in enumerate(wl.rank_heads))


def tables(wl: Workload, seed: int) -> tuple[np.ndarray, list[np.ndarray]]:
    """The prefill's table (the kvxfer cases'), and each rank's in 16-token blocks."""
    return wl.tables(seed, dst_blocks=wl.src_blocks, dst_pool=wl.src_pool)


Offsets = list[np.ndarray]


def pieces(wl: Workload, s_table: np.ndarray, d_tables: list[np.ndarray]) -> tuple[Offsets, Offsets, int]:
    """(per rank: prefill offsets, decode offsets; piece bytes), one piece per (layer, K/V,
    block), offsets from each end's buffer start (the prefill's tensors one after the other;
    the ranks' pools one after the other), in the order engines post them: layer, K/V, block."""
    unit = HEAD_DIM * ELEMENT_BYTES
    share = wl.kv_heads // RANKS
    piece = PIECE_BLOCK_TOKENS * share * unit
    src_block = wl.kv_heads * SRC_BLOCK_TOKENS * unit       # [H, 16, D]
    planes = np.arange(2 * wl.layers, dtype=np.int64)[:, None]  # layer l's K is plane 2l, its V 2l + 1
    dst_block = 2 * wl.layers * piece                        # [L, 2, 4, 16, D]
    rank_bytes = wl.src_pool * dst_block
    local, remote = [], []
    for r in range(RANKS):
        src = planes * (wl.src_pool * src_block) + s_table[None, :] * src_block + r * piece
        dst = r * rank_bytes + d_tables[r][None, :] * dst_block + planes * piece
        local.append(src.reshape(-1))
        remote.append(dst.reshape(-1))
    return local, remote, piece


def span_bytes(wl: Workload) -> int:
    """Bytes each end's buffer needs: the prefill's tensors, or both ranks' pools (the same)."""
    return 2 * wl.layers * wl.src_pool * wl.kv_heads * SRC_BLOCK_TOKENS * HEAD_DIM * ELEMENT_BYTES


def _post_all(pair: NixlPair, handles: list[Any]) -> None:
    """Post every handle, then busy-poll until all are DONE."""
    agent = pair.agent
    states = [agent.transfer(h) for h in handles]
    pending = [h for h, s in zip(handles, states) if s != "DONE"]
    if "ERR" in states:
        raise RuntimeError("NIXL transfer failed (ERR)")
    while pending:
        left = []
        for h in pending:
            state = agent.check_xfer_state(h)
            if state == "ERR":
                raise RuntimeError("NIXL transfer failed (ERR)")
            if state != "DONE":
                left.append(h)
        pending = left


class PerPiece:
    def __init__(self, config: BenchConfig) -> None:
        self.config = config

    def throughput(self, point: Point) -> Measurement:
        if point.direction != "push":
            raise Skip("the engine-layouts cases push (prefill WRITEs into each decode rank)")
        wl = Workload.of(point, self.config.pool_factor)
        s_table, d_tables = tables(wl, self.config.seed + SEED_OFFSET)
        local, remote, piece = pieces(wl, s_table, d_tables)
        count = sum(x.size for x in local)
        if count > self.config.max_descriptors:
            raise Skip(f"{count} descriptors exceed the run's limit of {self.config.max_descriptors} "
                       "(--max-descriptors)")
        devices = self.config.active_devices("push") if point.memory == "device" else (0, 0)
        pair = shared_pair(point.memory, span_bytes(wl), devices)
        t0 = time.perf_counter()
        handles = [pair.handle("WRITE", pair.local.address + lo, pair.remote_address + ro, piece)
                   for lo, ro in zip(local, remote)]
        prep = time.perf_counter() - t0
        all_local, all_remote = np.concatenate(local), np.concatenate(remote)
        try:
            def stamp(seed: int) -> Any:
                return pair.verify("WRITE", all_local, all_remote, piece, seed)

            stamp(self.config.seed + point.rows)
            timing = time_runs(lambda: _post_all(pair, handles), self.config.repetition)
            check_fresh_bytes(stamp, lambda: _post_all(pair, handles), "decode ranks' pieces")
        finally:
            for h in handles:
                pair.release(h)
        facts: dict[str, Any] = {
            **wl.facts(), "descriptors": int(count), "descriptors_per_rank": [int(x.size) for x in local],
            "descriptor_bytes": int(piece), "descriptors_expected": wl.layers * 2 * wl.src_blocks * RANKS,
            "per": "layer x K/V x prefill block x decode rank", "prep_s": prep, "op": "WRITE", "processes": 2,
            "prefill": f"HND, a tensor per layer [2, {wl.src_pool}, {wl.kv_heads}, {SRC_BLOCK_TOKENS}, {HEAD_DIM}] "
                       "(not the kvxfer cases' NHD: a rank's heads of a block are contiguous here)",
            "decode": f"per rank, block-major HND [{wl.src_pool}, {wl.layers}, 2, {wl.kv_heads // RANKS}, "
                      f"{PIECE_BLOCK_TOKENS}, {HEAD_DIM}] (not the kvxfer cases' NHD {DST_BLOCK_TOKENS}-token "
                      "blocks: a piece lands as one run); both ranks in one target agent (one process)",
            "verified": True, "verified_pieces": "16 sampled pieces, checksummed at both ends",
            "measured": "post of both ranks' transfers to both DONE at the initiator (the target is not notified)",
        }
        if point.memory == "device":
            facts["devices"] = list(self.config.devices)
        return Measurement({"seconds_best": timing.best, "seconds_median": timing.median,
                            "reps": len(timing.samples)}, facts)

    def latency(self, point: Point, sweep: LatencySweep) -> Measurement:
        raise Skip("the engine-layouts cases measure throughput")

    def overhead(self, point: Point, sweep: OverheadSweep) -> Measurement:
        raise Skip("raw NIXL has no kvxfer submission to time")

    def close(self) -> None:
        pass  # the pair is shared and closed when the run ends
