"""A client that leaves before its answer ends its request within a decode step, streamed or
not: the decode worker stops generating, the request's blocks come back, and the router counts
the request as cancelled (real SmolLM2 workers in this process, as in test_router_openai)."""

from __future__ import annotations

import asyncio
import re

import aiohttp
import pytest
from test_router_openai import PROMPT, model, stack  # noqa: F401 - the module fixture, shared

from kvxfer.engine import SMOLLM2, LlamaModel
from kvxfer.serving.http import request_text

MAX_TOKENS = 400  # about 40 s of SmolLM2 decoding on 2 cores: a request left running is obvious


def _value(metrics: str, series: str) -> float:
    found = re.search(rf"^{re.escape(series)} (\S+)$", metrics, re.M)
    return float(found.group(1)) if found else 0.0


async def _until(url: str, series: str, value: float, timeout_s: float = 60.0) -> str:
    """The /metrics text once ``series`` reads ``value``; the last text when it never does."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        metrics = await request_text(url, "/metrics")
        if _value(metrics, series) == value or asyncio.get_running_loop().time() > deadline:
            return metrics
        await asyncio.sleep(0.02)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_client_that_leaves_ends_its_request(model: LlamaModel, stream: bool) -> None:  # noqa: F811
    async def main() -> None:
        async with stack(model) as s:
            decode = s.decode[0]
            before = await request_text(decode, "/metrics")
            free = _value(before, 'kvxfer_pool_blocks{group="full",state="free"}')

            async def client() -> None:
                async with aiohttp.ClientSession() as http:
                    async with http.post(f"{s.url}/v1/completions", json={
                            "model": SMOLLM2, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "stream": stream}) as r:
                        await r.read()

            task = asyncio.create_task(client())
            # The decode worker is generating for it: then the client goes (its connection closes).
            generating = await _until(decode, "kvxfer_worker_active_streams", 1.0)
            assert _value(generating, "kvxfer_worker_active_streams") == 1.0, generating
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            series = 'kvxfer_router_requests_total{path="disaggregated",result="cancelled"}'
            router = await _until(s.url, series, 1.0)
            assert _value(router, series) == 1.0, router
            after = await _until(decode, "kvxfer_worker_active_streams", 0.0)
            produced = _value(after, "kvxfer_generated_tokens_total")
            assert _value(after, "kvxfer_worker_active_streams") == 0.0 and produced < MAX_TOKENS / 4, produced
            after = await _until(decode, 'kvxfer_pool_blocks{group="full",state="free"}', free)
            assert _value(after, 'kvxfer_pool_blocks{group="full",state="free"}') == free, after
            assert _value(after, "kvxfer_open_leases") == 0.0

    asyncio.run(main())
