"""Workers serving with transformers' continuous batching (``WorkerConfig(engine="transformers")``,
``kvxfer serve --engine transformers``) behind the router: concurrent requests of mixed lengths
are token-identical to transformers' own colocated ``generate_batch``, each prompt's KV moved
out of one transformers cache into the other (nothing recomputed); a pair of a transformers
worker and a reference worker is refused by name; seeded sampling with logprobs makes the same
tokens disaggregated, on a decode worker alone, and recomputed on another after a cut. Real
Worker objects behind real HTTP servers in this process, a tiny random Llama (no GGUF, so it
is fast), the loopback backend."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch

from kvxfer.adapters.transformers import ENGINE
from kvxfer.adapters.transformers import _internals as hf
from kvxfer.engine import LlamaModel, ModelConfig, SamplingParams
from kvxfer.router import Completion, Router, Token
from kvxfer.router.inputs import MixedEngines
from kvxfer.serving.http import HttpError, HttpServer, request_json
from kvxfer.testing.served import served_workers
from kvxfer.worker.app import make_handler
from kvxfer.worker.core import WorkerConfig
from kvxfer.worker.hf_engine import MAX_BATCH_TOKENS, PAGE_SIZE

torch.set_num_threads(1)
SHAPE = ModelConfig(vocab_size=128, hidden=64, layers=3, heads=4, kv_heads=2, head_dim=16, intermediate=128,
                    max_positions=256)
BLOCKS = 64
NEW = 6
# Mixed lengths: under one block, across one, several blocks; two share a 16-token prefix.
PROMPTS = [[5, 9, 17, 3, 8, 44, 21, 7, 60, 2, 13], [7, 7, 1], list(range(20, 58)),
           [*range(20, 36), 90, 91, 92], [100, 101, 102, 103, 104], list(range(60, 77)), [3] * 33, [11, 12]]


@pytest.fixture(scope="module")
def model(tiny_hf_llama: Any) -> Any:
    return tiny_hf_llama


def served(engines: dict[str, tuple[str, Any]]) -> Any:
    """A worker per role ({role: (engine, model)}) behind an HTTP server; their URLs and the workers."""
    return served_workers({role: (WorkerConfig(role=role, model=SHAPE if engine == "transformers" else model.config,
                                               num_blocks=BLOCKS, backend="loopback", name=role,
                                               transfer_timeout_s=10.0, engine=engine), model)
                           for role, (engine, model) in engines.items()})


def test_concurrent_requests_are_token_identical_to_generate_batch(model: Any) -> None:
    expected = hf.colocated(model, PROMPTS, NEW, hf.batching_config(PAGE_SIZE, BLOCKS, MAX_BATCH_TOKENS))

    async def main() -> dict[str, dict[str, float]]:
        async with served({"prefill": ("transformers", model), "decode": ("transformers", model)}) as (urls, workers):
            async with Router([urls["prefill"]], [urls["decode"]]) as router:
                done = await asyncio.gather(*(router.generate(p, NEW) for p in PROMPTS))
            metrics = {role: w.metrics.snapshot() for role, w in workers.items()}
        for completion, want in zip(done, expected):
            assert completion.ok, completion.error
            assert list(completion.tokens) == want
            assert completion.path == "disaggregated" and completion.recomputed_tokens == 0
            assert completion.transfer is not None and completion.transfer.status == "delivered"
        return metrics

    metrics = asyncio.run(main())
    # Where each engine thread's time went: the batch's steps, and the work the moves added
    # (the prefill end lends, describes and publishes each request; the decode end lends its
    # reservation, fetches, marks arrival and adopts): what moving costs the step loop.
    for role, m in metrics.items():
        jobs = {job: m[f'kvxfer_engine_thread_jobs_total{{job="{job}"}}'] for job in ("step", "engine", "transfer")}
        assert jobs["step"] > 0 and jobs["transfer"] >= len(PROMPTS), (role, jobs)
        assert m['kvxfer_engine_thread_seconds_total{job="transfer"}'] > 0, role
        steps = sum(m[f'kvxfer_engine_steps_total{{transfers="{t}"}}'] for t in ("in_flight", "none"))
        assert steps == jobs["step"], (role, steps, jobs)


def test_a_mixed_pair_is_refused_naming_both_engines(model: Any) -> None:
    reference = LlamaModel(SHAPE)

    async def main() -> None:
        async with served({"prefill": ("transformers", model), "decode": ("reference", reference)}) as (urls, _):
            async with Router([urls["prefill"]], [urls["decode"]]) as router:
                with pytest.raises(MixedEngines) as exc:
                    await router.generate(PROMPTS[0], NEW)
        text = str(exc.value)
        assert f"prefill worker {urls['prefill']} runs {ENGINE!r}" in text
        assert f"decode worker {urls['decode']} runs 'kvxfer reference'" in text

    asyncio.run(main())


def test_sampled_requests_make_the_same_tokens_disaggregated_and_on_a_decode_worker_alone(model: Any) -> None:
    """Seeded sampling with logprobs, concurrent requests with different parameters in one
    batch: the tokens (the first from the prefill worker) and logprobs disaggregated are those
    a decode worker alone makes; an unknown sampling parameter is refused by name."""
    params = [SamplingParams(temperature=0.8, seed=7), SamplingParams(temperature=1.0, top_p=0.9, seed=8,
                                                                      presence_penalty=0.5), SamplingParams()]

    async def one(router: Router, prompt: list[int], sampling: SamplingParams) -> tuple[list[Token], Completion]:
        tokens: list[Token] = []
        async for item in router.stream(prompt, NEW, sampling=sampling, logprobs=2):
            if isinstance(item, Completion):
                assert item.ok, item.error
                return tokens, item
            tokens.append(item)
        raise AssertionError("no completion")

    async def generate(router: Router) -> list[tuple[list[Token], Completion]]:
        return await asyncio.gather(*(one(router, p, s) for p, s in zip(PROMPTS[:3], params)))

    async def main() -> None:
        async with served({"prefill": ("transformers", model), "decode": ("transformers", model)}) as (urls, _):
            async with Router([urls["prefill"]], [urls["decode"]]) as router:
                apart = await generate(router)
            async with Router([], [urls["decode"]], on_failure="recompute") as router:
                alone = await generate(router)
            with pytest.raises(HttpError) as info:
                await request_json(urls["decode"], "POST", "/generate", {
                    "request": "x", "prompt": PROMPTS[0], "max_new_tokens": 2, "sampling": {"typical_p": 0.5}})
            assert info.value.status == 400 and "'typical_p' is not a sampling parameter" in str(info.value)
        assert [c.path for _, c in apart] == ["disaggregated"] * 3 and [c.path for _, c in alone] == ["local"] * 3
        for (a, _), (b, _) in zip(apart, alone):
            assert [t.token for t in a] == [t.token for t in b]
            for x, y in zip(a, b):  # the first from the prefill worker, the others from the decode worker
                assert x.logprob is not None and y.logprob is not None and abs(x.logprob - y.logprob) < 1e-5
                assert [i for i, _ in x.top_logprobs] == [i for i, _ in y.top_logprobs] and len(x.top_logprobs) == 2
        assert [c.seed for _, c in apart] == [7, 8, None]  # sampled with the seeds asked for; the last greedy

    asyncio.run(main())


def test_a_sampled_request_cut_mid_stream_makes_the_same_tokens_recomputed_on_another_decode_worker(
        model: Any) -> None:
    """The first decode worker's stream is cut after token 1: the router sends the prompt and
    those two tokens to the second, which picks token 2 on as the index in the completion says
    (its recompute's ``earlier`` tokens): the tokens and logprobs of an uncut run."""
    from test_router import _cutting  # pytest puts tests/unit on sys.path

    params = SamplingParams(temperature=1.0, top_p=0.95, seed=11, frequency_penalty=0.5, repetition_penalty=1.2)

    async def run(router: Router) -> list[Token]:
        tokens: list[Token] = []
        async for item in router.stream(PROMPTS[0], NEW, sampling=params, logprobs=1):
            if isinstance(item, Completion):
                assert item.ok and item.path == "local", item
                return tokens
            tokens.append(item)
        raise AssertionError("no completion")

    async def main() -> None:
        async with served({"decode": ("transformers", model)}) as (first, workers), \
                served({"decode": ("transformers", model)}) as (second, _):
            cut = HttpServer(_cutting(make_handler(workers["decode"]), lambda chunk: b'"index": 1' in chunk, True))
            port = await cut.start()
            try:
                async with Router([], [f"http://127.0.0.1:{port}", second["decode"]], on_failure="recompute") as router:
                    resumed = await run(router)
            finally:
                await cut.close()
            async with Router([], [second["decode"]], on_failure="recompute") as router:
                whole = await run(router)
        assert [t.token for t in resumed] == [t.token for t in whole] and len(whole) == NEW
        assert all(a.logprob is not None and b.logprob is not None and abs(a.logprob - b.logprob) < 1e-5
                   for a, b in zip(resumed, whole))

    asyncio.run(main())


def test_a_decode_worker_alone_serves_whole_requests(model: Any) -> None:
    """No prefill worker, policy recompute: the decode worker runs each request in its batch."""
    expected = hf.colocated(model, PROMPTS[:3], NEW, hf.batching_config(PAGE_SIZE, BLOCKS, MAX_BATCH_TOKENS))

    async def main() -> None:
        async with served({"decode": ("transformers", model)}) as (urls, _):
            async with Router([], [urls["decode"]], on_failure="recompute") as router:
                done = await asyncio.gather(*(router.generate(p, NEW) for p in PROMPTS[:3]))
        for completion, want in zip(done, expected):
            assert completion.ok and completion.path == "local", completion
            assert list(completion.tokens) == want

    asyncio.run(main())


def test_a_client_that_stops_early_ends_its_request_in_the_batch(model: Any) -> None:
    async def main() -> None:
        async with served({"prefill": ("transformers", model), "decode": ("transformers", model)}) as (urls, workers):
            engine = workers["decode"]._state.serving.engine  # type: ignore[attr-defined]
            ended: list[int] = []  # the lengths of the completions the batch ended itself
            finished = engine.finished

            def watched() -> dict[str, list[Any]]:
                out: dict[str, list[Any]] = finished()
                ended.extend(len(t) for t in out.values())
                return out
            engine.finished = watched
            async with Router([urls["prefill"]], [urls["decode"]]) as router:
                done = await router.generate(PROMPTS[2], 200, until=lambda t: t.index >= 1)
                assert done.ok and done.finish_reason == "stop" and len(done.tokens) == 2, done
                deadline = asyncio.get_running_loop().time() + 10
                while engine.batch.scheduler.active_requests or not engine.batch.idle():
                    assert asyncio.get_running_loop().time() < deadline, "the stopped request still runs"
                    await asyncio.sleep(0.01)
                again = await router.generate(PROMPTS[0], NEW)
                assert again.ok, again.error
            assert ended == [NEW], ended  # the stopped request was cancelled, never run to its 200 tokens

    asyncio.run(main())


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_a_partial_transfer_resumes_from_the_first_gap_or_fails_by_name(model: Any, policy: str) -> None:
    """One of the 38-token prompt's three blocks arrives: under recompute the decode worker adopts
    the request at token 16, prefills the rest again in its batch (its first token checked
    against the prefill worker's) and decodes as generate_batch does; under fail it says so."""
    prompt = PROMPTS[2]
    expected = hf.colocated(model, [prompt], NEW, hf.batching_config(PAGE_SIZE, BLOCKS, MAX_BATCH_TOKENS))[0]

    async def main() -> None:
        async with served({"prefill": ("transformers", model), "decode": ("transformers", model)}) as (urls, workers):
            workers["prefill"].backend.fail_after_rows = 1  # type: ignore[union-attr]  # push: the publisher writes
            async with Router([urls["prefill"]], [urls["decode"]], on_failure=policy) as router:
                done = await router.generate(prompt, NEW)
        assert done.transfer is not None and done.transfer.status == "failed"
        if policy == "fail":
            assert not done.ok and done.error is not None and "1 of 3 rows arrived" in done.error, done.error
            return
        assert done.ok, done.error
        assert done.path == "resumed" and done.recomputed_tokens == len(prompt) - PAGE_SIZE, done
        assert list(done.tokens) == expected

    asyncio.run(main())


def test_the_toy_models_seeded_weights_are_the_same_in_every_process_that_builds_them(model: Any) -> None:
    """``kvxfer serve --engine transformers`` without a GGUF seeds the toy model's shape: both
    workers and the oracle must build the same weights, and another seed other ones (and
    another KV scope, so that such peers refuse each other)."""
    import dataclasses

    from kvxfer.worker.hf_engine import seeded_model

    again = seeded_model(SHAPE, "cpu")
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values(), strict=True))
    other = seeded_model(dataclasses.replace(SHAPE, seed=1), "cpu")
    assert not torch.equal(model.model.embed_tokens.weight, other.model.embed_tokens.weight)
    assert SHAPE.scope() != dataclasses.replace(SHAPE, seed=1).scope()
