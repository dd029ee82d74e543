"""OpenAI request bodies: any JSON either reads as an ``Ask`` or is refused with an OpenAIError
(a 400 naming the field), never another exception (which the server would answer 500)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_router import cluster  # noqa: I001 - pytest puts tests/unit on sys.path

from kvxfer.engine.sampling import GREEDY, SamplingParams
from kvxfer.router import Router
from kvxfer.router.app import make_handler
from kvxfer.router.openai_api import CHAT_FIELDS, COMPLETION_FIELDS, Ask, OpenAIError, parse
from kvxfer.serving.http import HttpServer

ODD = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=True),
                st.text(max_size=8), st.lists(st.integers(-2, 70000), max_size=4),
                st.lists(st.text(max_size=3), max_size=5), st.dictionaries(st.text(max_size=4), st.integers(), max_size=2))
MESSAGES = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool", 5]),
                                           "content": st.one_of(st.text(max_size=6), ODD)}), max_size=3)
FIELDS = sorted(CHAT_FIELDS | COMPLETION_FIELDS | {"unknown_field"})


@settings(max_examples=400, deadline=None)
@given(st.dictionaries(st.sampled_from(FIELDS), st.one_of(ODD, MESSAGES), max_size=6), st.booleans())
def test_any_body_reads_or_is_refused_by_name(body: dict[str, Any], chat: bool) -> None:
    try:
        ask = parse(body, chat)
    except OpenAIError as exc:
        assert exc.status == 400 and str(exc)
        if exc.param is not None:
            assert exc.param.split("[")[0].split(".")[0] in FIELDS
        return
    assert isinstance(ask, Ask) and ask.model == body["model"] and ask.chat == chat
    assert ask.max_tokens is None or ask.max_tokens >= 1


@pytest.mark.parametrize(("body", "param", "words"), [
    ({"model": "m", "prompt": "x", "stream_options": {"include_usage": True}}, "stream_options", "only allowed"),
    ({"model": "m", "prompt": ["a", "b"]}, "prompt", "several prompts"),
    ({"model": "m", "prompt": [1, True]}, "prompt", "list of token ids"),
    ({"model": "m", "prompt": "x", "stop": ["a"] * 5}, "stop", "at most 4"),
    ({"model": "m", "prompt": "x", "logprobs": 6}, "logprobs", r"'logprobs' must be an integer in \[0, 5\]"),
    ({"prompt": "x"}, "model", "'model' is required"),
    ({"model": "m", "prompt": "x", "temperature": False}, "temperature", "'temperature' must be a number"),
    ({"model": "m", "prompt": "x", "temperature": -0.5}, "temperature", r"'temperature' must lie in \[0"),
    ({"model": "m", "prompt": "x", "top_p": 0}, "top_p", r"'top_p' must lie in \(0, 1\]"),
    ({"model": "m", "prompt": "x", "top_k": 1.5}, "top_k", "'top_k' must be an int"),
    ({"model": "m", "prompt": "x", "min_p": 2}, "min_p", "'min_p' must lie in"),
    ({"model": "m", "prompt": "x", "seed": "7"}, "seed", "'seed' must be an integer"),
    ({"model": "m", "prompt": "x", "presence_penalty": 3}, "presence_penalty", r"must lie in \[-2, 2\]"),
    ({"model": "m", "prompt": "x", "frequency_penalty": -2.5}, "frequency_penalty", r"must lie in \[-2, 2\]"),
    ({"model": "m", "prompt": "x", "repetition_penalty": 0}, "repetition_penalty", "'repetition_penalty' must"),
    ({"model": "m", "prompt": "x", "logit_bias": {"12": 150}}, "logit_bias", r"must lie in \[-100, 100\]"),
    ({"model": "m", "prompt": "x", "logit_bias": {"a": 1}}, "logit_bias", "keys must be token ids"),
    ({"model": "m", "prompt": "x", "n": 17}, "n", r"'n' must be an integer in \[1, 16\], got 17"),
    ({"model": "m", "prompt": "x", "n": True}, "n", r"'n' must be an integer in \[1, 16\]"),
    ({"model": "m", "prompt": "x", "n": 0}, "n", r"'n' must be an integer in \[1, 16\]"),
    ({"model": "m", "prompt": "x", "best_of": 3}, "best_of", r"'best_of' must equal 'n' \(1\)"),
    ({"model": "m", "prompt": "x", "n": 2, "best_of": 3}, "best_of", r"'best_of' must equal 'n' \(2\)"),
    ({"model": "m", "prompt": "x", "logprobs": True}, "logprobs", r"'logprobs' must be an integer in \[0, 5\]"),
])
def test_refusals_name_the_field(body: dict[str, Any], param: str, words: str) -> None:
    with pytest.raises(OpenAIError, match=words) as info:
        parse(body, chat=False)
    assert info.value.param == param


def test_sampling_fields_are_taken_as_openai_and_vllm_name_them() -> None:
    body = {"model": "m", "prompt": "x", "temperature": 0.8, "top_p": 0.9, "top_k": 40, "min_p": 0.05, "seed": 7,
            "presence_penalty": 0.5, "frequency_penalty": -0.5, "repetition_penalty": 1.1,
            "logit_bias": {"12": -100, "7": 3}}
    ask = parse(body, chat=False)
    assert ask.sampling == SamplingParams(temperature=0.8, top_p=0.9, top_k=40, min_p=0.05, seed=7,
                                          presence_penalty=0.5, frequency_penalty=-0.5, repetition_penalty=1.1,
                                          logit_bias={12: -100, 7: 3})
    # Absent, null or neutral: greedy, as before.
    neutral = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "temperature": 0, "top_p": 1,
               "seed": None, "logit_bias": {}, "presence_penalty": 0, "n": 1}
    assert parse(neutral, chat=True).sampling == GREEDY
    with pytest.raises(OpenAIError, match="'top_logprobs' needs 'logprobs': true") as info:
        parse({**neutral, "top_logprobs": 2}, chat=True)
    assert info.value.param == "top_logprobs"


@pytest.mark.parametrize(("fields", "param", "words"), [
    ({"logprobs": 1}, "logprobs", "'logprobs' must be true or false"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", r"'top_logprobs' must be an integer in \[0, 20\]"),
    ({"logprobs": True, "top_logprobs": -1}, "top_logprobs", r"'top_logprobs' must be an integer in \[0, 20\]"),
    ({"n": 1.5}, "n", r"'n' must be an integer in \[1, 16\], got 1.5"),
])
def test_chat_refusals_of_n_and_logprobs_name_the_field(fields: dict[str, Any], param: str, words: str) -> None:
    with pytest.raises(OpenAIError, match=words) as info:
        parse({"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}, chat=True)
    assert info.value.param == param and info.value.status == 400


def test_n_and_logprobs_are_read_as_openai_names_them() -> None:
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    assert (parse(chat, chat=True).n, parse(chat, chat=True).logprobs) == (1, None)
    assert parse({**chat, "logprobs": True}, chat=True).logprobs == 0
    assert parse({**chat, "logprobs": True, "top_logprobs": 20, "n": 16}, chat=True).logprobs == 20
    assert parse({**chat, "logprobs": False, "top_logprobs": 0}, chat=True).logprobs is None
    legacy = parse({"model": "m", "prompt": "x", "logprobs": 5, "n": 3, "best_of": 3}, chat=False)
    assert (legacy.n, legacy.logprobs) == (3, 5)
    assert parse({"model": "m", "prompt": "x", "logprobs": 0}, chat=False).logprobs == 0


def test_a_chat_with_tool_calls_or_images_is_refused_by_name() -> None:
    for message, words in (({"role": "assistant", "content": "x", "tool_calls": []}, "no tools"),
                           ({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]},
                            "no images")):
        with pytest.raises(OpenAIError, match=words):
            parse({"model": "m", "messages": [message]}, chat=True)
    ask = parse({"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                          {"type": "text", "text": "b"}]}]}, chat=True)
    assert ask.messages[0].content == "ab"


def test_odd_bodies_over_http_are_4xx_never_500() -> None:
    bodies: list[bytes] = [b"", b"null", b"[]", b"{", b"\xff", json.dumps({"model": "toy", "prompt": [1] * 5000}).encode(),
                           json.dumps({"model": "toy", "prompt": [1], "max_tokens": 10**30}).encode(),
                           json.dumps({"model": "toy", "prompt": [2**63]}).encode(),
                           json.dumps({"model": "toy", "messages": [{"role": "user", "content": "hi"}]}).encode()]

    async def main() -> None:
        async with cluster() as c, Router(c.prefill, c.decode) as router:
            server = HttpServer(make_handler(router))
            url = f"http://127.0.0.1:{await server.start()}"
            try:
                async with aiohttp.ClientSession() as http:
                    for path in ("/v1/completions", "/v1/chat/completions"):
                        for body in bodies:
                            async with http.post(url + path, data=body,
                                                 headers={"Content-Type": "application/json"}) as answer:
                                got = await answer.json()
                            assert 400 <= answer.status < 500, (path, body[:40], answer.status, got)
                            assert set(got["error"]) == {"message", "type", "param", "code"}
                    async with http.get(url + "/v1/nothing") as answer:
                        assert answer.status == 404 and (await answer.json())["error"]["code"] == "unknown_url"
            finally:
                await server.close()

    asyncio.run(main())
