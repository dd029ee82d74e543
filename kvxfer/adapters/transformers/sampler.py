"""kvxfer's sampler picking the tokens of transformers' continuous batch, request by request.

A request in the batch may carry its own ``SamplingParams`` and logprobs (``RequestSampling``).
Each step, the rows of the logits that belong to such requests are picked by
``kvxfer.engine.sampling`` (``pick_token``, ``with_logprobs``), the one sampler the reference
engine runs, given the request's prompt and its completion so far; requests with other
parameters, or none, share the step. A token thus depends on its seed, its index in the
completion and the logits alone: the prefill end's first token (index 0), the decode end's later
ones and a colocated run of the same request make the same completion. Rows of requests that ask
for neither sampling nor logprobs keep transformers' own argmax, so greedy stays exactly
``generate_batch``'s.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kvxfer.engine.sampling import (
    BAN,
    FORCE,
    GREEDY,
    MAX_LOGPROBS,
    InvalidSampling,
    Pick,
    SamplingParams,
    pick_token,
    with_logprobs,
)


@dataclass(frozen=True)
class RequestSampling:
    """How a request's tokens are picked: ``params``; ``logprobs``: each token's logprob and that
    many likeliest tokens' (0 to 20) go with it; ``earlier``: the prompt's last tokens that are
    the completion's (a request recomputed after it made them), so its next token's index in the
    completion is ``earlier`` plus what this batch made. Checked on construction: sampling needs
    a seed (the token must not depend on the process that draws it)."""

    params: SamplingParams = GREEDY
    logprobs: int | None = None
    earlier: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.params, SamplingParams):
            raise InvalidSampling("sampling", f"must be SamplingParams, got {type(self.params).__name__}")
        k = self.logprobs
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= MAX_LOGPROBS):
            raise InvalidSampling("logprobs", f"must be an int in [0, {MAX_LOGPROBS}], got {str(k)[:40]}")
        if isinstance(self.earlier, bool) or not isinstance(self.earlier, int) or self.earlier < 0:
            raise InvalidSampling("earlier", f"must be a count of tokens, got {str(self.earlier)[:40]}")
        if not self.params.greedy and self.params.seed is None:
            raise InvalidSampling("seed", "is needed to sample (temperature > 0): the prefill and decode ends draw "
                                          "from one stream")

    @property
    def plain(self) -> bool:
        """transformers' own argmax picks it: greedy, no penalty, no bias, no logprobs."""
        return self.params.plain and self.logprobs is None


PLAIN = RequestSampling()

Completion = Callable[[str], tuple[list[int], list[int]]]
"""A request's (tokens before its completion, completion so far) as the batch holds it."""


class Sampler:
    """The picker of one batch (``_internals.Batch.picker``): the rows of requests ``add``-ed
    with sampling or logprobs go through kvxfer's sampler, the others through argmax."""

    def __init__(self, completion: Completion, vocab_size: int) -> None:
        self._completion = completion
        self._vocab = vocab_size
        self._requests: dict[str, RequestSampling] = {}
        self._picks: dict[str, dict[int, Pick]] = {}  # logprobs asked: completion index -> its pick

    def add(self, request: str, sampling: RequestSampling) -> None:
        """Pick ``request``'s tokens as ``sampling`` says; InvalidSampling, and nothing kept, for
        what the sampler would refuse in the middle of a step (a bias outside the vocabulary or
        banning every token)."""
        bias = sampling.params.logit_bias
        sampling.params.check_vocab(self._vocab)
        banned = sum(1 for _, b in bias if b <= BAN)
        if banned >= self._vocab and not any(b >= FORCE for _, b in bias):
            raise InvalidSampling("logit_bias", "bans every token")
        if sampling.plain:
            self.forget(request)
            return
        self._requests[request] = sampling
        if sampling.logprobs is not None:
            self._picks[request] = {}

    def forget(self, request: str) -> None:
        self._requests.pop(request, None)
        self._picks.pop(request, None)

    def picks(self, request: str, tokens: Sequence[int], start: int = 0) -> list[Pick]:
        """``tokens[start:]`` (the completion the batch made) as picks, with their logprobs where
        they were asked for and picked here."""
        got = self._picks.get(request, {})
        return [got.get(i) or Pick(int(t)) for i, t in enumerate(tokens[start:], start)]

    def __call__(self, requests: list[str], logits: torch.Tensor) -> torch.Tensor | None:
        """The step's tokens, one per row of ``logits`` (float32, row i for ``requests[i]``);
        None when no request in it is ours (transformers picks, as it does alone)."""
        ours = [i for i, r in enumerate(requests) if r in self._requests]
        if not ours:
            return None
        tokens = torch.argmax(logits, dim=-1)
        rows = logits[ours].cpu()  # one copy off the device for every row picked here
        picked = []
        for row, i in zip(rows, ours):
            request = requests[i]
            sampling = self._requests[request]
            prompt, made = self._completion(request)
            cut = len(prompt) - sampling.earlier
            params = sampling.params
            token = int(torch.argmax(row)) if params.plain else pick_token(row, params, prompt[:cut], prompt[cut:] + made)
            if sampling.logprobs is not None:
                self._picks[request][len(made)] = with_logprobs(row, token, sampling.logprobs)
            picked.append(token)
        tokens[torch.tensor(ours, device=tokens.device)] = torch.tensor(picked, dtype=tokens.dtype, device=tokens.device)
        return tokens
