"""The worker's calls as typed values: what ``kvxfer.worker.core`` takes. It knows no HTTP:
``kvxfer.worker.http_bodies`` parses JSON bodies into these for the HTTP adapter."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvxfer.contract import Hint, Peer
from kvxfer.engine.sampling import GREEDY, Pick, SamplingParams

POLICIES = ("fail", "recompute")


@dataclass(frozen=True)
class PrefillCall:
    request: str
    prompt: list[int]
    sampling: SamplingParams = GREEDY  # picks the first token (index 0 of the completion)
    logprobs: int | None = None  # answer the token's logprob and this many likeliest tokens' too
    # Layer-wise streaming (--layerwise > 1): the decode end's hints D, one per layer group,
    # so that each group is published as soon as the forward has computed it.
    decode_hint: tuple[Hint, ...] | None = None


@dataclass(frozen=True)
class PublishCall:
    request: str
    decode_hint: tuple[Hint, ...]  # one, or one per rank pair (a TP group's)


@dataclass(frozen=True)
class ReserveCall:
    request: str
    prompt: list[int]
    max_new_tokens: int
    publisher: Peer  # the prefill worker that may use hint D


@dataclass(frozen=True)
class AbortCall:
    request: str
    rows_safe: bool = False


@dataclass(frozen=True)
class WithdrawCall:
    hint: tuple[Hint, ...]


@dataclass(frozen=True)
class GenerateCall:
    """With a reservation: ``prefill_hint`` and ``first_token`` (or neither: the prefill side
    failed before publishing). Without one: ``prompt`` and ``max_new_tokens``, decoded here;
    the prompt's last ``generated`` tokens are then the completion's first (a recompute that
    goes on from them), so penalties count them and the next token's draw is index
    ``generated``. ``sampling``: as the prefill worker's first token was picked."""

    request: str
    on_failure: str = "fail"
    timeout_s: float | None = None  # None: the worker's transfer timeout
    rows_safe: bool = False
    prefill_hint: tuple[Hint, ...] | None = None
    first_token: int | None = None
    prompt: list[int] | None = None
    max_new_tokens: int | None = None
    sampling: SamplingParams = GREEDY
    generated: int = 0
    logprobs: int | None = None  # each token event carries its logprob and this many likeliest tokens'


def pick_json(pick: Pick) -> dict[str, Any]:
    """A token's fields in an answer or a token event: its id, and, when the call asked for
    them, ``logprob`` and ``top_logprobs`` ([[token id, logprob], ...], likeliest first)."""
    if pick.logprob is None:
        return {"token": pick.token}
    return {"token": pick.token, "logprob": pick.logprob, "top_logprobs": [list(t) for t in pick.top]}
