"""Prefill and decode workers of different TP, block size and layout, behind the router:
every completion token-identical to colocated generation, every prompt's KV moved (nothing
recomputed), and each decode rank holding exactly its heads' slice of the prefill KV.

Real Worker objects behind real HTTP servers in this process, moving KV with the loopback
backend (its geometry path is the host reference of the nixl and ipc ones)."""

from __future__ import annotations

import asyncio
from contextlib import AbstractAsyncContextManager
from typing import Any

import pytest
import torch

from kvxfer.engine import GROUP, LlamaModel, ModelConfig, ShardedKVCache, colocated_generate, synthetic_prompts
from kvxfer.router import Completion, Router
from kvxfer.testing.served import served_pair
from kvxfer.worker.core import Worker, WorkerConfig

torch.set_num_threads(1)
CFG = ModelConfig(vocab_size=128, hidden=64, layers=2, heads=8, kv_heads=4, head_dim=8, intermediate=96,
                  block_tokens=4)
MODEL = LlamaModel(CFG)


def pair(prefill: dict[str, Any], decode: dict[str, Any]) -> AbstractAsyncContextManager[tuple[str, str, dict[str, Worker]]]:
    return served_pair(prefill, decode, weights=MODEL, model=CFG, num_blocks=128, backend="loopback",
                       transfer_timeout_s=5.0, prefix_cache=False, engine_kv=True)


CASES = {  # (prefill settings, decode settings)
    "tp1-to-tp2": ({"tp": 1}, {"tp": 2, "peer_tp": 1}),
    "tp2-to-tp1": ({"tp": 2}, {"tp": 1, "peer_tp": 2}),
    "tp1-to-tp4": ({"tp": 1}, {"tp": 4, "peer_tp": 1}),
    "tp4-to-tp2": ({"tp": 4}, {"tp": 2, "peer_tp": 4}),
    "tp2-to-tp8-replicated": ({"tp": 2}, {"tp": 8, "peer_tp": 2}),
    "blocks-4-to-8": ({"block_tokens": 4}, {"block_tokens": 8}),
    "blocks-16-to-4": ({"block_tokens": 16}, {"block_tokens": 4}),
    "layer-major-to-block-major": ({"layout": "layer_major", "tp": 1}, {"tp": 2, "peer_tp": 1, "block_tokens": 8}),
    "block-major-to-layer-major": ({"tp": 2, "block_tokens": 8}, {"layout": "layer_major", "peer_tp": 2}),
}


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_mismatched_tp_groups_are_token_identical(case: str) -> None:
    prefill, decode = CASES[case]
    prompts = synthetic_prompts(4, 3, 37, CFG.vocab_size, seed=5)

    async def main() -> None:
        async with pair(prefill, decode) as (p_url, d_url, workers):
            router = Router([p_url], [d_url])
            for prompt in prompts:
                done = await router.generate(prompt, 5)
                assert isinstance(done, Completion)
                assert done.ok, done.error
                assert list(done.tokens) == colocated_generate(MODEL, prompt, 5)
                assert done.path == "disaggregated" and done.recomputed_tokens == 0, done
                assert done.transfer is not None and done.transfer.status == "delivered"
                assert done.transfer.rows == done.transfer.rows_delivered

    asyncio.run(main())


def test_each_decode_rank_receives_exactly_its_heads() -> None:
    """One request moved TP 1 (16-token layer-major) -> TP 2 (8-token block-major): each
    decode rank's KV equals the prefill KV's slice of its heads, token by token."""
    prompt = synthetic_prompts(1, 30, 31, CFG.vocab_size, seed=9)[0]

    async def main() -> None:
        async with pair({"layout": "layer_major", "block_tokens": 16},
                        {"tp": 2, "peer_tp": 1, "block_tokens": 8}) as (p_url, d_url, workers):
            router = Router([p_url], [d_url])
            decode_cache = workers["decode"].pool
            assert isinstance(decode_cache, ShardedKVCache)
            seen: list[list[torch.Tensor]] = []
            original = workers["decode"]._decode._usable

            def capture(name: str, n: int) -> int:  # on the engine thread, right after arrival
                seen.append([torch.cat([torch.stack(decode_cache.pool(r).read_kv(name, GROUP, layer, 0, n))
                                        for layer in range(CFG.layers)]) for r in range(2)])
                return original(name, n)

            workers["decode"]._decode._usable = capture  # type: ignore[method-assign]
            done = await router.generate(prompt, 2)
            assert done.ok and done.recomputed_tokens == 0
            # The prefill worker's KV is gone with its request; recompute it colocated.
            reference = ShardedKVCache.create(CFG, 1, 16, block_tokens=16)
            reference.allocate("ref", len(prompt))
            MODEL.forward(reference, "ref", prompt, 0)
            full = torch.cat([torch.stack(reference.pool(0).read_kv("ref", GROUP, layer, 0, len(prompt)))
                              for layer in range(CFG.layers)])
            assert seen, "the decode worker never read its KV"
            for rank, got in enumerate(seen[0]):
                heads = slice(2 * rank, 2 * rank + 2)
                assert torch.equal(got, full[..., heads, :]), f"rank {rank}"

    asyncio.run(main())


def test_a_tp_group_refuses_options_it_cannot_keep() -> None:
    with pytest.raises(ValueError, match="prefix"):
        WorkerConfig(role="decode", model=CFG, tp=2)
    with pytest.raises(ValueError, match="divide"):
        WorkerConfig(role="decode", model=CFG, tp=3, prefix_cache=False)
    with pytest.raises(ValueError, match="staging"):
        WorkerConfig(role="decode", model=CFG, tp=2, prefix_cache=False, lender="staging")
    with pytest.raises(ValueError, match="pool rows only"):
        WorkerConfig(role="decode", model=CFG, tp=2, prefix_cache=False, backend="ucx")
