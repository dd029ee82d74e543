"""Experiment 3: soak. 1 prefill + 1 decode worker process over NIXL, an in-process Router,
many short requests at concurrency 4, every completion checked against colocated output.

The prompts are a pool of distinct short prompts cycled over the run. A repeated prompt
hits the decode worker's prefix cache (its full blocks are already there), so most
requests after the first pass move only the prompt's last block: that is what a serving
stack with repeated system prompts sees, and it is what this soak measures.

Each worker process is sampled from /proc (RSS, threads, open fds) after a warm-up of
about 5% of the requests, every few seconds after that, and at the end.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from pathlib import Path

from kvxfer.engine import ModelConfig, synthetic_prompts
from kvxfer.router import Router
from kvxfer.testing.reliability.common import (
    ProcSample,
    Progress,
    WorkerLeftovers,
    ms,
    sample_process,
    start_workers,
    worker_leftovers,
)
from kvxfer.testing.reliability.oracle import expected_outputs
from kvxfer.worker.procs import Child, ProcessGroup

POOL = 64
SAMPLE_EVERY_S = 5.0


@dataclass(frozen=True)
class Growth:
    """One worker process: after the warm-up (start), at the end, the most seen, and end - start."""

    worker: str
    rss_kib_start: int
    rss_kib_end: int
    rss_kib_max: int
    rss_kib_growth: int
    threads_start: int
    threads_end: int
    threads_max: int
    threads_growth: int
    fds_start: int
    fds_end: int
    fds_max: int
    fds_growth: int


@dataclass(frozen=True)
class SoakSummary:
    requests: int
    ok: int
    failures: int
    wrong: int
    seconds: float
    requests_per_s: float
    tokens_per_s: float            # generated tokens (first token included) per second of the run
    latency_p50_ms: float | None   # router-side Completion.total_s
    latency_p99_ms: float | None
    ttft_p50_ms: float | None
    paths: dict[str, int]
    warmup_requests: int
    growth: tuple[Growth, ...]
    samples: dict[str, tuple[ProcSample, ...]]
    failure_samples: tuple[str, ...]
    workers_after: tuple[WorkerLeftovers, ...]


def _growth(name: str, samples: list[ProcSample]) -> Growth:
    first, last = samples[0], samples[-1]
    return Growth(name, first.rss_kib, last.rss_kib, max(s.rss_kib for s in samples), last.rss_kib - first.rss_kib,
                  first.threads, last.threads, max(s.threads for s in samples), last.threads - first.threads,
                  first.fds, last.fds, max(s.fds for s in samples), last.fds - first.fds)


@dataclass
class _Tally:
    """What the lanes count while the soak runs (mutable: the frozen summary is made from it)."""

    done: int = 0
    wrong: int = 0
    tokens: int = 0
    seconds: float = 0.0
    totals: list[float] = field(default_factory=list)
    ttfts: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    paths: dict[str, int] = field(default_factory=dict)
    samples: dict[str, list[ProcSample]] = field(default_factory=dict)


async def _workload(children: list[Child], prompts: list[list[int]], max_new: list[int], expected: list[list[int]],
                    requests: int, warmup: int, concurrency: int, shown: Progress) -> _Tally:
    prefill, decode = children
    router = Router([prefill.url], [decode.url], on_failure="recompute", timeout_s=30.0)
    tally = _Tally(samples={c.name: [] for c in children})
    start = time.monotonic()
    next_sample = start

    def sample() -> None:
        nonlocal next_sample
        for c in children:
            s = sample_process(c.pid, start)
            if s is not None:
                tally.samples[c.name].append(s)
        next_sample = time.monotonic() + SAMPLE_EVERY_S

    pending = iter(range(requests))

    async def lane() -> None:
        for i in pending:
            k = i % len(prompts)
            try:
                done = await router.generate(prompts[k], max_new[k], request=f"soak-{i}")
            except Exception as exc:  # reported, never hidden
                done = None
                tally.errors.append(f"router raised {type(exc).__name__}: {exc}")
            tally.done += 1
            if done is not None:
                tally.totals.append(done.total_s)
                if done.ttft_s is not None:
                    tally.ttfts.append(done.ttft_s)
                if not done.ok:
                    tally.errors.append(str(done.error))
                else:
                    tally.paths[done.path] = tally.paths.get(done.path, 0) + 1
                    tally.tokens += len(done.tokens)
                    tally.wrong += list(done.tokens) != expected[k]
            # The first sample once the warm-up is over: start-up allocations are not growth.
            if tally.done == warmup or (tally.done > warmup and time.monotonic() >= next_sample):
                sample()
            shown.tick(tally.done, f"{len(tally.errors)} failed, {tally.wrong} wrong")

    try:
        await asyncio.gather(*(lane() for _ in range(concurrency)))
        sample()
    finally:
        await router.close()
    tally.seconds = time.monotonic() - start
    return tally


def run_soak(requests: int, *, concurrency: int = 4, seed: int = 5, log_dir: Path,
             progress: bool = True) -> SoakSummary:
    config = ModelConfig()
    prompts = synthetic_prompts(POOL, 8, 48, config.vocab_size, seed=seed)
    max_new = [2 + k % 3 for k in range(POOL)]  # 2 to 4 tokens
    shown = Progress("soak", requests, enabled=progress)
    expected = expected_outputs(config, prompts, max_new)
    warmup = max(1, requests // 20)
    with ProcessGroup(log_dir) as group:
        children = start_workers(group, [("prefill", "soak-prefill"), ("decode", "soak-decode")])
        shown.note("2 workers ready")
        tally = asyncio.run(_workload(children, prompts, max_new, expected, requests, warmup, concurrency, shown))
        after = tuple(asyncio.run(_after(children)))
    summary = SoakSummary(
        requests=tally.done, ok=tally.done - len(tally.errors), failures=len(tally.errors), wrong=tally.wrong,
        seconds=round(tally.seconds, 2), requests_per_s=round(tally.done / tally.seconds, 2),
        tokens_per_s=round(tally.tokens / tally.seconds, 1), latency_p50_ms=ms(tally.totals, 50),
        latency_p99_ms=ms(tally.totals, 99), ttft_p50_ms=ms(tally.ttfts, 50), paths=dict(tally.paths),
        warmup_requests=warmup, growth=tuple(_growth(name, s) for name, s in tally.samples.items() if s),
        samples={name: tuple(s) for name, s in tally.samples.items()},
        failure_samples=tuple(sorted({e[:300] for e in tally.errors}))[:10], workers_after=after)
    shown.finish(f"{summary.ok}/{summary.requests} ok, {summary.wrong} wrong, {summary.requests_per_s} req/s")
    return summary


async def _after(children: list[Child]) -> list[WorkerLeftovers]:
    return [await worker_leftovers(c) for c in children]
