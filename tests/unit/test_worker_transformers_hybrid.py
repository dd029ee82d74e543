"""Workers serving a hybrid model with transformers' continuous batching: sliding-window
layers beside full-attention ones, so transformers' cache has two layer groups, each with its
own allocator, block table and geometry. The prefill worker lends each group's blocks in
place (the full-attention group the prompt's blocks, the sliding group only its ring), the
decode worker receives each into its own cache's blocks by a transfer of its own (one lease,
view and hint per group, one combined attempt: ``kvxfer.worker.layers``), adopts the request
and decodes it in its batch beside the others. Concurrent prompts shorter than, as long as and
longer than the window (the ring wrapped) are token-identical to transformers' own
``generate_batch``. Real workers behind real HTTP servers in this process, the loopback
backend, a tiny seeded Gemma-2-like model (``hf_engine.seeded_model(sliding_window=)``)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch

from kvxfer.adapters.transformers import _internals as hf
from kvxfer.contract import TransferMode
from kvxfer.engine import ModelConfig
from kvxfer.router import Router
from kvxfer.serving.http import request_json
from kvxfer.testing.served import served_workers
from kvxfer.worker.core import WorkerConfig
from kvxfer.worker.hf_engine import MAX_BATCH_TOKENS, PAGE_SIZE, seeded_model

torch.set_num_threads(1)
SHAPE = ModelConfig(vocab_size=128, hidden=64, layers=3, heads=4, kv_heads=2, head_dim=16, intermediate=128,
                    max_positions=256, seed=4)
WINDOW = 20  # under two 16-token blocks: the ring's last block is partial
BLOCKS = 64
NEW = 6
# Shorter than the window, as long, longer (the ring wrapped: 33, 50, 70 tokens).
PROMPTS = [[(5 * i + 3 * j + 1) % 128 for i in range(n)] for j, n in enumerate([7, 20, 33, 50, 12, 70])]


@pytest.fixture(scope="module")
def model() -> Any:
    return seeded_model(SHAPE, "cpu", sliding_window=WINDOW)


@pytest.fixture(scope="module")
def oracle(model: Any) -> list[list[int]]:
    return hf.colocated(model, PROMPTS, NEW, hf.batching_config(PAGE_SIZE, BLOCKS, MAX_BATCH_TOKENS))


def served(model: Any, mode: TransferMode = TransferMode.PUSH) -> Any:
    return served_workers({role: (WorkerConfig(role=role, model=SHAPE, num_blocks=BLOCKS, backend="loopback",
                                               mode=mode, name=role, transfer_timeout_s=10.0,
                                               engine="transformers"), model)
                           for role in ("prefill", "decode")})


async def drained(worker: Any) -> bool:
    """Whether every block of both groups goes back to transformers once the streams' clean-up
    (the prefill worker's unpin after its publish quiesced) is done: polled on that state."""
    engine = worker._hf.engine
    for _ in range(500):
        await worker.metrics_text()  # a reclaim pass on the engine thread
        if await worker._engine.run(engine.batch.free_fraction) == 1.0 and worker.lender.open_leases == 0:
            return True
        await asyncio.sleep(0.01)
    return False


def rows_moved(prompt: list[int]) -> int:
    """The blocks a request moves: every full-attention block of its prompt, the ring's only."""
    return -(-len(prompt) // PAGE_SIZE) + -(-min(len(prompt), WINDOW) // PAGE_SIZE)


@pytest.mark.parametrize("mode", [TransferMode.PUSH, TransferMode.PULL], ids=["push", "pull"])
def test_hybrid_requests_are_token_identical_to_generate_batch(model: Any, oracle: list[list[int]],
                                                               mode: TransferMode) -> None:
    assert [g for g in hf.Batch(model, hf.batching_config(PAGE_SIZE, 8, 64), max_new_tokens=1).layouts()] \
        == [hf.FULL, hf.SLIDING]  # the model is hybrid: two layer groups

    async def main() -> None:
        async with served(model, mode) as (urls, workers):
            async with Router([urls["prefill"]], [urls["decode"]]) as router:
                done = await asyncio.gather(*(router.generate(p, NEW) for p in PROMPTS))
            metrics = await workers["decode"].metrics_text()
            for worker in workers.values():  # every lease and block of both groups went back
                assert await drained(worker)
            health = await request_json(urls["decode"], "GET", "/health")
        for completion, want, prompt in zip(done, oracle, PROMPTS):
            assert completion.ok, completion.error
            assert list(completion.tokens) == want
            assert completion.path == "disaggregated" and completion.recomputed_tokens == 0
            transfer = completion.transfer
            assert transfer is not None and transfer.status == "delivered"
            assert transfer.rows == transfer.rows_delivered == rows_moved(prompt)  # only the ring's blocks
        assert f'kvxfer_pool_blocks{{group="{hf.SLIDING}",state="reusable"}}' in metrics
        assert health["engine"] == hf.ENGINE

    asyncio.run(main())


def test_transfer_bytes_count_each_group_by_its_own_block_size(model: Any) -> None:
    """A sliding block holds two layers (layers 0 and 2), a full-attention one one (layer 1):
    the bytes reported are each group's blocks at its own geometry's size."""
    prompt = PROMPTS[3]  # 50 tokens: 4 full-attention blocks, a 2-block ring

    async def main() -> None:
        async with served(model) as (urls, workers):
            async with Router([urls["prefill"]], [urls["decode"]]) as router:
                done = await router.generate(prompt, NEW)
            engine = workers["decode"]._hf.engine
            full, ring = (engine.groups[g].kv.geometry.block_bytes for g in (hf.FULL, hf.SLIDING))
        assert ring == 2 * full
        assert done.ok and done.transfer is not None
        assert done.transfer.bytes == 4 * full + 2 * ring

    asyncio.run(main())


def test_a_partial_transfer_resumes_where_every_group_is_whole(model: Any, oracle: list[list[int]]) -> None:
    """One block of each group's transfer arrives. A 20-token prompt (the ring never wrapped:
    ring slot = position) resumes at the first gap, token 16; a 50-token one, whose wrapped ring
    holds later positions than the full-attention group's gap, is prefilled again from 0. Both
    then decode as generate_batch does; so does a request the decode worker runs alone."""
    async def main() -> None:
        async with served(model) as (urls, workers):
            workers["prefill"].backend.fail_after_rows = 1  # type: ignore[union-attr]  # push: the publisher writes
            async with Router([urls["prefill"]], [urls["decode"]], on_failure="recompute") as router:
                done = await asyncio.gather(*(router.generate(PROMPTS[i], NEW) for i in (1, 3)))
            async with Router([], [urls["decode"]], on_failure="recompute") as router:
                alone = await router.generate(PROMPTS[5], NEW)
            for worker in workers.values():  # the failed transfers' blocks too, at both ends
                assert await drained(worker)
        for completion, i, recomputed in zip(done, (1, 3), (len(PROMPTS[1]) - PAGE_SIZE, len(PROMPTS[3]))):
            assert completion.ok, completion.error
            assert completion.transfer is not None and completion.transfer.status == "failed"
            assert completion.recomputed_tokens == recomputed, completion
            assert list(completion.tokens) == oracle[i]
        assert alone.ok and alone.path == "local" and list(alone.tokens) == oracle[5]

    asyncio.run(main())


def test_a_hybrid_worker_beside_a_one_group_worker_is_refused_naming_the_groups(model: Any) -> None:
    """The same shape without sliding layers has one layer group: the prefill worker refuses
    the decode worker's hint by name, and a request under policy fail says so."""
    plain = seeded_model(SHAPE, "cpu")
    configs = {role: (WorkerConfig(role=role, model=SHAPE, num_blocks=BLOCKS, backend="loopback", name=role,
                                   transfer_timeout_s=10.0, engine="transformers"), m)
               for role, m in (("prefill", model), ("decode", plain))}

    async def main() -> None:
        async with served_workers(configs) as (urls, _):
            async with Router([urls["prefill"]], [urls["decode"]], on_failure="fail") as router:
                done = await router.generate(PROMPTS[0], NEW)
        assert not done.ok and done.error is not None
        assert "layer groups ['kv'] are not this end's ['full_attention', 'sliding_attention']" in done.error, done.error

    asyncio.run(main())
