"""A worker serving with transformers' continuous batching, when a call ends badly: its cache
as /metrics shows it (``kvxfer_pool_blocks``: transformers' own blocks, free, in its prefix
cache or in use), and a prefill whose caller left just as its first token came gives its
blocks back. A real Worker in this process, a tiny random Llama, the loopback backend."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from kvxfer.backends.loopback import LoopbackFabric
from kvxfer.engine import GREEDY, ModelConfig
from kvxfer.worker.core import Worker, WorkerConfig

torch.set_num_threads(1)
SHAPE = ModelConfig(vocab_size=128, hidden=64, layers=3, heads=4, kv_heads=2, head_dim=16, intermediate=128,
                    max_positions=256)
BLOCKS = 48
PROMPT = list(range(20, 58))  # three 16-token blocks


def blocks(text: str) -> dict[str, float]:
    return {s.labels["state"]: s.value for family in text_string_to_metric_families(text)
            for s in family.samples if s.name == "kvxfer_pool_blocks"}


async def prefill_worker(model: Any) -> Worker:
    config = WorkerConfig(role="prefill", model=SHAPE, num_blocks=BLOCKS, backend="loopback", name="prefill",
                          engine="transformers")
    worker = Worker(config, model=model, fabric=LoopbackFabric())
    await worker.start()
    return worker


def test_the_cache_blocks_are_on_metrics(tiny_hf_llama: Any) -> None:
    async def main() -> None:
        worker = await prefill_worker(tiny_hf_llama)
        try:
            assert blocks(await worker.metrics_text()) == {"blocks": BLOCKS, "free": BLOCKS, "cached": 0, "in_use": 0}
            await worker._state.serving.prefill("r", PROMPT, GREEDY, None)
            assert blocks(await worker.metrics_text()) == {"blocks": BLOCKS, "free": BLOCKS - 3, "cached": 0,
                                                           "in_use": 3}  # pinned for a publish
            await worker._engine.run(worker._state.serving.free, "r")
            # Back to transformers: its whole blocks in its prefix cache, reusable.
            assert blocks(await worker.metrics_text()) == {"blocks": BLOCKS, "free": BLOCKS - 2, "cached": 2,
                                                           "in_use": 0}
        finally:
            assert await worker.close() == {"unquiesced_attempts": 0, "retained_blocks": 0}

    asyncio.run(main())


def test_a_prefill_whose_caller_left_as_its_first_token_came_gives_its_blocks_back(tiny_hf_llama: Any) -> None:
    """The caller is cancelled after the batch handed out the first token and before the call
    resumed with it: nobody will publish the prompt's blocks, so they go back."""
    async def main() -> None:
        worker = await prefill_worker(tiny_hf_llama)
        serving = worker._state.serving
        try:
            call = asyncio.create_task(serving.prefill("r", PROMPT, GREEDY, None))
            while "r" not in serving._prefills:  # type: ignore[attr-defined]
                await asyncio.sleep(0)
            # The driver pops the request's future as it sets its first token, and the call
            # resumes at the loop's next pass at the earliest: this task, always ready, runs first.
            while "r" in serving._prefills:  # type: ignore[attr-defined]
                await asyncio.sleep(0)
            assert not call.done()
            call.cancel()
            with pytest.raises(asyncio.CancelledError):
                await call
            assert blocks(await worker.metrics_text())["in_use"] == 0
            assert not await worker._engine.run(serving.has, "r")
        finally:
            assert await worker.close() == {"unquiesced_attempts": 0, "retained_blocks": 0}

    asyncio.run(main())
