"""Sampling the next token: ``SamplingParams`` (checked, frozen) and ``pick_token``.

    from kvxfer.engine.sampling import GREEDY, SamplingParams, pick_token
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=7)
    token = pick_token(logits, params, prompt, generated)   # generated: the completion so far

Greedy (temperature 0, the default) is the argmax of the logits, ties to the lowest id, as
``torch.argmax``; with neither penalty nor bias it is exactly the argmax of the model's
logits. Otherwise the logits go, in float64 on the CPU, through (vLLM's order):

1. ``logit_bias``: added per token id; -100 bans a token and +100 restricts the choice to the
   tokens biased +100 (OpenAI: "a ban or exclusive selection"), exactly, whatever the logits;
2. penalties: ``repetition_penalty`` (Hugging Face's: a logit of a token seen in the prompt
   or the completion is divided by it when positive, multiplied when not), then
   ``frequency_penalty`` times the token's count in the completion and ``presence_penalty``
   once for a token in it are subtracted (OpenAI's and vLLM's);
3. temperature 0: the argmax here; else divided by the temperature, then ``min_p`` (drop
   what is less likely than ``min_p`` times the likeliest), ``top_k`` (the k likeliest, ties
   to the lower id) and ``top_p`` (the fewest likeliest whose probability reaches ``top_p``);
4. the draw: Gumbel-max, ``argmax(logits + g)`` with ``g = -log(-log(u))`` over what is kept,
   the uniforms ``u`` one per vocabulary entry from numpy's counter-based ``Philox`` keyed by
   ``seed``, its counter's second word the token's index in the completion.

So a token depends on the seed, its index in the completion and the logits alone: not on
which process draws it, nor on what that process drew before. The prefill worker's first
token (index 0) and the decode worker's later ones come from one stream, and the colocated
oracle, given the same parameters, makes the very same completion; a recompute on another
worker makes the same tokens again. Sampling needs a seed (``InvalidSampling`` otherwise):
the router gives a request without one a random one (``with_seed``).
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np

from kvxfer.contract import KvxferError

SEED_RANGE = (-(2 ** 63), 2 ** 64)
MAX_LOGPROBS = 20
"""The most alternatives a token's logprobs name (OpenAI's chat ``top_logprobs`` bound)."""
"""Seeds taken: any int64 or uint64 (OpenAI's is an int64); the Philox key is the seed mod 2**64."""
BAN, FORCE = -100.0, 100.0
FIELDS = ("temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
          "repetition_penalty", "logit_bias")


class InvalidSampling(KvxferError, ValueError):
    """A sampling parameter out of its range or of the wrong type; ``field`` names it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"'{field}' {message}")
        self.field = field


def _number(field: str, value: object, low: float, high: float, *, low_open: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidSampling(field, f"must be a number, got {str(value)[:40]}")
    x = float(value) if abs(value) < 1e300 else math.inf
    if not math.isfinite(x) or x > high or x < low or (low_open and x == low):
        raise InvalidSampling(field, f"must lie in {'(' if low_open else '['}{low:g}, {high:g}], got {str(value)[:40]}")
    return x


@dataclass(frozen=True)
class SamplingParams:
    """How a completion's tokens are picked. Every field is checked on construction
    (``InvalidSampling`` names the field); ``logit_bias`` is kept as sorted (token id, bias)
    pairs, so equal parameters compare and hash equal. ``top_k`` 0 (or -1) is no top-k."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        put = object.__setattr__
        put(self, "temperature", _number("temperature", self.temperature, 0.0, 1e6))
        put(self, "top_p", _number("top_p", self.top_p, 0.0, 1.0, low_open=True))
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < -1:
            raise InvalidSampling("top_k", f"must be an int, 0 or -1 for none, got {str(self.top_k)[:40]}")
        put(self, "top_k", max(self.top_k, 0))
        put(self, "min_p", _number("min_p", self.min_p, 0.0, 1.0))
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not SEED_RANGE[0] <= self.seed < SEED_RANGE[1]):
            raise InvalidSampling("seed", f"must be an integer in [-2**63, 2**64), got {str(self.seed)[:40]}")
        put(self, "presence_penalty", _number("presence_penalty", self.presence_penalty, -2.0, 2.0))
        put(self, "frequency_penalty", _number("frequency_penalty", self.frequency_penalty, -2.0, 2.0))
        put(self, "repetition_penalty", _number("repetition_penalty", self.repetition_penalty, 0.0, 1e6,
                                                low_open=True))
        put(self, "logit_bias", _bias(self.logit_bias))

    # --- what it asks for ---------------------------------------------------------------------
    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def plain(self) -> bool:
        """Greedy with neither penalty nor bias: the argmax of the model's own logits."""
        return self.greedy and not self.logit_bias and self.presence_penalty == 0.0 \
            and self.frequency_penalty == 0.0 and self.repetition_penalty == 1.0

    def with_seed(self) -> SamplingParams:
        """These parameters with a random seed where sampling has none (a request's own)."""
        if self.greedy or self.seed is not None:
            return self
        return replace(self, seed=secrets.randbits(63))

    def for_choice(self, index: int) -> SamplingParams:
        """The parameters of choice ``index`` of a request for several (OpenAI's ``n``): the
        seed plus the index, modulo 2**64 (vLLM's rule), so choice 0 is the request's own
        completion and each other one is reproducible; without a seed, or greedy, unchanged."""
        if self.seed is None or self.greedy or index == 0:
            return self
        seed = self.seed + index
        return replace(self, seed=seed - 2 ** 64 if seed >= SEED_RANGE[1] else seed)

    def check_vocab(self, vocab_size: int) -> None:
        """InvalidSampling when a ``logit_bias`` token id lies outside ``[0, vocab_size)``."""
        for token, _ in self.logit_bias:
            if not 0 <= token < vocab_size:
                raise InvalidSampling("logit_bias", f"token id {token} is outside the vocabulary [0, {vocab_size})")

    # --- JSON ---------------------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        """The fields that differ from greedy's defaults; ``logit_bias`` as {"id": bias}."""
        out = {k: v for k, v in asdict(self).items() if v != getattr(GREEDY, k)}
        if "logit_bias" in out:
            out["logit_bias"] = {str(t): b for t, b in self.logit_bias}
        return out

    @classmethod
    def from_json(cls, body: object, vocab_size: int | None = None) -> SamplingParams:
        """From ``to_json``'s shape (or an OpenAI request's fields): InvalidSampling naming an
        unknown or bad field; with ``vocab_size``, bias token ids are checked too."""
        if body is None:
            return GREEDY
        if not isinstance(body, Mapping):
            raise InvalidSampling("sampling", "must be an object of sampling parameters")
        unknown = sorted(set(body) - set(FIELDS), key=str)
        if unknown:
            raise InvalidSampling(str(unknown[0]), f"is not a sampling parameter (they are {', '.join(FIELDS)})")
        values = {k: v for k, v in body.items() if v is not None}
        if "logit_bias" in values:
            values["logit_bias"] = _bias_json(values["logit_bias"])
        params = cls(**values)
        if vocab_size is not None:
            params.check_vocab(vocab_size)
        return params


