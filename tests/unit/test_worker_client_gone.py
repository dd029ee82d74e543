"""A client that leaves while the decode worker fetches its prompt's KV: the fetch is cancelled
at once (not at its deadline, nor when the publisher next moves), counted as cancelled and not
as a failure, nothing is recomputed or decoded for nobody, the rows stay out of use until the
publisher can write them no more, and then both workers hold nothing and serve the next
request token-identical. Real workers in this process (the reference engine's toy model, the
loopback backend), the prefill worker's progress thread held so that the transfer cannot move."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import torch
from prometheus_client.parser import text_string_to_metric_families

from kvxfer.engine import LlamaModel, ModelConfig, colocated_generate
from kvxfer.router import Router
from kvxfer.serving.http import request_text
from kvxfer.testing.progress_hold import hold_progress
from kvxfer.testing.served import served_workers
from kvxfer.worker.core import WorkerConfig

torch.set_num_threads(1)
CFG = ModelConfig(vocab_size=128, hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, intermediate=96,
                  block_tokens=4)
MODEL = LlamaModel(CFG)
PROMPT = list(range(3, 15))  # 12 tokens: three blocks
NEW = 6


def pair() -> Any:
    """A prefill and a decode worker behind HTTP servers; transfer deadlines far beyond the test,
    so that only the client's leaving can cancel the fetch."""
    return served_workers({role: (WorkerConfig(role=role, model=CFG, num_blocks=64, backend="loopback", name=role,
                                               transfer_timeout_s=60.0), MODEL) for role in ("prefill", "decode")})


async def figures(url: str) -> dict[str, float]:
    """A worker's /metrics, one value per series (labels folded into the name)."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(await request_text(url, "/metrics")):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def held_now(f: dict[str, float]) -> dict[str, float]:
    """What a worker holds for requests: all 0 once it is idle."""
    return {k: v for k, v in f.items() if v and k in HELD}


HELD = ("kvxfer_worker_active_streams", "kvxfer_open_leases", "kvxfer_quarantined_slots",
        "kvxfer_worker_held_requests{table=prefill}", "kvxfer_worker_held_requests{table=reservation}",
        "kvxfer_worker_held_requests{table=starting}", "kvxfer_pool_blocks{group=full,state=in_use}")


async def until(what: str, url: str, check: Callable[[dict[str, float]], bool], timeout: float = 10.0
                ) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while not check(f := await figures(url)):
        assert time.monotonic() < deadline, f"not within {timeout:g}s: {what}: {f}"
        await asyncio.sleep(0.02)
    return f


def test_a_client_that_leaves_mid_fetch_cancels_it_at_once_and_nothing_is_left() -> None:
    async def main() -> None:
        async with pair() as (urls, workers), Router([urls["prefill"]], [urls["decode"]], timeout_s=60,
                                                     on_failure="recompute") as router:
            held, gate = hold_progress(workers["prefill"].backend)
            try:
                assert held.wait(10)
                task = asyncio.create_task(router.generate(PROMPT, NEW))
                # Both ends run the request's stream: the publish is submitted (and cannot move),
                # the decode worker waits on its fetch.
                for url in urls.values():
                    await until("the transfer in flight", url, lambda f: f["kvxfer_worker_active_streams"] == 1)
                assert not task.done()
                task.cancel()  # its connections close: the client has gone
                # The decode worker's stream ends while the publisher is still held: the fetch
                # was cancelled, not waited for.
                d = await until("the fetch cancelled and its stream ended", urls["decode"], lambda f: (
                    f.get("kvxfer_transfers_total{status=cancelled}") == 1
                    and f["kvxfer_worker_active_streams"] == 0))
                assert not gate.is_set()
                assert d.get("kvxfer_transfers_total{status=delivered}", 0) == 0
                assert not any(k.startswith("kvxfer_transfer_failures_total") and v for k, v in d.items()), d
                assert d["vllm:nixl_num_failed_transfers_total"] == 0
                assert d["kvxfer_recomputed_tokens_total"] == 0 and d["kvxfer_generated_tokens_total"] == 0, d
                # The publisher may still write the reserved rows: they are set aside, not reused.
                assert d["kvxfer_open_leases"] == 0 and d["kvxfer_quarantined_slots"] == 3, d
                assert d["kvxfer_pool_blocks{group=full,state=in_use}"] == 3, d
                gate.set()
                # (The router waits for the publisher's outcome before its task ends.)
                await asyncio.wait_for(asyncio.gather(task, return_exceptions=True), 10)
                for url in urls.values():
                    await until("the worker idle", url, lambda f: not held_now(f))
                done = await router.generate(PROMPT, NEW)
                assert done.ok and done.path == "disaggregated" and done.recomputed_tokens == 0, done
                assert list(done.tokens) == colocated_generate(MODEL, PROMPT, NEW)
                for url in urls.values():
                    await until("the worker idle", url, lambda f: not held_now(f))
                d = await figures(urls["decode"])
                assert d["kvxfer_transfers_total{status=cancelled}"] == 1, d
                assert d["kvxfer_transfers_total{status=delivered}"] == 1, d
            finally:
                gate.set()

    asyncio.run(main())
