"""What a request must be for the router to take it: the same checks for a caller in this
process (``Router.stream`` raises ``InvalidRequest``) and over HTTP (a 400 that says the same)."""

from __future__ import annotations

import numbers
from collections.abc import Collection, Sequence

from kvxfer.contract import KvxferError
from kvxfer.engine.sampling import MAX_LOGPROBS
from kvxfer.router.workers import ModelLimits


class InvalidRequest(KvxferError, ValueError):
    """A request the router refuses before any worker sees it; the message names the field."""


class MixedEngines(InvalidRequest):
    """The router's workers run different engines (``kvxfer serve --engine``): no request is
    served until they agree; the message names both engines and their workers."""


def check_shape(prompt: object, max_new_tokens: object, stop_ids: Collection[object] = ()) -> None:
    """A prompt of at least one int token id, a positive int max_new_tokens, int stop ids."""
    if isinstance(prompt, (str, bytes)) or not isinstance(prompt, Sequence) or not prompt:
        raise InvalidRequest("'prompt' must be a non-empty list of token ids")
    if not all(_is_int(t) for t in prompt):
        raise InvalidRequest("'prompt' must be a non-empty list of token ids (ints, not bools or floats)")
    if not _is_int(max_new_tokens) or max_new_tokens < 1:  # type: ignore[operator]
        raise InvalidRequest(f"'max_new_tokens' must be a positive integer, got {max_new_tokens!r}")
    if not all(_is_int(t) for t in stop_ids):
        raise InvalidRequest("'stop_ids' must be token ids (ints)")


def check_limits(prompt: Sequence[int], max_new_tokens: int, limits: ModelLimits) -> None:
    """Ids inside the workers' vocabulary; the prompt plus every fed-back token inside their positions."""
    vocab = limits.vocab_size
    if min(prompt) < 0 or max(prompt) >= vocab:
        raise InvalidRequest(f"'prompt' token ids must lie in [0, {vocab}) for the workers' model "
                             f"{limits.name!r}")
    need = len(prompt) + max_new_tokens - 1
    if need > limits.max_positions:
        raise InvalidRequest(f"prompt ({len(prompt)} tokens) plus max_new_tokens ({max_new_tokens}) needs {need} "
                             f"positions, over the workers' model's {limits.max_positions}")


def check_logprobs(logprobs: object) -> None:
    """None (no logprobs), or how many likeliest tokens' logprobs go with each token's own."""
    if logprobs is not None and (not _is_int(logprobs) or not 0 <= logprobs <= MAX_LOGPROBS):  # type: ignore[operator]
        raise InvalidRequest(f"'logprobs' must be None or an int in [0, {MAX_LOGPROBS}], got {logprobs!r}")


def _is_int(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)  # numpy ints too
