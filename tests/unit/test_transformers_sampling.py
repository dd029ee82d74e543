"""kvxfer's sampler inside transformers' continuous batch (``TransformersEngine``, a tiny random
Llama): a seeded request makes the same tokens colocated (``generate``) and disaggregated (the
prefill end's first token, the decode end's later ones, KV moved over loopback); requests with
different parameters share a step and each makes its solo run's tokens, greedy ones
``generate_batch``'s; the tokens are those kvxfer's sampler picks from the model's own logits
(as the reference engine keys it) and their logprobs the log-softmax of those logits;
what the sampler would refuse mid-step is refused by name before anything is queued."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from kvxfer.adapters.transformers import RequestSampling, TransformersEngine, colocated_sampled
from kvxfer.adapters.transformers import _internals as hf
from kvxfer.backends.loopback import LoopbackBackend, LoopbackFabric
from kvxfer.contract import TransferMode
from kvxfer.engine.sampling import InvalidSampling, Pick, SamplingParams, pick_token
from kvxfer.testing.transformers_moves import move

torch.set_num_threads(1)
PAGE = 4
NEW = 8
PROMPTS = [[5, 9, 17, 3, 8, 44, 21, 7, 60, 2, 13], [7, 7, 1], [90, 3, 55, 12, 8, 8, 31, 6]]
SAMPLED = [SamplingParams(temperature=0.8, seed=7),
           SamplingParams(temperature=1.0, top_p=0.9, top_k=40, seed=2 ** 63 + 5, presence_penalty=0.5),
           SamplingParams(temperature=0.7, min_p=0.05, seed=-3, frequency_penalty=0.8, repetition_penalty=1.3,
                          logit_bias=((11, 2.0), (12, -100.0)))]
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def model(tiny_hf_llama: Any) -> Any:
    return tiny_hf_llama


@pytest.fixture(scope="module")
def greedy(model: Any) -> list[list[int]]:
    """transformers' own ``generate_batch`` over PROMPTS (about 1 s: computed once)."""
    return hf.colocated(model, PROMPTS, NEW, hf.batching_config(PAGE, 64, 64))


@pytest.fixture
def engines(model: Any) -> Iterator[Any]:
    made: list[TransformersEngine] = []

    def make() -> TransformersEngine:
        engine = TransformersEngine(model, page_size=PAGE, num_blocks=64, max_batch_tokens=64, name=f"tf{len(made)}")
        made.append(engine)
        return engine

    yield make
    for engine in made:
        engine.lender.shutdown(force=True)
        engine.batch.close()


def colocated(engine: TransformersEngine, requests: dict[str, tuple[list[int], RequestSampling]]
              ) -> dict[str, list[Pick]]:
    """Every request generated in ``engine``'s batch at once (they share its steps)."""
    for name, (prompt, sampling) in requests.items():
        engine.generate(name, prompt, NEW, sampling)
    got: dict[str, list[Pick]] = {}
    while len(got) < len(requests):
        engine.step()
        got.update(engine.finished())
    return got


def disaggregated(prefill: TransformersEngine, decode: TransformersEngine,
                      requests: dict[str, tuple[list[int], RequestSampling]]) -> dict[str, list[Pick]]:
    for name, (prompt, sampling) in requests.items():
        prefill.prefill(name, prompt, sampling)
    while len(prefill.prefilled) < len(requests):
        prefill.step()
    firsts = {name: prefill.prefilled[name].pick for name in requests}
    fabric = LoopbackFabric()
    src, dst = LoopbackBackend(fabric, "p", TransferMode.PUSH), LoopbackBackend(fabric, "d", TransferMode.PUSH)
    src.register(prefill.regions)
    dst.register(decode.regions)
    try:
        for name, (prompt, sampling) in requests.items():
            reservation = decode.reserve(name, prompt)
            assert reservation is not None and reservation.lease is not None and reservation.held == 0
            move((src, dst), prefill.lend_prefill(name), reservation.lease)
            prefill.finish_prefill(name)
            assert decode.adopt(name, firsts[name].token, NEW, sampling) == len(prompt)  # nothing recomputed
    finally:
        assert not (src.shutdown() | dst.shutdown())
    got: dict[str, list[Pick]] = {}
    while len(got) < len(requests):
        decode.step()
        got.update(decode.finished())
    return {name: [firsts[name], *picks[1:]] for name, picks in got.items()}


def tokens(picks: list[Pick]) -> list[int]:
    return [p.token for p in picks]


