"""Logprobs through the router and real workers in this process (loopback, the toy model):
each token's logprob and its k likeliest alternatives are the log-softmax of the reference
model's raw logits at that step, computed here by running the model colocated, whether the
token came from the prefill worker, the decode worker, or a decode worker that recomputed
after the first was cut; a bad ``logprobs`` is refused by name."""

from __future__ import annotations

import asyncio

import pytest
import torch
from test_router import CFG, MODEL, _cutting, cluster  # noqa: I001 - pytest puts tests/unit on sys.path

from kvxfer.engine import SamplingParams, colocated_generate, tokens_needed
from kvxfer.engine.sampling import with_logprobs
from kvxfer.router import Completion, InvalidRequest, Router, Token
from kvxfer.serving.http import HttpError, HttpServer, request_json
from kvxfer.worker.app import make_handler

PROMPT = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]
PARAMS = SamplingParams(temperature=1.0, top_p=0.95, seed=7, presence_penalty=0.4, repetition_penalty=1.1)
TOLERANCE = 1e-5


def reference(prompt: list[int], tokens: list[int]) -> list[torch.Tensor]:
    """log_softmax of the model's logits before each of ``tokens``: the prompt's forward, then
    one forward per token fed back, in one pool (colocated)."""
    pool = CFG.make_pool(-(-tokens_needed(len(prompt), len(tokens)) // CFG.block_tokens))
    pool.allocate("ref", tokens_needed(len(prompt), len(tokens)))
    rows = [MODEL.forward(pool, "ref", prompt, 0)]
    rows += [MODEL.forward(pool, "ref", [t], len(prompt) + i) for i, t in enumerate(tokens[:-1])]
    return [torch.log_softmax(r.double(), dim=-1) for r in rows]


def check(prompt: list[int], tokens: list[Token], k: int) -> None:
    ref = reference(prompt, [t.token for t in tokens])
    for t, row in zip(tokens, ref, strict=True):
        assert t.logprob is not None and abs(t.logprob - float(row[t.token])) < TOLERANCE, (t, float(row[t.token]))
        values, ids = torch.topk(row, k)
        assert [i for i, _ in t.top_logprobs] == ids.tolist(), (t.index, t.top_logprobs, ids.tolist())
        assert all(abs(lp - float(v)) < TOLERANCE for (_, lp), v in zip(t.top_logprobs, values))


async def run(router: Router, prompt: list[int], n: int, sampling: SamplingParams, k: int | None
              ) -> tuple[list[Token], Completion]:
    tokens: list[Token] = []
    async for item in router.stream(prompt, n, sampling=sampling, logprobs=k):
        if isinstance(item, Completion):
            return tokens, item
        tokens.append(item)
    raise AssertionError("no completion")


@pytest.mark.parametrize("sampling", [SamplingParams(), PARAMS], ids=["greedy", "sampled"])
def test_each_tokens_logprobs_are_the_log_softmax_of_the_models_raw_logits(sampling: SamplingParams) -> None:
    async def main() -> None:
        async with cluster() as c, Router(c.prefill, c.decode) as router:
            tokens, done = await run(router, PROMPT, 8, sampling, 4)
            assert done.ok and done.path == "disaggregated", done.error
            assert [t.token for t in tokens] == colocated_generate(MODEL, PROMPT, 8, sampling=sampling)
            check(PROMPT, tokens, 4)  # token 0 from the prefill worker, 1..7 from the decode worker
            plain, _ = await run(router, PROMPT, 8, sampling, None)
            assert [t.token for t in plain] == [t.token for t in tokens]  # asking for logprobs changes no token
            assert {(t.logprob, t.top_logprobs) for t in plain} == {(None, ())}
            zero, _ = await run(router, PROMPT, 3, sampling, 0)
            assert all(t.logprob is not None and t.top_logprobs == () for t in zero)

    asyncio.run(main())


def test_logprobs_survive_a_recompute_after_a_cut_decode_worker() -> None:
    async def main() -> None:
        async with cluster(0, 2) as c:
            server = HttpServer(_cutting(make_handler(c.workers[c.decode[0]]), lambda chunk: b'"index": 1' in chunk,
                                         True))
            port = await server.start()
            try:
                async with Router([], [f"http://127.0.0.1:{port}", c.decode[1]], on_failure="recompute") as router:
                    tokens, done = await run(router, PROMPT, 8, PARAMS, 2)
                assert done.ok and done.path == "local", done.error
                check(PROMPT, tokens, 2)
            finally:
                await server.close()

    asyncio.run(main())


def test_a_bad_logprobs_is_refused_by_name() -> None:
    async def main() -> None:
        async with cluster() as c, Router(c.prefill, c.decode) as router:
            with pytest.raises(InvalidRequest, match="'logprobs' must be None or an int in \\[0, 20\\]"):
                await run(router, PROMPT, 2, SamplingParams(), 21)
            with pytest.raises(HttpError) as info:
                await request_json(c.prefill[0], "POST", "/prefill", {"request": "x", "prompt": [1], "logprobs": -1})
            assert info.value.status == 400 and "'logprobs' must be an int in [0, 20]" in str(info.value)
        with pytest.raises(ValueError, match="'logprobs' must be an int"):
            with_logprobs(torch.zeros(4), 0, True)  # type: ignore[arg-type]

    asyncio.run(main())
