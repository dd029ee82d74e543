"""Embed the kvxfer router in your own asyncio program.

Your serving stack runs prefill and decode workers (here: two ``kvxfer serve`` processes
started for the example, announcing their ports on stdout); your code owns the event loop
and calls ``Router.stream`` per request. Tokens arrive as they are produced: the first
from the prefill worker, the rest from the decode worker after the KV-cache transfer.
The example checks each completion against colocated generation and stops the workers.

    .venv/bin/python examples/router_embed.py
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
from pathlib import Path

import torch

from kvxfer.engine import LlamaModel, ModelConfig, colocated_generate, synthetic_prompts
from kvxfer.router import Completion, Router, Token
from kvxfer.worker.procs import ProcessGroup


async def serve_requests(prefill_url: str, decode_url: str, prompts: list[list[int]]) -> list[Completion]:
    async def one(router: Router, i: int, prompt: list[int]) -> Completion:
        async for item in router.stream(prompt, max_new_tokens=12, request=f"embed-{i}"):
            if isinstance(item, Token):
                if item.index == 0:
                    print(f"  request {i}: first token {item.token} after {item.at_s * 1e3:.1f} ms")
            else:
                return item
        raise AssertionError("the router always ends a stream with a Completion")

    # Leaving the block closes the router: the aborts it sends in the background (after a
    # failure) land, and its HTTP session closes.
    async with Router(prefill=[prefill_url], decode=[decode_url], selection="least_outstanding",
                      on_failure="recompute", timeout_s=30.0) as router:
        health = await router.health()
        print(f"router: {health.status} ({health.reason})")
        return list(await asyncio.gather(*(one(router, i, p) for i, p in enumerate(prompts))))


def main() -> int:
    torch.set_num_threads(1)
    model = LlamaModel(ModelConfig())  # the workers build the same seeded model
    prompts = synthetic_prompts(4, 5, 90, model.config.vocab_size, seed=7)
    with tempfile.TemporaryDirectory(prefix="kvxfer-embed-") as tmp, ProcessGroup(Path(tmp)) as group:
        prefill = group.start("prefill", ["serve", "--role", "prefill"])
        decode = group.start("decode", ["serve", "--role", "decode"])
        group.wait_ready([prefill, decode])
        print(f"workers up: prefill {prefill.url}, decode {decode.url}")
        completions = asyncio.run(serve_requests(prefill.url, decode.url, prompts))
    ok = 0
    for prompt, done in zip(prompts, completions):
        same = done.ok and list(done.tokens) == colocated_generate(model, prompt, 12)
        ok += same
        transfer = f"{done.transfer.rows_delivered} rows in {done.transfer.seconds * 1e3:.2f} ms" \
            if done.transfer else "no transfer"
        print(f"  {done.request}: {len(done.tokens)} tokens via {done.path}, {transfer}, "
              f"{'matches' if same else 'DIFFERS from'} colocated generation{'' if done.ok else ': ' + str(done.error)}")
    print(f"{ok}/{len(prompts)} completions token-identical")
    return 0 if ok == len(prompts) else 1


if __name__ == "__main__":
    sys.exit(main())
