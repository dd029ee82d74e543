"""The sampler (``kvxfer.engine.sampling``): parameters checked by name, greedy exactly the
argmax, each draw a function of (seed, index in the completion) alone, filters, biases and
penalties doing what OpenAI and vLLM say, and sampled generation split anywhere between a
prefill and a decode pool making the colocated oracle's tokens."""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np
import pytest
import torch

from kvxfer.engine import GROUP, LlamaModel, ModelConfig, colocated_generate, decode, tokens_needed, tp_generate
from kvxfer.engine.sampling import GREEDY, InvalidSampling, SamplingParams, pick_token

torch.set_num_threads(1)
CFG = ModelConfig(vocab_size=96, hidden=32, layers=2, heads=2, kv_heads=1, head_dim=16, intermediate=64,
                  block_tokens=4)
MODEL = LlamaModel(CFG)
PROMPT = [5, 17, 3, 60, 2, 9, 41]


@pytest.mark.parametrize(("fields", "field"), [
    ({"temperature": -0.1}, "temperature"), ({"temperature": float("nan")}, "temperature"),
    ({"temperature": "hot"}, "temperature"), ({"temperature": True}, "temperature"),
    ({"top_p": 0}, "top_p"), ({"top_p": 1.5}, "top_p"), ({"top_k": -2}, "top_k"), ({"top_k": 2.5}, "top_k"),
    ({"min_p": 1.1}, "min_p"), ({"seed": 2 ** 64}, "seed"), ({"seed": 1.5}, "seed"),
    ({"presence_penalty": 2.5}, "presence_penalty"), ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"), ({"logit_bias": {5: 101}}, "logit_bias"),
    ({"logit_bias": {-1: 1}}, "logit_bias"), ({"logit_bias": [1, 2]}, "logit_bias"),
])
def test_a_bad_parameter_is_refused_by_its_name(fields: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidSampling) as info:
        SamplingParams(**fields)
    assert info.value.field == field and str(info.value).startswith(f"'{field}'")
    assert isinstance(info.value, ValueError)


def test_json_round_trips_and_names_unknown_fields_and_bad_ids() -> None:
    params = SamplingParams(temperature=0.7, top_p=0.9, top_k=5, seed=3, logit_bias={4: -100, 2: 1.5})
    body = params.to_json()
    assert body["logit_bias"] == {"2": 1.5, "4": -100.0} and "min_p" not in body
    assert SamplingParams.from_json(body) == params and SamplingParams.from_json(None) is GREEDY
    assert GREEDY.to_json() == {} and SamplingParams(top_k=-1) == GREEDY
    with pytest.raises(InvalidSampling, match="'tempurature' is not a sampling parameter"):
        SamplingParams.from_json({"tempurature": 1})
    with pytest.raises(InvalidSampling, match="keys must be token ids, got 'x'"):
        SamplingParams.from_json({"logit_bias": {"x": 1}})
    with pytest.raises(InvalidSampling, match=r"token id 96 is outside the vocabulary \[0, 96\)"):
        SamplingParams.from_json({"logit_bias": {"96": 1}}, vocab_size=96)


def test_sampling_without_a_seed_is_refused_and_with_seed_gives_one() -> None:
    with pytest.raises(InvalidSampling, match="'seed' is needed to sample"):
        pick_token(np.zeros(4), SamplingParams(temperature=1.0))
    seeded = SamplingParams(temperature=1.0).with_seed()
    assert seeded.seed is not None and seeded.with_seed() == seeded
    assert GREEDY.with_seed() is GREEDY  # greedy needs none


def test_greedy_is_the_argmax_with_ties_to_the_lowest_id() -> None:
    rng = np.random.default_rng(0)
    for _ in range(50):
        logits = torch.from_numpy(rng.normal(size=96).astype(np.float32))
        assert pick_token(logits, GREEDY) == int(torch.argmax(logits))
    assert pick_token(np.array([1.0, 3.0, 3.0, 0.0]), GREEDY) == 1
    # Greedy with a (mild) bias: the argmax of the biased logits, still ties to the lowest id.
    assert pick_token(np.array([1.0, 3.0, 2.0]), SamplingParams(logit_bias={2: 1.0})) == 1


