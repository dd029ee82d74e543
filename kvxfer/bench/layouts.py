"""The engine-layouts workload: one request's KV from prefill TP 1 to decode TP 2, each engine
keeping KV its own way, with its references in the same run.

The workload (issue text) is a Llama-8B-like request: ``layers`` layers, 8 KV heads, head_dim
128, float16. Prefill (TP 1) keeps a tensor per layer ``[2, blocks, 16, 8, 128]`` (NHD, 16-token
blocks, layer-major); each of the two decode ranks keeps a block-major pool ``[blocks, layers,
2, 32, 4, 128]`` holding its 4 heads (``PagedKVPool`` BLOCK_MAJOR, ``EngineKV.from_pool(...,
heads=(0, 4) / (4, 8), kv_heads=8)``). Each decode rank receives exactly its heads: two transfers
per request, one per destination rank, submitted together. Block ids at every end are a
random choice from a pool ``pool_factor`` times larger (``slots="scattered"``), as a real
cache's are.

A bench point says the size: ``row_bytes`` is one prefill block of one layer (K and V, 16
tokens, every head: 2 x 16 x 8 x 256 B = 64 KiB sets 8 heads), ``rows`` the request's prefill
blocks (tokens / 16) and ``groups`` its layers; ``total_bytes`` is then the request's KV.

Cases:

- ``layouts_copy`` (reference): a copy of the same byte count in one process (D2D on the GPU,
  the host's best memcpy on the CPU: ``local.LocalCopy``): the ceiling a transform is judged by;
- ``layouts_nixl_packed`` / ``layouts_nixl_unpacked``: kvxfer's NixlBackend, push, with the
  packed path (gather into the arena, one WRITE per chunk, scatter at the rank) or the
  descriptor path, the decode ranks (a NixlBackend each) in a second process;
- ``layouts_ipc``: the IPC backend (one kernel per submission), the same shape, GPU only;
- ``layouts_nixl_per_piece`` (baseline, ``layouts_raw``): raw NIXL with one descriptor per layer,
  K/V, prefill block and decode rank, as engines do for mismatched TP (in the layouts that practice
  needs: HND with 16-token blocks at both ends; ``layouts_raw`` says why).

A backend figure runs from the first publish() here to the later of the two decode outcomes
becoming visible in the child (its stamps; both processes read CLOCK_MONOTONIC), and is kept
only when both ranks' outcomes, and both publishers', are Delivered for every block. After
the timed runs the prefill KV gets fresh random bytes, moves once more, and sampled tokens
of every layer, K and V, at each rank are compared with the prefill's bytes of that rank's
heads.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvxfer.bench.backend_cases import nixl_facts, wait_settled
from kvxfer.bench.cases import CaseSpec, Measurement, Requirement, Role, Skip, device_scope
from kvxfer.bench.children import start_child
from kvxfer.bench.config import BenchConfig, LatencySweep, OverheadSweep, Point
from kvxfer.bench.local import LocalCopy
from kvxfer.bench.timing import check_fresh_bytes, time_runs
from kvxfer.contract import Backend, TransferMode

SRC_BLOCK_TOKENS = 16
DST_BLOCK_TOKENS = 32
HEAD_DIM = 128
ELEMENT_BYTES = 2  # float16
RANKS = 2
SAMPLED_TOKENS = 64  # per rank, in the byte check: every layer, K and V, the rank's heads
_RESULT_TIMEOUT_S = 120.0
SEED_OFFSET = 11  # every case of a run draws the same block tables


@dataclass(frozen=True)
class Workload:
    """One point of the workload: sizes, block pools, and the two ends' specs."""

    layers: int
    kv_heads: int
    src_blocks: int   # the request's prefill blocks
    src_pool: int     # prefill block ids lie in [0, src_pool)
    dst_blocks: int   # the request's blocks at each decode rank
    dst_pool: int
    scattered: bool

    @staticmethod
    def of(point: Point, pool_factor: int) -> Workload:
        unit_block = 2 * SRC_BLOCK_TOKENS * HEAD_DIM * ELEMENT_BYTES  # K and V of one head, one 16-token block
        heads, rest = divmod(point.row_bytes, unit_block)
        if rest or heads % RANKS:
            raise Skip(f"a {point.row_bytes}-byte row is not one prefill block of one layer (2 x 16 tokens x H heads "
                       f"x {HEAD_DIM * ELEMENT_BYTES} B with H a multiple of {RANKS}): use 64 KiB rows (8 heads)")
        tokens = point.rows * SRC_BLOCK_TOKENS
        dst_blocks = -(-tokens // DST_BLOCK_TOKENS)
        factor = pool_factor if point.slots == "scattered" else 1
        return Workload(point.groups, heads, point.rows, point.rows * factor, dst_blocks, dst_blocks * factor,
                        point.slots == "scattered")

    @property
    def tokens(self) -> int:
        return self.src_blocks * SRC_BLOCK_TOKENS

    @property
    def rank_heads(self) -> list[tuple[int, int]]:
        share = self.kv_heads // RANKS
        return [(r * share, (r + 1) * share) for r in range(RANKS)]

    def source_spec(self, order: str = "nhd") -> Any:
        from kvxfer.testing.kv_ranks import KVSpec

        return KVSpec("layers", self.layers, self.kv_heads, (0, self.kv_heads), HEAD_DIM, self.src_pool,
                      SRC_BLOCK_TOKENS, order=order, name="prefill")

    def rank_specs(self) -> tuple[Any, ...]:
        from kvxfer.testing.kv_ranks import KVSpec

        return tuple(KVSpec("pool", self.layers, self.kv_heads, heads, HEAD_DIM, self.dst_pool, DST_BLOCK_TOKENS,
                            name=f"rank{r}") for r, heads in enumerate(self.rank_heads))

    def tables(self, seed: int, dst_blocks: int | None = None, dst_pool: int | None = None,
               ) -> tuple[np.ndarray, list[np.ndarray]]:
        """(the prefill's block table, each decode rank's): block ids in logical order. The
        decode ranks' blocks and pool may be given (another block size than DST_BLOCK_TOKENS)."""
        rng = np.random.default_rng(seed)

        def table(used: int, pool: int) -> np.ndarray:
            ids = rng.permutation(pool)[:used] if self.scattered else np.arange(used)
            return ids.astype(np.int64)

        used = self.dst_blocks if dst_blocks is None else dst_blocks
        pool = self.dst_pool if dst_pool is None else dst_pool
        return table(self.src_blocks, self.src_pool), [table(used, pool) for _ in range(RANKS)]

    def sampled_tokens(self, seed: int) -> np.ndarray:
        """Up to SAMPLED_TOKENS tokens, the first and the last among them."""
        if self.tokens <= SAMPLED_TOKENS:
            return np.arange(self.tokens, dtype=np.int64)
        inner = np.random.default_rng(seed).choice(np.arange(1, self.tokens - 1), SAMPLED_TOKENS - 2, replace=False)
        return np.sort(np.concatenate([[0, self.tokens - 1], inner])).astype(np.int64)

    def facts(self) -> dict[str, Any]:
        return {
            "tokens": self.tokens, "layers": self.layers, "kv_heads": self.kv_heads, "head_dim": HEAD_DIM,
            "dtype": "float16", "decode_ranks": RANKS, "rank_heads": [list(h) for h in self.rank_heads],
            "transfers_per_request": RANKS,
            "prefill_blocks": self.src_blocks, "prefill_pool_blocks": self.src_pool,
            "decode_blocks_per_rank": self.dst_blocks, "decode_pool_blocks_per_rank": self.dst_pool,
            "block_ids": "random permutations at every end" if self.scattered else "0..n-1 at every end",
        }


def request_name(rank: int) -> str:
    """Each (prefill, decode rank) pair's transfer has its own request name, as the worker's
    TP pairs do (``rid/kv{q}-{s}``): a backend keys describe() by request and tokens."""
    return f"layouts/kv{rank}-0"


def _ipc_geometry_missing() -> str | None:
    from kvxfer.backends.ipc import IpcBackend

    if getattr(IpcBackend, "GEOMETRY", False) is not True:
        return "IpcBackend.GEOMETRY is not True yet: the IPC backend does not move engine geometries"
    return None


@dataclass(frozen=True)
class Mover:
    """A kvxfer backend kind for the transform cases: its prefill end here, its ranks' options."""

    backend: str                                   # "nixl" | "ipc"
    memory: tuple[str, ...]
    options: tuple[tuple[str, Any], ...]
    facts: dict[str, Any]
    missing: Callable[[], str | None] = lambda: None  # checked at run time

    def local(self, device: int) -> Backend:
        if self.backend == "ipc":
            from kvxfer.backends.ipc import IpcBackend

            return IpcBackend("prefill", TransferMode.PUSH, device=device, **dict(self.options))
        from kvxfer.backends.nixl import NixlBackend

        return NixlBackend(mode=TransferMode.PUSH, **dict(self.options))


def nixl_mover(packed: str) -> Mover:
    from kvxfer.backends.nixl.plan import ChunkBytes

    return Mover("nixl", ("host", "device"), (("packed", packed),),
                 {"transport": "NIXL over UCX", "packed": packed, **nixl_facts(ChunkBytes())})


def ipc_mover() -> Mover:
    return Mover("ipc", ("device",), (), {"transport": "CUDA IPC mapping + native transform kernel"},
                 _ipc_geometry_missing)


class _Ends:
    """One point's two ends: the prefill KV and backend here, the decode ranks in a child."""

    def __init__(self, config: BenchConfig, mover: Mover, point: Point, wl: Workload) -> None:
        from kvxfer.lender.external import ExternalLender
        from kvxfer.testing.kv_ranks import DecodeRanks, RanksSpec, build_kv, torch_device

        here, there = config.devices if point.memory == "device" else (0, 0)
        self.s_table, self.d_tables = wl.tables(config.seed + SEED_OFFSET)
        self.src = build_kv(wl.source_spec(), torch_device(point.memory, here))
        spec = RanksSpec(mover.backend, wl.rank_specs(), point.memory, there, mover.options)
        self.ranks = start_child(lambda: DecodeRanks(spec))  # spared the terminal's Ctrl-C
        self.local: Backend | None = None
        try:
            with device_scope(point.memory, here):
                self.local = mover.local(here)
                if self.local.register(self.src.regions):
                    raise Skip(f"{type(self.local).__name__} cannot reach {point.memory} memory in this process")
            lender = ExternalLender(self.src)
            self.reads = [lender.lend_read(request_name(r), self.s_table, (0, wl.tokens), heads=heads).view()
                          for r, heads in enumerate(wl.rank_heads)]
            self.writes = [ExternalLender(kv).lend_write(request_name(r), self.d_tables[r], (0, wl.tokens)).view()
                           for r, kv in enumerate(self.ranks.kv)]
        except BaseException:
            self.close()
            raise
        self.paths: set[str] = set()

    def move(self) -> float:
        """Both ranks' transfers: seconds from the first publish() to the later decode outcome."""
        local = self.local
        assert local is not None
        hints = [self.ranks.describe(r, w) for r, w in enumerate(self.writes)]
        handles = [self.ranks.start(r, w, local.describe(v)) for r, (v, w) in enumerate(zip(self.reads, self.writes))]
        t0 = time.monotonic_ns()
        attempts = [local.publish(v, h) for v, h in zip(self.reads, hints)]
        seen = []
        for r, handle in enumerate(handles):
            outcome, quiet, visible = self.ranks.result(handle, _RESULT_TIMEOUT_S)
            if outcome is None or not outcome.all_delivered or not quiet or visible is None:
                raise RuntimeError(f"decode rank {r}: outcome {outcome!r} (quiesced {quiet}) is not Delivered for "
                                   "every block")
            seen.append(visible)
        for r, attempt in enumerate(attempts):
            mine = wait_settled(attempt, f"prefill attempt to rank {r}")
            if not mine.all_delivered:
                raise RuntimeError(f"prefill attempt to rank {r}: {mine!r} is not Delivered for every block")
            path_of = getattr(local, "path_of", None)
            if callable(path_of):
                self.paths.add(str(path_of(attempt)))
        self.ranks.forget()
        return (max(seen) - t0) / 1e9

    def stamp(self, wl: Workload) -> Callable[[int], Callable[[], bool]]:
        from kvxfer.testing.kv_ranks import fill_random, gather_tokens

        def fresh(seed: int) -> Callable[[], bool]:
            fill_random(self.src.tensors, seed)
            tokens = wl.sampled_tokens(seed)
            want = [gather_tokens(self.src.geometry, self.src.tensors, self.s_table, tokens, heads)
                    for heads in wl.rank_heads]
            return lambda: all(np.array_equal(self.ranks.sample(r, self.d_tables[r], tokens), want[r])
                               for r in range(RANKS))
        return fresh

    def stats(self) -> dict[str, Any]:
        from kvxfer.testing.kv_ranks import backend_stats

        return {"prefill_stats": backend_stats(self.local) if self.local is not None else None,
                "decode_stats": [self.ranks.stats(r) for r in range(RANKS)]}

    def close(self) -> int:
        """Shut both ends down; how many attempts were left unquiesced."""
        left = len(self.local.shutdown()) if self.local is not None else 0
        self.local = None
        return left + (self.ranks.close() or 0)


class TransformCase:
    """A kvxfer backend moving the workload between the two engine geometries."""

    def __init__(self, config: BenchConfig, mover: Mover) -> None:
        self.config = config
        self.mover = mover

    def throughput(self, point: Point) -> Measurement:
        if point.memory not in self.mover.memory:
            raise Skip(f"this backend moves {' or '.join(self.mover.memory)} memory")
        if point.direction != "push":
            raise Skip("the engine-layouts cases push (prefill publishes, each decode rank fetches)")
        why = self.mover.missing()
        if why:
            raise Skip(why)
        wl = Workload.of(point, self.config.pool_factor)
        ends = _Ends(self.config, self.mover, point, wl)
        left = 0
        try:
            fill = ends.stamp(wl)
            fill(self.config.seed)  # random KV before the timed runs (checked after them, with fresh bytes)
            timing = time_runs(ends.move, self.config.repetition)
            check_fresh_bytes(fill, ends.move, "decode ranks' KV (sampled tokens)")
            facts = ends.stats()
        finally:
            left = ends.close()
        if left:
            raise RuntimeError(f"{left} attempts were not quiesced at shutdown")
        facts.update({
            **self.mover.facts, **wl.facts(), "processes": 2, "verified": True, "verified_tokens_per_rank":
            int(wl.sampled_tokens(0).size), "path": "/".join(sorted(ends.paths)) or "-",
            "prefill": f"a tensor per layer [2, {wl.src_pool}, {SRC_BLOCK_TOKENS}, {wl.kv_heads}, {HEAD_DIM}] (NHD)",
            "decode": f"per rank, block-major [{wl.dst_pool}, {wl.layers}, 2, {DST_BLOCK_TOKENS}, "
                      f"{wl.kv_heads // RANKS}, {HEAD_DIM}] (PagedKVPool, NHD); both ranks in one child process, "
                      "a backend each",
            "measured": "first publish() to the later decode outcome visible (child's stamps, CLOCK_MONOTONIC); "
                        "both ranks' transfers submitted together",
        })
        if point.memory == "device":
            facts["devices"] = list(self.config.devices)
        return Measurement({"seconds_best": timing.best, "seconds_median": timing.median,
                            "reps": len(timing.samples)}, facts)

    def latency(self, point: Point, sweep: LatencySweep) -> Measurement:
        raise Skip("the engine-layouts cases measure throughput")

    def overhead(self, point: Point, sweep: OverheadSweep) -> Measurement:
        raise Skip("the engine-layouts cases measure throughput")

    def close(self) -> None:
        pass


def _raw(config: BenchConfig) -> Any:
    from kvxfer.bench.layouts_raw import PerPiece

    return PerPiece(config)


_ALL = ("memory", "direction", "slots", "row_bytes", "rows", "groups")
_TP = frozenset({"throughput"})
_NIXL = frozenset({Requirement.NIXL, Requirement.KVXFER_NIXL})
SPECS = [
    CaseSpec("layouts_copy", "the device copy of the request's bytes (D2D on a GPU, memcpy on the host): the "
             "ceiling of a transform", Role.REFERENCE, frozenset(), ("memory",), _TP, LocalCopy),
    CaseSpec("layouts_ipc", "kvxfer IPC backend, TP1 layer-major NHD -> TP2 block-major, ranks in a second process",
             Role.BACKEND, frozenset({Requirement.CUDA, Requirement.KVXFER_IPC}), _ALL, _TP,
             lambda config: TransformCase(config, ipc_mover())),
    CaseSpec("layouts_nixl_packed", "kvxfer NIXL backend, packed path, TP1 layer-major NHD -> TP2 block-major, "
             "ranks in a second process", Role.BACKEND, _NIXL | {Requirement.KVXFER_PACKED}, _ALL, _TP,
             lambda config: TransformCase(config, nixl_mover("always"))),
    CaseSpec("layouts_nixl_per_piece", "raw NIXL, one descriptor per layer, K/V, block and decode rank (peers' "
             "practice for mismatched TP; HND 16-token blocks at both ends)", Role.BASELINE,
             frozenset({Requirement.NIXL}), _ALL, _TP, _raw),
    CaseSpec("layouts_nixl_unpacked", "kvxfer NIXL backend, descriptor path, TP1 layer-major NHD -> TP2 "
             "block-major, ranks in a second process", Role.BACKEND, _NIXL, _ALL, _TP,
             lambda config: TransformCase(config, nixl_mover("never"))),
]