def _bias(value: object) -> tuple[tuple[int, float], ...]:
    if isinstance(value, Mapping):
        items: Sequence[object] = list(value.items())
    elif isinstance(value, (tuple, list)):
        items = value
    else:
        raise InvalidSampling("logit_bias", "must map token ids to biases")
    out: dict[int, float] = {}
    for pair in items:
        if not isinstance(pair, (tuple, list)) or len(pair) != 2:
            raise InvalidSampling("logit_bias", "must map token ids to biases")
        token, bias = pair
        if isinstance(token, bool) or not isinstance(token, int) or token < 0:
            raise InvalidSampling("logit_bias", f"keys must be token ids (non-negative ints), got {str(token)[:40]}")
        if token in out:
            raise InvalidSampling("logit_bias", f"names token {token} twice")
        out[token] = _number("logit_bias", bias, BAN, FORCE)
    return tuple(sorted(out.items()))


def _bias_json(value: object) -> dict[int, Any]:
    """OpenAI's ``logit_bias``: an object whose keys are token ids as strings."""
    if not isinstance(value, Mapping):
        raise InvalidSampling("logit_bias", "must be an object mapping token ids to biases in [-100, 100]")
    out = {}
    for key, bias in value.items():
        text = str(key)
        if not text.isascii() or not text.isdigit() or len(text) > 12:
            raise InvalidSampling("logit_bias", f"keys must be token ids, got {text[:40]!r}")
        out[int(text)] = bias
    return out


GREEDY = SamplingParams()


# --- picking -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Pick:
    """A picked token and, when asked for, its logprob and the ``top`` likeliest tokens'
    (token id, logprob), likeliest first: log-softmax of the model's raw logits, before
    bias, penalties and temperature (vLLM's default "raw" logprobs)."""

    token: int
    logprob: float | None = None
    top: tuple[tuple[int, float], ...] = ()


def with_logprobs(logits: Any, token: int, k: int) -> Pick:
    """``token`` with its logprob and the ``k`` likeliest tokens' (ties to the lower id), from
    the model's logits as they came, in float64."""
    if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= MAX_LOGPROBS:
        raise InvalidSampling("logprobs", f"must be an int in [0, {MAX_LOGPROBS}], got {str(k)[:40]}")
    x = _as_array(logits).astype(np.float64)
    top = x.max()
    lp = x - (top + math.log(float(np.exp(x - top).sum())))
    if k == 0:
        return Pick(int(token), float(lp[token]))
    part = np.argpartition(-lp, k - 1)[:k] if k < lp.size else np.arange(lp.size)
    ranked = part[np.lexsort((part, -lp[part]))]
    return Pick(int(token), float(lp[token]), tuple((int(t), float(lp[t])) for t in ranked))