def test_a_seeded_request_makes_the_same_tokens_colocated_and_disaggregated(engines: Any, model: Any,
                                                                             greedy: list[list[int]]) -> None:
    requests = {f"r{i}": (p, RequestSampling(s)) for i, (p, s) in enumerate(zip(PROMPTS, SAMPLED))}
    here = colocated(engines(), requests)
    apart = disaggregated(engines(), engines(), requests)
    assert {r: tokens(p) for r, p in apart.items()} == {r: tokens(p) for r, p in here.items()}
    oracle = colocated_sampled(model, PROMPTS, NEW, [s for _, s in requests.values()], page_size=PAGE, num_blocks=64,
                               max_batch_tokens=64)  # kvxfer pair's oracle for sampled requests
    assert oracle == [tokens(here[r]) for r in requests]
    assert all(tokens(here[f"r{i}"]) != greedy[i] for i in range(3))  # it did sample
    assert all(len(here[r]) == NEW for r in requests)  # the random model never says end-of-sequence here
    assert all(12 not in tokens(here[r]) for r in requests if r == "r2")  # its bias bans 12


def test_requests_with_different_parameters_share_a_step_and_each_makes_its_solo_tokens(
        engines: Any, greedy: list[list[int]]) -> None:
    mixed = {"greedy": (PROMPTS[0], RequestSampling()), "a": (PROMPTS[0], RequestSampling(SAMPLED[0])),
             "b": (PROMPTS[1], RequestSampling(SAMPLED[1], logprobs=2)),
             "penalised": (PROMPTS[2], RequestSampling(SamplingParams(repetition_penalty=1.5)))}
    engine = engines()
    steps: list[list[str]] = []
    picker = engine.batch.picker
    assert picker is not None

    def watched(requests: list[str], logits: torch.Tensor) -> torch.Tensor | None:
        steps.append(list(requests))
        return picker(requests, logits)
    engine.batch.picker = watched
    together = colocated(engine, mixed)
    assert any(len(s) == len(mixed) for s in steps), steps  # all four in one step
    for name, request in mixed.items():
        alone = colocated(engines(), {name: request})
        assert tokens(together[name]) == tokens(alone[name]), name
    assert tokens(together["greedy"]) == greedy[0]  # transformers' own argmax, generate_batch's tokens
    assert tokens(together["a"]) != greedy[0]


def model_logits(model: Any, prompt: list[int], made: list[int]) -> torch.Tensor:
    """The model's logits before each token of ``made``: one plain forward of transformers over
    the prompt and the completion (no paged cache, no batch)."""
    with torch.no_grad():
        return model(torch.tensor([prompt + made[:-1]])).logits[0, len(prompt) - 1:]


@pytest.mark.parametrize("where", ["colocated", "disaggregated"])
def test_tokens_and_logprobs_are_the_samplers_over_the_models_logits(engines: Any, model: Any, where: str) -> None:
    requests = {"s": (PROMPTS[0], RequestSampling(SAMPLED[2], logprobs=3)),
                "g": (PROMPTS[1], RequestSampling(logprobs=0))}
    got = colocated(engines(), requests) if where == "colocated" else disaggregated(engines(), engines(), requests)
    plain = colocated(engines(), {r: (p, RequestSampling(s.params)) for r, (p, s) in requests.items()})
    for name, (prompt, sampling) in requests.items():
        picks = got[name]
        assert tokens(picks) == tokens(plain[name])  # asking for logprobs changes no token
        assert all(p.logprob is None for p in plain[name])
        logits = model_logits(model, prompt, tokens(picks))
        # The reference engine's sampler, keyed by the seed and each token's index in the completion.
        assert tokens(picks) == [pick_token(row, sampling.params, prompt, tokens(picks)[:i])
                                 for i, row in enumerate(logits)]
        for pick, row in zip(picks, torch.log_softmax(logits.double(), dim=-1), strict=True):
            assert pick.logprob is not None and abs(pick.logprob - float(row[pick.token])) < TOLERANCE, (pick, row)
            values, ids = torch.topk(row, sampling.logprobs or 0)
            assert [t for t, _ in pick.top] == ids.tolist()
            assert all(abs(lp - float(v)) < TOLERANCE for (_, lp), v in zip(pick.top, values, strict=True))


def test_what_the_sampler_would_refuse_mid_step_is_refused_by_name_before_anything_is_queued(engines: Any) -> None:
    engine = engines()
    with pytest.raises(InvalidSampling, match="'seed' is needed to sample"):
        RequestSampling(SamplingParams(temperature=0.5))
    with pytest.raises(InvalidSampling, match="'logprobs' must be an int in \\[0, 20\\]"):
        RequestSampling(logprobs=21)
    cases = [(SamplingParams(logit_bias=((128, 1.0),)), "'logit_bias' token id 128 is outside the vocabulary"),
             (SamplingParams(logit_bias=tuple((t, -100.0) for t in range(128))), "'logit_bias' bans every token")]
    for params, words in cases:
        for submit in (lambda s: engine.generate("x", PROMPTS[1], NEW, s), lambda s: engine.prefill("x", PROMPTS[1], s)):
            with pytest.raises(InvalidSampling, match=words):
                submit(RequestSampling(params))
            assert not engine.known("x") and engine.idle()
    assert colocated(engine, {"x": (PROMPTS[1], RequestSampling(SAMPLED[0]))})["x"]  # the engine serves on