def test_a_draw_depends_on_seed_and_index_only() -> None:
    rng = np.random.default_rng(1)
    logits = rng.normal(size=96)
    params = SamplingParams(temperature=1.0, seed=11)
    firsts = [pick_token(logits, params, [1, 2], generated) for generated in ([], [], [])]
    assert len(set(firsts)) == 1  # the same (seed, index): the same token, whatever came before in this process
    by_index = [pick_token(logits, params, [], [0] * i) for i in range(40)]
    by_seed = [pick_token(logits, SamplingParams(temperature=1.0, seed=s)) for s in range(40)]
    assert len(set(by_index)) > 10 and len(set(by_seed)) > 10  # not one stream reused
    # The same index gives the same token whatever the earlier tokens were (no penalty asked).
    assert pick_token(logits, params, [], [7, 8, 9]) == pick_token(logits, params, [3], [1, 1, 1])


def test_top_k_one_and_tiny_top_p_are_greedy() -> None:
    rng = np.random.default_rng(2)
    for seed in range(30):
        logits = rng.normal(size=96)
        want = int(np.argmax(logits))
        assert pick_token(logits, SamplingParams(temperature=1.5, top_k=1, seed=seed)) == want
        assert pick_token(logits, SamplingParams(temperature=1.5, top_p=1e-9, seed=seed)) == want


def test_top_k_top_p_min_p_keep_only_the_likeliest() -> None:
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05]))
    seeds = range(400)

    def drawn(**fields: Any) -> set[int]:
        return {pick_token(logits, SamplingParams(temperature=1.0, seed=s, **fields)) for s in seeds}
    assert drawn() == {0, 1, 2, 3}
    assert drawn(top_k=2) == {0, 1}
    assert drawn(top_p=0.75) == {0, 1}     # 0.5 + 0.3 reaches 0.75: the fewest that do
    assert drawn(top_p=0.85) == {0, 1, 2}
    assert drawn(top_p=0.4) == {0}
    assert drawn(min_p=0.35) == {0, 1}     # 0.15 < 0.35 * 0.5


def test_logit_bias_of_minus_100_bans_and_plus_100_forces() -> None:
    logits = np.array([5.0, 0.0, 0.0, 9.0])
    for seed in range(100):
        banned = SamplingParams.from_json({"temperature": 2.0, "seed": seed, "logit_bias": {"3": -100, "0": -100}})
        assert pick_token(logits, banned) in (1, 2)
        assert pick_token(logits, SamplingParams(temperature=2.0, seed=seed, logit_bias={2: 100})) == 2
    assert pick_token(logits, SamplingParams(logit_bias={3: -100})) == 0  # greedy too
    assert pick_token(logits, SamplingParams(logit_bias={1: 100})) == 1
    with pytest.raises(InvalidSampling, match="bans every token"):
        pick_token(np.zeros(2), SamplingParams(logit_bias={0: -100, 1: -100}))


def test_penalties_change_what_they_should() -> None:
    logits = np.array([2.0, 1.9, -1.0, 0.5])
    # Frequency and presence: over the completion only, never the prompt.
    assert pick_token(logits, SamplingParams(frequency_penalty=0.2), prompt=[0, 0], generated=[]) == 0
    assert pick_token(logits, SamplingParams(frequency_penalty=0.2), generated=[3, 0]) == 1  # 2.0 - 0.2 < 1.9
    assert pick_token(logits, SamplingParams(frequency_penalty=0.06), generated=[0]) == 0     # 1.94 > 1.9
    assert pick_token(logits, SamplingParams(frequency_penalty=0.06), generated=[0, 0]) == 1  # counted twice
    assert pick_token(logits, SamplingParams(presence_penalty=0.06), generated=[0, 0]) == 0   # counted once
    assert pick_token(logits, SamplingParams(presence_penalty=-2.0), generated=[3]) == 3      # 0.5 + 2.0 > 2.0
    # Repetition (Hugging Face's): over prompt and completion; a positive logit divided, a negative multiplied.
    assert pick_token(logits, SamplingParams(repetition_penalty=1.1), prompt=[0]) == 1
    assert pick_token(logits, SamplingParams(repetition_penalty=1.1), generated=[0]) == 1
    assert pick_token(logits, SamplingParams(repetition_penalty=1.01), prompt=[0]) == 0
    assert pick_token(np.array([-0.5, -0.6]), SamplingParams(repetition_penalty=1.5), prompt=[0]) == 1


