"""Sampled requests through the router and real workers in this process (loopback): token
for token the colocated oracle with the same parameters, on the disaggregated path and on a
recompute that goes on after a decode worker was cut mid-stream; a request without a seed
gets one, named in its Completion; bad parameters are 400s naming the field, at the router
and at the workers."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import pytest
from test_router import CFG, MODEL, _cutting, cluster, oracle  # noqa: I001 - pytest puts tests/unit on sys.path

from kvxfer.engine import SamplingParams, colocated_generate
from kvxfer.router import InvalidRequest, Router
from kvxfer.router.app import make_handler as router_handler
from kvxfer.serving.http import HttpError, HttpServer, request_json, stream_json
from kvxfer.worker.app import make_handler

PROMPT = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]
PARAMS = SamplingParams(temperature=1.0, top_p=0.95, seed=7, presence_penalty=0.4, repetition_penalty=1.1)


def sampled(prompt: list[int], n: int, params: SamplingParams = PARAMS) -> list[int]:
    return colocated_generate(MODEL, prompt, n, sampling=params)


def test_sampled_requests_match_the_oracle_with_the_same_parameters() -> None:
    async def main() -> None:
        async with cluster() as c, Router(c.prefill, c.decode) as router:
            done = await router.generate(PROMPT, 10, sampling=PARAMS)
            assert done.ok and done.path == "disaggregated", done.error
            assert list(done.tokens) == sampled(PROMPT, 10) != oracle(PROMPT, 10)
            assert done.seed == 7
            again = await router.generate(PROMPT, 10, sampling=PARAMS)
            assert again.tokens == done.tokens  # the same seed: the same completion
            # No seed: the router picks one, names it, and it reproduces the completion.
            unseeded = dataclasses.replace(PARAMS, seed=None)
            first = await router.generate(PROMPT, 10, sampling=unseeded)
            second = await router.generate(PROMPT, 10, sampling=unseeded)
            assert first.seed is not None and second.seed is not None and first.seed != second.seed
            assert list(first.tokens) == sampled(PROMPT, 10, dataclasses.replace(PARAMS, seed=first.seed))
            greedy = await router.generate(PROMPT, 10)
            assert greedy.seed is None and list(greedy.tokens) == oracle(PROMPT, 10)

    asyncio.run(main())


def test_a_recompute_after_a_cut_decode_worker_goes_on_with_the_same_stream() -> None:
    # No prefill worker: decode worker 0 prefills, streams two tokens and is cut; decode
    # worker 1 goes on from the prompt plus those two ("generated": 2), drawing index 2 on.
    async def main() -> None:
        async with cluster(0, 2) as c:
            server = HttpServer(_cutting(make_handler(c.workers[c.decode[0]]), lambda chunk: b'"index": 1' in chunk,
                                         True))
            port = await server.start()
            try:
                async with Router([], [f"http://127.0.0.1:{port}", c.decode[1]], on_failure="recompute") as router:
                    done = await router.generate(PROMPT, 8, sampling=PARAMS)
                assert done.ok and done.path == "local", done.error
                assert any("failed" in e for e in done.events), done.events
                assert list(done.tokens) == sampled(PROMPT, 8)
            finally:
                await server.close()

    asyncio.run(main())


@pytest.mark.parametrize(("fields", "words"), [
    ({"temperature": -1}, "'temperature' must lie in [0"),
    ({"top_p": 2}, "'top_p' must lie in (0, 1]"),
    ({"top_k": "ten"}, "'top_k' must be an int"),
    ({"seed": True}, "'seed' must be an integer"),
    ({"logit_bias": {"500": 1}}, "'logit_bias' token id 500 is outside the vocabulary [0, 128)"),
    ({"logit_bias": [[1, 2]]}, "'logit_bias' must be an object"),
])
def test_the_routers_generate_takes_sampling_fields_and_names_bad_ones(fields: dict[str, Any], words: str) -> None:
    async def main() -> None:
        async with cluster() as c, Router(c.prefill, c.decode) as router:
            server = HttpServer(router_handler(router))
            url = f"http://127.0.0.1:{await server.start()}"
            try:
                body = {"prompt": PROMPT, "max_new_tokens": 6, "temperature": 1.0, "top_p": 0.95, "seed": 7,
                        "presence_penalty": 0.4, "repetition_penalty": 1.1}
                events = [e async for e in stream_json(url, "/generate", body, 30.0, 30.0)]
                completion = events[-1]["completion"]
                assert completion["tokens"] == sampled(PROMPT, 6) and completion["seed"] == 7
                with pytest.raises(HttpError) as info:
                    async for _ in stream_json(url, "/generate", {"prompt": PROMPT, **fields}, 30.0, 30.0):
                        pass
                assert info.value.status == 400 and words in str(info.value), str(info.value)
            finally:
                await server.close()
        # The same refusal in this process, for what the router checks against the workers' model.
        if "vocabulary" in words:
            async with cluster() as c, Router(c.prefill, c.decode) as router:
                with pytest.raises(InvalidRequest, match="outside the vocabulary"):
                    await router.generate(PROMPT, 2, sampling=SamplingParams(logit_bias={500: 1}))

    asyncio.run(main())


def test_workers_refuse_bad_sampling_by_name() -> None:
    async def main() -> None:
        async with cluster() as c:
            p, d = c.prefill[0], c.decode[0]
            cases = [
                (p, "/prefill", {"request": "x", "prompt": [1, 2], "sampling": {"temperature": -1}},
                 "'sampling': 'temperature' must lie in [0"),
                (p, "/prefill", {"request": "x", "prompt": [1, 2], "sampling": {"temperature": 0.5}},
                 "'seed' is required with a temperature above 0"),
                (p, "/prefill", {"request": "x", "prompt": [1, 2], "sampling": {"temprature": 0.5}},
                 "'temprature' is not a sampling parameter"),
                (p, "/prefill", {"request": "x", "prompt": [1, 2], "sampling": {"logit_bias": {"128": 1}}},
                 "outside the vocabulary [0, 128)"),
                (d, "/generate", {"request": "x", "prompt": [1, 2], "max_new_tokens": 2, "generated": 2},
                 "'generated' must be a count"),
            ]
            for url, path, body, words in cases:
                with pytest.raises(HttpError) as info:
                    await request_json(url, "POST", path, body)
                assert info.value.status == 400 and words in str(info.value), (path, str(info.value))
            # Well formed: the worker's first token is the oracle's (index 0 of the stream).
            answer = await request_json(p, "POST", "/prefill", {"request": "y", "prompt": PROMPT,
                                                                "sampling": PARAMS.to_json()})
            assert answer["token"] == sampled(PROMPT, 1)[0]
            await request_json(p, "POST", "/abort", {"request": "y"})
            assert CFG.vocab_size == 128

    asyncio.run(main())
