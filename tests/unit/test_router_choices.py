"""``n`` choices and logprobs on the OpenAI routes, through the official client, with real
SmolLM2 workers in this process (as test_router_openai): choice i is the colocated
completion sampled with the seed plus i, streamed or not; greedy choices are all the same;
logprobs are the log-softmax of the model's raw logits computed here, colocated."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import pytest
import torch
from test_router_openai import CHAT, PROMPT, _tok, expected, model, stack  # noqa: F401 - the module fixture, shared

from kvxfer.engine import SMOLLM2, LlamaModel, SamplingParams, tokens_needed

PARAMS = SamplingParams(temperature=1.0, top_p=0.95, seed=11)
TOLERANCE = 1e-4


def reference(model: LlamaModel, prompt: list[int], tokens: list[int]) -> list[torch.Tensor]:  # noqa: F811
    """log_softmax of the model's logits before each of ``tokens``, run colocated here."""
    cfg = model.config
    need = tokens_needed(len(prompt), len(tokens))
    pool = cfg.make_pool(-(-need // cfg.block_tokens))
    pool.allocate("ref", need)
    rows = [model.forward(pool, "ref", prompt, 0)]
    rows += [model.forward(pool, "ref", [t], len(prompt) + i) for i, t in enumerate(tokens[:-1])]
    return [torch.log_softmax(r.double(), dim=-1) for r in rows]


def test_n_choices_are_the_seed_plus_index_completions_streamed_and_not(model: LlamaModel) -> None:  # noqa: F811
    ids = _tok(model).encode(PROMPT)
    want = [expected(model, ids, 6, PARAMS.for_choice(i)) for i in range(3)]
    assert len({tuple(w[0]) for w in want}) > 1  # the choices differ
    assert PARAMS.for_choice(2).seed == 13 and PARAMS.for_choice(0) == PARAMS

    async def main() -> None:
        async with stack(model) as s:
            fields: dict[str, Any] = {"model": SMOLLM2, "prompt": PROMPT, "max_tokens": 6, "temperature": 1.0,
                                      "top_p": 0.95, "seed": 11, "n": 3}
            done = await s.client.completions.create(**fields)
            assert [c.index for c in done.choices] == [0, 1, 2]
            for c, (tokens, text, finish) in zip(done.choices, want):
                assert c.model_extra is not None and c.model_extra["token_ids"] == tokens
                assert (c.text, c.finish_reason) == (text, finish)
            assert done.usage is not None and done.usage.prompt_tokens == len(ids)
            assert done.usage.completion_tokens == sum(len(w[0]) for w in want)
            chunks = [c async for c in await s.client.completions.create(
                **fields, stream=True, stream_options={"include_usage": True})]
            for i, (tokens, text, finish) in enumerate(want):
                mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == i]
                assert "".join(c.text for c in mine) == text
                assert sum((c.model_extra["token_ids"] for c in mine if c.model_extra), []) == tokens
                assert [c.finish_reason for c in mine][-1] == finish
            assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == done.usage.completion_tokens
            # Greedy: n identical choices, as vLLM gives; chat streams each choice's role first.
            chat = await s.client.chat.completions.create(model=SMOLLM2, messages=CHAT, max_tokens=4, n=2)  # type: ignore[arg-type]
            assert len(chat.choices) == 2 and chat.choices[0].message.content == chat.choices[1].message.content
            streamed = [c async for c in await s.client.chat.completions.create(
                model=SMOLLM2, messages=CHAT, max_tokens=4, n=2, stream=True)]  # type: ignore[arg-type]
            for i in range(2):
                deltas = [c.choices[0].delta for c in streamed if c.choices[0].index == i]
                assert deltas[0].role == "assistant"
                assert "".join(d.content or "" for d in deltas) == chat.choices[i].message.content

    asyncio.run(main())


def test_chat_and_completion_logprobs_are_the_log_softmax_of_the_raw_logits(model: LlamaModel) -> None:  # noqa: F811
    tok = _tok(model)
    chat_ids = tok.encode(tok.chat(CHAT))
    chat_tokens = expected(model, chat_ids, 5, PARAMS)[0]
    ids = tok.encode(PROMPT)
    tokens = expected(model, ids, 5)[0]

    async def main() -> None:
        async with stack(model) as s:
            chat = await s.client.chat.completions.create(
                model=SMOLLM2, messages=CHAT, max_tokens=5, temperature=1.0, top_p=0.95, seed=11,  # type: ignore[arg-type]
                logprobs=True, top_logprobs=3)
            content = chat.choices[0].logprobs.content  # type: ignore[union-attr]
            assert content is not None and chat.usage is not None
            assert len(content) == chat.usage.completion_tokens == len(chat_tokens)
            for entry, token, row in zip(content, chat_tokens, reference(model, chat_ids, chat_tokens)):
                assert entry.token == tok.decode([token]) and bytes(entry.bytes or []) == tok.token_bytes(token)
                assert abs(entry.logprob - float(row[token])) < TOLERANCE, (entry, float(row[token]))
                top = torch.topk(row, 3)
                assert [t.token for t in entry.top_logprobs] == [tok.decode([int(i)]) for i in top.indices]
                assert all(abs(t.logprob - float(v)) < TOLERANCE for t, v in zip(entry.top_logprobs, top.values))
            plain = await s.client.chat.completions.create(model=SMOLLM2, messages=CHAT, max_tokens=2)  # type: ignore[arg-type]
            assert plain.choices[0].logprobs is None
            # Legacy completions, streamed: each chunk carries its token's.
            chunks = [c async for c in await s.client.completions.create(
                model=SMOLLM2, prompt=PROMPT, max_tokens=5, logprobs=2, stream=True)]
            parts = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
            got = dataclasses.replace(_Legacy(), **{k: sum((getattr(p, k) for p in parts), [])
                                                   for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")})
            assert got.tokens == [tok.decode([t]) for t in tokens]
            rows = reference(model, ids, tokens)
            assert all(abs(lp - float(row[t])) < TOLERANCE for lp, t, row in zip(got.token_logprobs, tokens, rows))
            assert [len(d) for d in got.top_logprobs] == [2] * len(tokens)
            assert got.text_offset == [sum(len(t) for t in got.tokens[:i]) for i in range(len(tokens))]

    asyncio.run(main())


@dataclasses.dataclass
class _Legacy:
    tokens: list[str] = dataclasses.field(default_factory=list)
    token_logprobs: list[float] = dataclasses.field(default_factory=list)
    top_logprobs: list[dict[str, float]] = dataclasses.field(default_factory=list)
    text_offset: list[int] = dataclasses.field(default_factory=list)


@pytest.mark.parametrize(("fields", "param"), [({"n": 17}, "n"), ({"logprobs": 6}, "logprobs"),
                                               ({"n": 2, "best_of": 4}, "best_of")])
def test_too_many_choices_or_logprobs_are_refused_by_name(model: LlamaModel, fields: dict[str, Any],  # noqa: F811
                                                          param: str) -> None:
    import openai  # noqa: PLC0415

    async def main() -> None:
        async with stack(model) as s:
            with pytest.raises(openai.BadRequestError) as info:
                await s.client.completions.create(model=SMOLLM2, prompt=PROMPT, max_tokens=2, **fields)
            assert isinstance(info.value.body, dict) and info.value.body.get("param") == param

    asyncio.run(main())
