"""What the router hands its caller: streamed tokens, the transfer's figures, and the
completion that ends every request (with its error, when it failed)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Token:
    index: int
    token: int
    at_s: float
    logprob: float | None = None
    """Asked for (``Router.stream(logprobs=k)``): log-softmax of the model's raw logits at the
    token, before bias, penalties and temperature; None otherwise."""
    top_logprobs: tuple[tuple[int, float], ...] = ()  # the k likeliest (token id, logprob), likeliest first


@dataclass(frozen=True)
class TransferFigures:
    status: str
    rows: int
    rows_delivered: int
    bytes: int
    seconds: float
    reason: str = ""

    @classmethod
    def from_event(cls, event: dict[str, Any]) -> TransferFigures:
        return cls(str(event["status"]), int(event["rows"]), int(event["rows_delivered"]), int(event["bytes"]),
                   float(event["seconds"]), str(event.get("reason", "")))


@dataclass(frozen=True)
class Completion:
    request: str
    prompt_tokens: int
    tokens: tuple[int, ...]
    ttft_s: float | None
    total_s: float
    prefill: str | None
    decode: str | None
    transfer: TransferFigures | None
    recomputed_tokens: int = 0
    path: str = "disaggregated"  # "disaggregated" | "resumed" (partial transfer) | "local" (decode prefilled)
    error: str | None = None
    events: tuple[str, ...] = ()  # what went wrong on the way, even when recovered
    finish_reason: str = "length"
    """Why it ended: "length" (max_new_tokens streamed), "stop" (a stop id streamed, or the
    caller closed the stream on a stop of its own), "error" (``error`` says what), or
    "unavailable" (no usable prefill/decode pair: no worker ran anything)."""
    seed: int | None = None
    """The seed the tokens were sampled with (the caller's, or the router's random one, with
    which the same request makes the same tokens again); None when decoding was greedy."""

    @property
    def ok(self) -> bool:
        return self.error is None
