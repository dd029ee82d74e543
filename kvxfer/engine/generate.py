"""Generation over a pool, the colocated oracle, and synthetic prompts.

A completion of ``max_new_tokens`` tokens is the token that prefill's last logits pick,
then ``max_new_tokens - 1`` decode steps, each feeding the previous token at the next
position. A disaggregated run splits exactly there: the prefill worker computes the first
token, the decode worker the rest, reading the K/V that the transfer delivered. Tokens are
picked greedily, or sampled as ``sampling`` says (``kvxfer.engine.sampling``): a sampled
token depends on the seed and its index in the completion only, so the split changes none.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np

from kvxfer.engine.model import LlamaModel
from kvxfer.engine.sampling import GREEDY, SamplingParams
from kvxfer.engine.tp import ShardedKVCache
from kvxfer.pool import Layout, PagedKVPool


def tokens_needed(prompt_len: int, max_new_tokens: int) -> int:
    """Pool room a request needs on the decode side: the prompt plus every fed-back token."""
    return prompt_len + max(max_new_tokens - 1, 0)


def decode(model: LlamaModel, pool: PagedKVPool | ShardedKVCache, request: str, first_token: int, position: int,
           max_new_tokens: int, sampling: SamplingParams = GREEDY, prompt: Sequence[int] = (),
           earlier: Sequence[int] = ()) -> Iterator[int]:
    """Yield ``max_new_tokens - 1`` tokens after ``first_token``, which sits at ``position``.

    K/V for ``[0, position)`` must be in the pool (or every rank's pool of a TP group), and
    room for ``position + max_new_tokens - 1`` tokens allocated. ``sampling`` other than
    greedy needs the request's ``prompt`` and ``earlier``, the completion's tokens before
    ``first_token`` (none, unless a recompute goes on from some): penalties count them, and
    a token's draw is keyed by its index in the completion.
    """
    generated = [*earlier, first_token]
    token = first_token
    for step in range(max_new_tokens - 1):
        token = model.next_token(pool, request, [token], position + step, sampling, prompt, generated)
        generated.append(token)
        yield token


def colocated_generate(model: LlamaModel, prompt: Sequence[int], max_new_tokens: int,
                       pool: PagedKVPool | None = None, request: str = "oracle",
                       sampling: SamplingParams = GREEDY) -> list[int]:
    """The oracle: prefill and decode in one process, one pool. Returns the completion."""
    _check_request("colocated_generate", prompt, max_new_tokens, sampling, model)
    cfg = model.config
    if pool is None:
        need = tokens_needed(len(prompt), max_new_tokens)
        pool = cfg.make_pool(-(-need // cfg.block_tokens), device=str(model.device))
    return _generate(model, pool, prompt, max_new_tokens, request, sampling)


def tp_generate(model: LlamaModel, prompt: Sequence[int], max_new_tokens: int, tp: int, *,
                block_tokens: int | None = None, layout: Layout = Layout.BLOCK_MAJOR,
                cache: ShardedKVCache | None = None, request: str = "tp",
                sampling: SamplingParams = GREEDY) -> list[int]:
    """Prefill and decode on a TP group of ``tp`` ranks sharded by KV heads (a new
    ``ShardedKVCache`` with ``block_tokens`` and ``layout``, or ``cache``). Returns the
    completion, which is the colocated oracle's token for token."""
    _check_request("tp_generate", prompt, max_new_tokens, sampling, model)
    cfg = model.config
    if cache is None:
        need = tokens_needed(len(prompt), max_new_tokens)
        bt = cfg.block_tokens if block_tokens is None else block_tokens
        cache = ShardedKVCache.create(cfg, tp, -(-need // bt), block_tokens=bt, layout=layout,
                                      device=model.device, name=request)
    elif cache.tp != tp:
        raise ValueError(f"tp_generate: tp={tp} but the cache is a group of {cache.tp}")
    return _generate(model, cache, prompt, max_new_tokens, request, sampling)


def _check_request(what: str, prompt: Sequence[int], max_new_tokens: int, sampling: SamplingParams,
                   model: LlamaModel) -> None:
    if not prompt:
        raise ValueError(f"{what} needs a non-empty prompt")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    if not isinstance(sampling, SamplingParams):
        raise TypeError(f"{what}: sampling must be a SamplingParams, got {type(sampling).__name__}")
    sampling.check_vocab(model.config.vocab_size)


def _generate(model: LlamaModel, kv: PagedKVPool | ShardedKVCache, prompt: Sequence[int], max_new_tokens: int,
              request: str, sampling: SamplingParams) -> list[int]:
    kv.allocate(request, tokens_needed(len(prompt), max_new_tokens))
    try:
        first = model.next_token(kv, request, list(prompt), 0, sampling, prompt)
        return [first, *decode(model, kv, request, first, len(prompt), max_new_tokens, sampling, prompt)]
    finally:
        kv.free(request)


def synthetic_prompts(count: int, min_len: int, max_len: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    """``count`` prompts of mixed lengths in ``[min_len, max_len]``, the same for a given seed.

    Lengths are spread over the whole range (shortest and longest always included when
    ``count >= 2``) so that block boundaries, partial last blocks and one-block prompts all occur.
    """
    if not 1 <= min_len <= max_len:
        raise ValueError(f"prompt lengths need 1 <= min_len <= max_len, got {min_len}..{max_len}")
    if count < 0:
        raise ValueError(f"count must be non-negative, got {count}")
    rng = np.random.default_rng(seed)
    lengths = np.linspace(min_len, max_len, num=max(count, 1)).round().astype(np.int64)[:count]
    rng.shuffle(lengths)
    return [rng.integers(0, vocab_size, size=int(n)).tolist() for n in lengths]