def test_frequencies_follow_the_softmax() -> None:
    probs = np.array([0.2, 0.3, 0.5])
    logits = np.log(probs) * 2.0  # temperature 2 undoes the factor
    n = 4000
    counts = Counter(pick_token(logits, SamplingParams(temperature=2.0, seed=s)) for s in range(n))
    got = np.array([counts[i] for i in range(3)]) / n
    assert np.abs(got - probs).max() < 0.03, got  # about 4 standard deviations at n = 4000


def test_sampled_generation_differs_from_greedy_and_repeats_by_seed() -> None:
    params = SamplingParams(temperature=1.0, seed=7)
    sampled = colocated_generate(MODEL, PROMPT, 12, sampling=params)
    assert sampled == colocated_generate(MODEL, PROMPT, 12, sampling=params)
    assert sampled != colocated_generate(MODEL, PROMPT, 12)
    assert sampled != colocated_generate(MODEL, PROMPT, 12, sampling=SamplingParams(temperature=1.0, seed=8))
    assert colocated_generate(MODEL, PROMPT, 12, sampling=SamplingParams(temperature=1.0, top_k=1, seed=3)) \
        == colocated_generate(MODEL, PROMPT, 12)
    assert tp_generate(MODEL, PROMPT, 12, tp=2, sampling=params) == sampled  # a replicated KV head
    with pytest.raises(InvalidSampling, match="outside the vocabulary"):
        colocated_generate(MODEL, PROMPT, 4, sampling=SamplingParams(logit_bias={96: 1}))


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.9, seed=5),
    SamplingParams(temperature=1.2, top_p=0.9, top_k=20, min_p=0.01, seed=2 ** 63 + 5, presence_penalty=0.5,
                   frequency_penalty=0.3, repetition_penalty=1.2, logit_bias={3: 2.0, 4: -100}),
])
def test_the_disaggregated_split_at_any_point_makes_the_oracles_tokens(params: SamplingParams) -> None:
    """A prefill pool picks the first token; a decode pool, holding the prompt's K/V copied
    over, picks the rest; a recompute after ``done`` tokens (the prompt plus those, as the
    router's ``generated``) goes on from there: every split gives the colocated completion."""
    n = 10
    want = colocated_generate(MODEL, PROMPT, n, sampling=params)
    prefill = CFG.make_pool(16, name="prefill")
    prefill.allocate("r", len(PROMPT))
    first = MODEL.next_token(prefill, "r", PROMPT, 0, params, PROMPT)
    decode_pool = CFG.make_pool(16, name="decode")
    decode_pool.allocate("filler", 5)  # other blocks than the prefill pool's, as a transfer meets them
    decode_pool.allocate("r", tokens_needed(len(PROMPT), n))
    blocks = -(-len(PROMPT) // CFG.block_tokens)
    src = torch.from_numpy(prefill.block_table("r", GROUP)[:blocks].copy())
    dst = torch.from_numpy(decode_pool.block_table("r", GROUP)[:blocks].copy())
    decode_pool.storage(GROUP)[dst] = prefill.storage(GROUP)[src]
    assert [first, *decode(MODEL, decode_pool, "r", first, len(PROMPT), n, params, PROMPT)] == want
    for done in range(1, n):  # a recompute from the prompt plus the first ``done`` tokens
        context = PROMPT + want[:done]
        pool = CFG.make_pool(16, name=f"local{done}")
        pool.allocate("r", tokens_needed(len(context), n - done))
        resumed = MODEL.next_token(pool, "r", context, 0, params, PROMPT, want[:done])
        rest = list(decode(MODEL, pool, "r", resumed, len(context), n - done, params, PROMPT, want[:done]))
        assert want[:done] + [resumed, *rest] == want, done
