"""The router's OpenAI-compatible front end, driven by the official ``openai`` client: real
SmolLM2 workers in this process (loopback transport) behind the router's HTTP server. Every
answer is checked against colocated greedy generation of the same model, cut where the
model's stop id or a stop string ends it."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import openai
import pytest
import torch
from test_router import CFG, cluster, oracle  # noqa: I001 - pytest puts tests/unit on sys.path

from kvxfer.backends.loopback import LoopbackFabric
from kvxfer.engine import SMOLLM2, LlamaModel, SamplingParams, colocated_generate, load_model
from kvxfer.modelfiles.tokenizer import Tokenizer
from kvxfer.router import InvalidRequest, Router
from kvxfer.router.app import make_handler as router_handler
from kvxfer.serving.http import HttpServer, request_text
from kvxfer.worker.app import make_handler
from kvxfer.worker.core import Worker, WorkerConfig

torch.set_num_threads(1)
PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def model() -> LlamaModel:
    return load_model(SMOLLM2)  # about 5 s on 2 cores


def _tok(model: LlamaModel) -> Tokenizer:
    assert model.tokenizer is not None
    return model.tokenizer


@dataclass
class Stack:
    client: openai.AsyncOpenAI
    url: str
    router: Router
    decode: list[str]


@contextlib.asynccontextmanager
async def stack(model: LlamaModel, *, dead_decode: bool = False) -> AsyncIterator[Stack]:
    fabric = LoopbackFabric()
    workers, servers, urls = [], [], {"prefill": [], "decode": []}  # type: ignore[var-annotated]
    try:
        for role in ("prefill", "decode"):
            worker = Worker(WorkerConfig(role=role, model=model.config, model_name=SMOLLM2, num_blocks=64,
                                         backend="loopback", name=role, transfer_timeout_s=10.0),
                            model=model, fabric=fabric)
            await worker.start()
            server = HttpServer(make_handler(worker))
            urls[role].append(f"http://127.0.0.1:{await server.start()}")
            workers.append(worker)
            servers.append(server)
        decode = ["http://127.0.0.1:9"] if dead_decode else urls["decode"]
        async with Router(urls["prefill"], decode, timeout_s=30.0) as router:
            front = HttpServer(router_handler(router))
            url = f"http://127.0.0.1:{await front.start()}"
            servers.append(front)
            # max_retries 0: a 503 is an answer to check here, not one to retry.
            client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
            try:
                yield Stack(client, url, router, urls["decode"])
            finally:
                await client.close()
    finally:
        for server in reversed(servers):
            await server.close()
        for worker in workers:
            await worker.close()


def expected(model: LlamaModel, ids: list[int], n: int,
             sampling: SamplingParams | None = None) -> tuple[list[int], str, str]:
    """Colocated tokens, greedy unless ``sampling`` (through the stop id, which ends them),
    their text, the finish reason."""
    tok = _tok(model)
    out = colocated_generate(model, ids, n, sampling=sampling or SamplingParams())
    cut = tok.cut_at_stop(out)
    if len(cut) < len(out):
        return out[: len(cut) + 1], tok.decode(cut), "stop"
    return out, tok.decode(out), "length"


def test_completions_streamed_and_not_match_colocated_generation(model: LlamaModel) -> None:
    ids = _tok(model).encode(PROMPT)
    tokens, text, finish = expected(model, ids, 8)
    assert text.startswith(" Paris"), text  # the real model, not noise

    async def main() -> None:
        async with stack(model) as s:
            assert [m.id for m in (await s.client.models.list()).data] == [SMOLLM2]
            done = await s.client.completions.create(model=SMOLLM2, prompt=PROMPT, max_tokens=8, temperature=0)
            choice = done.choices[0]
            assert (choice.text, choice.finish_reason) == (text, finish)
            assert choice.model_extra is not None and choice.model_extra["token_ids"] == tokens
            assert done.usage is not None
            assert (done.usage.prompt_tokens, done.usage.completion_tokens) == (len(ids), len(tokens))
            # The same prompt as token ids, streamed, with the usage chunk at the end.
            chunks = [c async for c in await s.client.completions.create(
                model=SMOLLM2, prompt=ids, max_tokens=8, stream=True, stream_options={"include_usage": True})]
            assert "".join(c.choices[0].text for c in chunks if c.choices) == text
            finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
            assert finishes[-1] == finish and set(finishes[:-1]) == {None}
            assert chunks[-1].choices == [] and chunks[-1].usage is not None
            assert chunks[-1].usage.total_tokens == len(ids) + len(tokens)

    asyncio.run(main())


def test_sampled_completions_match_colocated_sampling_with_the_same_parameters(model: LlamaModel) -> None:
    ids = _tok(model).encode(PROMPT)
    params = SamplingParams(temperature=1.3, top_p=0.95, top_k=50, seed=11, frequency_penalty=0.5,
                            logit_bias={12: -100})
    tokens, text, finish = expected(model, ids, 8, params)
    assert tokens != expected(model, ids, 8)[0]  # not the greedy answer

    async def main() -> None:
        async with stack(model) as s:
            done = await s.client.completions.create(
                model=SMOLLM2, prompt=PROMPT, max_tokens=8, temperature=1.3, top_p=0.95, seed=11,
                frequency_penalty=0.5, logit_bias={"12": -100}, extra_body={"top_k": 50})
            choice = done.choices[0]
            assert (choice.text, choice.finish_reason) == (text, finish)
            assert choice.model_extra is not None and choice.model_extra["token_ids"] == tokens
            # The chat route takes the same fields; without a seed each answer is its own.
            chat = await s.client.chat.completions.create(model=SMOLLM2, messages=CHAT, max_tokens=2,
                                                          temperature=0.9, presence_penalty=0.2)
            assert chat.choices[0].finish_reason in ("length", "stop")

    asyncio.run(main())


def test_tokenize_and_detokenize_use_the_models_tokenizer_as_vllms_do(model: LlamaModel) -> None:
    tok = _tok(model)

    async def main() -> None:
        async with stack(model) as s, aiohttp.ClientSession() as http:
            async def post(path: str, body: dict[str, Any]) -> tuple[int, Any]:
                async with http.post(f"{s.url}{path}", json=body) as answer:
                    return answer.status, await answer.json()

            ids = tok.encode(PROMPT)
            assert await post("/tokenize", {"model": SMOLLM2, "prompt": PROMPT}) == (
                200, {"count": len(ids), "max_model_len": model.config.max_positions, "tokens": ids})
            assert (await post("/tokenize", {"prompt": PROMPT, "add_special_tokens": False}))[1]["tokens"] == ids
            # The chat form counts what a chat completion sends the workers.
            status, chat = await post("/tokenize", {"model": SMOLLM2, "messages": CHAT})
            assert status == 200 and chat["tokens"] == tok.encode(tok.chat(CHAT)) and chat["count"] == len(chat["tokens"])
            done = await s.client.chat.completions.create(model=SMOLLM2, messages=CHAT, max_tokens=1)  # type: ignore[arg-type]
            assert done.usage is not None and done.usage.prompt_tokens == chat["count"]
            status, bare = await post("/tokenize", {"messages": CHAT, "add_generation_prompt": False})
            assert status == 200 and bare["tokens"] == tok.encode(tok.chat(CHAT, add_generation_prompt=False))
            assert bare["count"] < chat["count"]
            assert await post("/detokenize", {"model": SMOLLM2, "tokens": ids}) == (200, {"prompt": PROMPT})
            assert await post("/detokenize", {"tokens": chat["tokens"]}) == (200, {"prompt": tok.chat(CHAT)})
            status, body = await post("/detokenize", {"tokens": [1, tok.vocab_size]})
            assert status == 400 and body["error"]["param"] == "tokens"
            assert f"'tokens' must lie in [0, {tok.vocab_size})" in body["error"]["message"]

    asyncio.run(main())


def test_chat_completions_end_at_the_models_stop_token(model: LlamaModel) -> None:
    tok = _tok(model)
    ids = tok.encode(tok.chat(CHAT))
    tokens, text, finish = expected(model, ids, 24)
    assert finish == "stop" and "Paris" in text, text

    async def main() -> None:
        async with stack(model) as s:
            done = await s.client.chat.completions.create(model=SMOLLM2, messages=CHAT,  # type: ignore[arg-type]
                                                          max_tokens=24)
            choice = done.choices[0]
            assert (choice.message.role, choice.message.content, choice.finish_reason) == ("assistant", text, "stop")
            assert done.usage is not None and done.usage.completion_tokens == len(tokens)
            stream = await s.client.chat.completions.create(model=SMOLLM2, messages=CHAT,  # type: ignore[arg-type]
                                                            stream=True)  # max_tokens: the default
            chunks = [c async for c in stream]
            assert chunks[0].choices[0].delta.role == "assistant"
            assert "".join(c.choices[0].delta.content or "" for c in chunks) == text
            assert chunks[-1].choices[0].finish_reason == "stop"

    asyncio.run(main())


def test_a_stop_string_ends_the_text_before_it_and_the_decode_worker_stops(model: LlamaModel) -> None:
    ids = _tok(model).encode(PROMPT)
    _, text, _ = expected(model, ids, 8)
    stop = text[3:6]  # inside the completion's text, across token boundaries or not
    want = text[: text.index(stop)]

    async def main() -> None:
        async with stack(model) as s:
            done = await s.client.completions.create(model=SMOLLM2, prompt=PROMPT, max_tokens=200, stop=[stop, "zzz"])
            assert (done.choices[0].text, done.choices[0].finish_reason) == (want, "stop")
            assert done.usage is not None and done.usage.completion_tokens < 8
            chunks = [c async for c in await s.client.completions.create(
                model=SMOLLM2, prompt=PROMPT, max_tokens=200, stop=stop, stream=True)]
            assert "".join(c.choices[0].text for c in chunks) == want
            assert chunks[-1].choices[0].finish_reason == "stop"
            # The router closed the decode worker's stream: it stops long before 200 tokens.
            for _ in range(200):
                metrics = await request_text(s.decode[0], "/metrics")
                if "kvxfer_worker_active_streams 0.0\n" in metrics:
                    break
                await asyncio.sleep(0.05)
            produced = float(metrics.split("\nkvxfer_generated_tokens_total ")[1].split()[0])
            assert "kvxfer_worker_active_streams 0.0\n" in metrics and produced < 30, produced

    asyncio.run(main())


BAD_REQUESTS: list[tuple[dict[str, Any], int, str, str | None]] = [
    ({"prompt": PROMPT, "extra_body": {"frobnicate": 1}}, 400, "unknown field 'frobnicate'", "frobnicate"),
    ({"prompt": PROMPT, "temperature": -0.7}, 400, "'temperature' must lie in [0", "temperature"),
    ({"prompt": PROMPT, "temperature": 0.7, "extra_body": {"top_k": 0.5}}, 400, "'top_k' must be an int", "top_k"),
    ({"prompt": PROMPT, "logit_bias": {"49152": 5}}, 400, "token id 49152 is outside the vocabulary", "logit_bias"),
    ({"prompt": PROMPT, "logprobs": 6}, 400, "'logprobs' must be an integer in [0, 5]", "logprobs"),
    ({"prompt": PROMPT, "n": 17}, 400, "'n' must be an integer in [1, 16]", "n"),
    ({"prompt": [1, 49152]}, 400, "token ids must lie in [0, 49152) for the workers' model 'smollm2'", "prompt"),
    ({"prompt": PROMPT, "max_tokens": 10**6}, 400, "positions, over the workers' model's", "max_tokens"),
    ({"prompt": ""}, 400, "'prompt' is empty", "prompt"),
    ({"prompt": PROMPT, "model": "gpt-4o"}, 404, "model 'gpt-4o' is not served here", "model"),
]


def test_bad_requests_get_openais_error_shape_and_status(model: LlamaModel) -> None:
    async def main() -> None:
        async with stack(model) as s:
            for fields, status, words, param in BAD_REQUESTS:
                kwargs: dict[str, Any] = {"model": SMOLLM2, "max_tokens": 4, **fields}
                with pytest.raises(openai.APIStatusError) as info:
                    await s.client.completions.create(**kwargs)
                err = info.value
                assert err.status_code == status and words in err.message, (fields, err.message)
                assert isinstance(err.body, dict) and err.body.get("param") == param, err.body
                assert err.body.get("type") == "invalid_request_error"
            with pytest.raises(openai.BadRequestError, match="'messages'"):
                await s.client.chat.completions.create(model=SMOLLM2, messages=[])
            # The raw shape, as any client sees it.
            async with aiohttp.ClientSession() as http:
                async with http.post(f"{s.url}/v1/completions", json={"model": SMOLLM2, "prompt": "x",
                                                                      "max_tokens": "many"}) as answer:
                    body = await answer.json()
            assert answer.status == 400 and set(body) == {"error"}
            assert set(body["error"]) == {"message", "type", "param", "code"} and body["error"]["param"] == "max_tokens"

    asyncio.run(main())


def test_no_usable_worker_pair_is_503_for_requests_and_health(model: LlamaModel) -> None:
    async def main() -> None:
        async with stack(model, dead_decode=True) as s:
            for stream in (False, True):
                with pytest.raises(openai.InternalServerError) as info:
                    await s.client.completions.create(model=SMOLLM2, prompt=PROMPT, max_tokens=4, stream=stream)
                assert info.value.status_code == 503 and "no usable prefill/decode worker pair" in info.value.message
            async with aiohttp.ClientSession() as http:
                async with http.get(f"{s.url}/health") as answer:
                    health = await answer.json()
                async with http.head(f"{s.url}/health") as head:
                    assert head.status == 503 and await head.read() == b""
            assert answer.status == 503 and health["status"] == "unavailable", health
            assert "decode" in health["reason"] and health["decode"] == {"http://127.0.0.1:9": False}

    asyncio.run(main())


def _generate_error(answer_status: int, text: str) -> str:
    assert answer_status == 400, text
    return str(json.loads(text)["error"])


@pytest.mark.parametrize(("prompt", "max_new"), [([1, CFG.vocab_size], 2), ([-1], 2), ([], 2), ([1, True], 2),
                                                 ([1.5], 2), ("text", 2), ([1, 2], 0), ([1, 2], CFG.max_positions)])
def test_input_checks_say_the_same_in_process_and_over_http(prompt: Any, max_new: Any) -> None:
    async def main() -> None:
        async with cluster() as c:
            async with Router(c.prefill, c.decode) as router:
                with pytest.raises(InvalidRequest) as info:
                    await router.generate(prompt, max_new)
                server = HttpServer(router_handler(router))
                url = f"http://127.0.0.1:{await server.start()}"
                try:
                    async with aiohttp.ClientSession() as http:
                        async with http.post(f"{url}/generate", json={"prompt": prompt, "max_new_tokens": max_new}) as a:
                            assert _generate_error(a.status, await a.text()) == str(info.value)
                finally:
                    await server.close()

    asyncio.run(main())


def test_the_toy_model_takes_token_ids_and_refuses_text_by_name() -> None:
    async def main() -> None:
        async with cluster() as c, Router(c.prefill, c.decode) as router:
            server = HttpServer(router_handler(router))
            url = f"http://127.0.0.1:{await server.start()}"
            client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
            try:
                done = await client.completions.create(model="toy", prompt=[5, 4, 3], max_tokens=6)
                assert done.choices[0].text == "" and done.choices[0].model_extra is not None
                assert done.choices[0].model_extra["token_ids"] == oracle([5, 4, 3], 6)
                for call, words in ((client.completions.create(model="toy", prompt="hello", max_tokens=2),
                                     "a text prompt needs the model's tokenizer"),
                                    (client.chat.completions.create(model="toy", messages=CHAT),  # type: ignore[arg-type]
                                     "chat needs the model's tokenizer")):
                    with pytest.raises(openai.BadRequestError) as info:
                        await call
                    assert words in info.value.message and "model 'toy' has none" in info.value.message
            finally:
                await client.close()
                await server.close()

    asyncio.run(main())


def test_workers_join_and_leave_a_running_router() -> None:
    async def main() -> None:
        async with cluster(1, 2) as c:
            async with Router(c.prefill, ["http://127.0.0.1:9"]) as router:
                gone = await router.generate([5, 4, 3], 4)
                assert gone.finish_reason == "unavailable" and gone.tokens == (), gone
                assert "reserve on http://127.0.0.1:9 failed" in (gone.error or "")
                router.add_worker("decode", c.decode[0])
                router.remove_worker("http://127.0.0.1:9")
                with pytest.raises(ValueError, match="already in the router"):
                    router.add_worker("prefill", c.decode[0])
                with pytest.raises(ValueError, match="not a server's URL"):
                    router.add_worker("decode", "http://127.0.0.1")
                done = await router.generate([5, 4, 3], 4)
                assert done.ok and list(done.tokens) == oracle([5, 4, 3], 4) and done.decode == c.decode[0]
                router.add_worker("decode", c.decode[1])
                router.remove_worker(c.decode[0])
                with pytest.raises(KeyError, match="not in the router"):
                    router.remove_worker(c.decode[0])
                done = await router.generate([5, 4, 3], 4, stop_ids={oracle([5, 4, 3], 4)[1]})
                assert done.decode == c.decode[1] and done.finish_reason == "stop" and len(done.tokens) == 2
                assert (await router.health()).status == "ok"

    asyncio.run(main())