def pick_token(logits: Any, params: SamplingParams, prompt: Sequence[int] = (),
               generated: Sequence[int] = ()) -> int:
    """The next token after ``prompt`` + ``generated`` (the completion so far, whose length
    is the new token's index in it), from the model's last ``logits`` (a torch tensor or an
    array of the vocabulary's size)."""
    x = _as_array(logits)
    if params.plain:
        return int(np.argmax(x))  # the float32 logits as they came: today's greedy, bit for bit
    if not params.greedy and params.seed is None:
        raise InvalidSampling("seed", "is needed to sample (temperature > 0): the token must not depend on "
                                      "the process that draws it")
    x = x.astype(np.float64)
    keep = _apply_bias(x, params.logit_bias)
    _apply_penalties(x, params, prompt, generated)
    if keep is not None:
        x[~keep] = -np.inf
    if params.greedy:
        return int(np.argmax(x))
    x /= params.temperature
    x = _filter(x, params)
    assert params.seed is not None
    u = np.random.Generator(np.random.Philox(key=params.seed % 2 ** 64, counter=len(generated) << 64)).random(x.size)
    gumbel = -np.log(-np.log(np.maximum(u, np.finfo(np.float64).tiny)))
    return int(np.argmax(x + gumbel))


def _as_array(logits: Any) -> np.ndarray:
    if hasattr(logits, "detach"):  # a torch tensor, on whatever device
        logits = logits.detach().float().cpu().numpy()
    x = np.asarray(logits)
    if x.ndim != 1 or x.size == 0:
        raise ValueError(f"pick_token needs one row of logits, got shape {x.shape}")
    return x


def _apply_bias(x: np.ndarray, bias: tuple[tuple[int, float], ...]) -> np.ndarray | None:
    """Add the biases; the mask of what stays choosable where a bias bans or forces, else None."""
    if not bias:
        return None
    ids = np.fromiter((t for t, _ in bias), dtype=np.int64, count=len(bias))
    values = np.fromiter((b for _, b in bias), dtype=np.float64, count=len(bias))
    if int(ids.max()) >= x.size:
        raise InvalidSampling("logit_bias", f"token id {int(ids.max())} is outside the vocabulary [0, {x.size})")
    x[ids] += values
    if not ((values <= BAN) | (values >= FORCE)).any():
        return None
    keep = np.ones(x.size, dtype=bool)
    keep[ids[values <= BAN]] = False
    forced = ids[values >= FORCE]
    if forced.size:
        keep[:] = False
        keep[forced] = True
    if not keep.any():
        raise InvalidSampling("logit_bias", "bans every token")
    return keep


def _apply_penalties(x: np.ndarray, params: SamplingParams, prompt: Sequence[int], generated: Sequence[int]) -> None:
    if params.repetition_penalty != 1.0 and (len(prompt) or len(generated)):
        seen = np.unique(np.concatenate([np.asarray(prompt, dtype=np.int64), np.asarray(generated, dtype=np.int64)]))
        r = params.repetition_penalty
        x[seen] = np.where(x[seen] > 0, x[seen] / r, x[seen] * r)
    if (params.frequency_penalty or params.presence_penalty) and len(generated):
        counts = np.bincount(np.asarray(generated, dtype=np.int64), minlength=x.size)[: x.size]
        x -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0)


def _filter(x: np.ndarray, params: SamplingParams) -> np.ndarray:
    """min_p, top_k, top_p on temperature-scaled logits: what is dropped becomes -inf."""
    if params.min_p == 0.0 and params.top_k == 0 and params.top_p == 1.0:
        return x
    finite = np.isfinite(x)
    p = np.exp(x - x[finite].max())  # unnormalised; -inf -> 0
    if params.min_p > 0.0:
        p[p < params.min_p * p.max()] = 0.0
    if params.top_k > 0 or params.top_p < 1.0:
        order = np.argsort(-p, kind="stable")  # likeliest first, ties to the lower id
        ranked = p[order]
        n = int(np.count_nonzero(ranked))
        if params.top_k > 0:
            n = min(n, params.top_k)
        if params.top_p < 1.0:
            cum = np.cumsum(ranked[:n]) / ranked[:n].sum()
            # The fewest tokens whose probability reaches top_p (at least one).
            n = min(n, int(np.searchsorted(cum, params.top_p, side="left")) + 1)
        dropped = order[n:]
        p[dropped] = 0.0
    out = x.copy()
    out[p == 0.0] = -np.inf
    return out
