"""JSON bodies of the worker's HTTP API into typed calls (``kvxfer.worker.calls``): what is
malformed is refused here with BadRequest (400), before the worker sees it."""

from __future__ import annotations

import base64
from typing import Any

from kvxfer import wire
from kvxfer.contract import Hint, Peer
from kvxfer.engine import InvalidSampling, ModelConfig, SamplingParams
from kvxfer.engine.sampling import MAX_LOGPROBS
from kvxfer.serving.http import BadRequest
from kvxfer.worker.calls import (
    POLICIES,
    AbortCall,
    GenerateCall,
    PrefillCall,
    PublishCall,
    ReserveCall,
    WithdrawCall,
)


def prefill_call(body: dict[str, Any], model: ModelConfig) -> PrefillCall:
    early = hint(body, "hint") if body.get("hint") is not None else None  # layer-wise streaming
    return PrefillCall(request_id(body), prompt(body, model), sampling(body, model), logprobs(body), early)


def publish_call(body: dict[str, Any]) -> PublishCall:
    return PublishCall(request_id(body), hint(body, "hint"))


def reserve_call(body: dict[str, Any], model: ModelConfig) -> ReserveCall:
    return ReserveCall(request_id(body), prompt(body, model), positive(body, "max_new_tokens"), peer(body, "publisher"))


def abort_call(body: dict[str, Any]) -> AbortCall:
    return AbortCall(request_id(body), flag(body, "rows_safe"))


def withdraw_call(body: dict[str, Any]) -> WithdrawCall:
    return WithdrawCall(hint(body, "hint"))


def generate_call(body: dict[str, Any], model: ModelConfig) -> GenerateCall:
    rid = request_id(body)
    policy = body.get("on_failure", "fail")
    if policy not in POLICIES:
        raise BadRequest(f"on_failure must be one of {POLICIES}, got {policy!r}")
    timeout = seconds(body, "timeout_s") if "timeout_s" in body else None
    rows_safe = flag(body, "rows_safe")
    prefill_hint = hint(body, "hint") if body.get("hint") else None
    first = body.get("first_token")
    if first is not None and (not isinstance(first, int) or isinstance(first, bool)
                              or not 0 <= first < model.vocab_size):
        raise BadRequest(f"'first_token' must be a token id in [0, {model.vocab_size})")
    if prefill_hint is not None and first is None:
        raise BadRequest("generate with a hint needs first_token (the prefill worker's token id)")
    ids = prompt(body, model) if "prompt" in body else None
    max_new = positive(body, "max_new_tokens") if "max_new_tokens" in body else None
    generated = body.get("generated", 0)
    if not isinstance(generated, int) or isinstance(generated, bool) or generated < 0 \
            or (generated and (ids is None or generated >= len(ids))):
        raise BadRequest("'generated' must be a count of the prompt's last tokens that the completion made, "
                         "fewer than the prompt's (and only with a prompt)")
    return GenerateCall(rid, policy, timeout, rows_safe, prefill_hint, first, ids, max_new, sampling(body, model),
                        generated, logprobs(body))


def request_id(body: dict[str, Any]) -> str:
    rid = body.get("request")
    if not isinstance(rid, str) or not rid or len(rid) > 200 or "#" in rid:
        raise BadRequest("'request' must be a non-empty string of at most 200 characters without '#'")
    return rid


def prompt(body: dict[str, Any], model: ModelConfig) -> list[int]:
    ids = body.get("prompt")
    if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise BadRequest("'prompt' must be a non-empty list of token ids")
    if min(ids) < 0 or max(ids) >= model.vocab_size:
        raise BadRequest(f"'prompt' token ids must lie in [0, {model.vocab_size})")
    if len(ids) > model.max_positions:
        raise BadRequest(f"'prompt' has {len(ids)} tokens, over max_positions {model.max_positions}")
    return ids


def sampling(body: dict[str, Any], model: ModelConfig) -> SamplingParams:
    """``body["sampling"]``, SamplingParams' JSON (absent: greedy). Sampling needs its seed
    here: the prefill and the decode worker must draw from one stream."""
    try:
        params = SamplingParams.from_json(body.get("sampling"), model.vocab_size)
    except InvalidSampling as exc:
        raise BadRequest(f"'sampling': {exc}") from None
    if not params.greedy and params.seed is None:
        raise BadRequest("'sampling': 'seed' is required with a temperature above 0 (the router picks one for a "
                         "request without): the prefill and decode workers draw from one stream")
    return params


def logprobs(body: dict[str, Any]) -> int | None:
    """``body["logprobs"]``: absent (none), or how many likeliest tokens' logprobs go with each
    token's own (0 to ``MAX_LOGPROBS``)."""
    value = body.get("logprobs")
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_LOGPROBS:
        raise BadRequest(f"'logprobs' must be an int in [0, {MAX_LOGPROBS}] (the likeliest tokens to name), "
                         f"got {str(value)[:40]}")
    return value


def positive(body: dict[str, Any], key: str) -> int:
    value = body.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise BadRequest(f"'{key}' must be a positive integer")
    return value


def flag(body: dict[str, Any], key: str) -> bool:
    """A JSON boolean (absent: false). A string such as "false" is refused, not read as true:
    ``rows_safe`` true lets rows a peer may still write into be reused."""
    value = body.get(key, False)
    if not isinstance(value, bool):
        raise BadRequest(f"'{key}' must be true or false, got {value!r}")
    return value


def peer(body: dict[str, Any], key: str) -> Peer:
    value = body.get(key)
    agent = value.get("agent") if isinstance(value, dict) else None
    run = value.get("run") if isinstance(value, dict) else None
    if not isinstance(agent, str) or not agent or not isinstance(run, str) or not run \
            or len(agent) > 1024 or len(run) > 256:
        raise BadRequest(f"'{key}' must be the prefill worker's {{\"agent\": str, \"run\": str}}, as its /health "
                         "and /prefill answer: hint D is bound to the one worker that publishes with it")
    return Peer(agent, run)


def seconds(body: dict[str, Any], key: str) -> float:
    value = body.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 1e9:
        # Bounded, not just finite: an int past a float's range passes "< inf" and float() raises.
        raise BadRequest(f"'{key}' must be a positive number of seconds below 1e9, got {str(value)[:40]}")
    return float(value)


def hint(body: dict[str, Any], key: str) -> tuple[Hint, ...]:
    """The hint (or, from a TP group, the hints) in ``body[key]``."""
    raw = body.get(key)
    if not isinstance(raw, str):
        raise BadRequest(f"'{key}' must be base64 of a msgpack hint")
    try:
        data = base64.b64decode(raw, validate=True)
    except ValueError:
        raise BadRequest(f"'{key}' is not valid base64") from None
    return wire.decode_hints(data)  # WireError names what is wrong; the app answers 400
