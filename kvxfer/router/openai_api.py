"""OpenAI's completions and chat completions protocol, as the router speaks it: requests
read into ``Ask`` (every field checked, unknown ones refused), answers and stream chunks
shaped as OpenAI's, errors in OpenAI's error shape. No I/O here: ``kvxfer.router.frontend``
runs the requests.

Sampling as OpenAI's: ``temperature`` (absent or 0: greedy), ``top_p``, ``seed``,
``presence_penalty``, ``frequency_penalty`` and ``logit_bias`` (token ids as strings; -100
bans a token, +100 restricts the choice to those so biased), and vLLM's extras ``top_k``,
``min_p`` and ``repetition_penalty`` (the openai client's ``extra_body``); each is checked
by ``kvxfer.engine.sampling.SamplingParams`` and a bad one is a 400 naming it. A request
with a seed makes the same tokens each time; one without gets a random seed from the router.

``n`` choices (1 to ``MAX_N``), each its own run through the workers (``kvxfer.router.frontend``);
choice i samples with the seed plus i (``SamplingParams.for_choice``). Logprobs as OpenAI's
(``kvxfer.router.logprobs``): chat's ``logprobs: true`` with ``top_logprobs`` 0 to 20, legacy
completions' ``logprobs`` 0 to 5.

What differs from OpenAI, on purpose, and said in the 400 a request gets:
- ``best_of`` only equal to ``n`` (every choice made is returned);
- no echo, no suffix, no tools;
- ``max_tokens`` absent means 16 for completions (OpenAI's default) and, for chat, the
  model's positions left after the prompt, at most ``CHAT_MAX_TOKENS``.
A completion's choice carries ``token_ids`` besides its text (a model without a tokenizer,
the toy one, answers token-id prompts with ids and empty text).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any

from kvxfer.contract import KvxferError
from kvxfer.engine.sampling import FIELDS as SAMPLING_FIELDS
from kvxfer.engine.sampling import GREEDY, InvalidSampling, SamplingParams
from kvxfer.modelfiles import Tokenizer
from kvxfer.router.logprobs import CompletionLogprobs, TokenLogprobs, TokenTexts, chat_content

COMPLETION_MAX_TOKENS = 16
CHAT_MAX_TOKENS = 256
MAX_STOPS = 4
MAX_N = 16
"""The most choices one request may ask for: each is a run of its own on the workers."""
MAX_CHAT_TOP_LOGPROBS = 20
MAX_COMPLETION_LOGPROBS = 5

_COMMON = frozenset({"model", "max_tokens", "n", "stream", "stream_options", "stop", "user", "logprobs",
                     *SAMPLING_FIELDS})
COMPLETION_FIELDS = _COMMON | {"prompt", "echo", "best_of", "suffix"}
CHAT_FIELDS = _COMMON | {"messages", "max_completion_tokens", "top_logprobs", "parallel_tool_calls"}
ROLES = ("system", "user", "assistant")

_NEUTRAL: dict[str, tuple[Any, ...]] = {
    # Fields a client may send at the value that asks for nothing this router lacks.
    "echo": (None, False), "suffix": (None, ""), "parallel_tool_calls": (None, False, True),
}


class OpenAIError(KvxferError):
    """A request answered with OpenAI's error shape: ``{"error": {message, type, param, code}}``."""

    def __init__(self, message: str, status: int = 400, *, kind: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.kind, self.param, self.code = status, kind, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class Message:
    role: str
    content: str


@dataclass(frozen=True)
class Ask:
    """One completion or chat completion request, checked. ``prompt`` is text or token ids
    (completions); ``messages`` the conversation (chat); ``max_tokens`` None: the default."""

    chat: bool
    model: str
    prompt: str | tuple[int, ...]
    messages: tuple[Message, ...]
    max_tokens: int | None
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    sampling: SamplingParams = GREEDY
    n: int = 1
    logprobs: int | None = None
    """None: no logprobs; k: each token's logprob and its k likeliest alternatives'."""


def parse(body: Any, chat: bool) -> Ask:
    """OpenAIError (400) naming the field that is missing, of the wrong type, unknown, or
    asks for what this router does not do."""
    if not isinstance(body, dict):
        raise OpenAIError("the request body must be a JSON object")
    unknown = sorted(set(body) - (CHAT_FIELDS if chat else COMPLETION_FIELDS))
    if unknown:
        raise OpenAIError(f"unknown field {unknown[0]!r}: this router does not support it", param=unknown[0])
    for name, allowed in _NEUTRAL.items():
        if name in body and not _neutral(body[name], allowed):
            raise OpenAIError(f"{name!r} is not supported (only {allowed[1]!r})", param=name)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise OpenAIError("'model' is required: a model id from GET /v1/models", param="model")
    stream, options = body.get("stream", False), body.get("stream_options")
    if stream not in (True, False, None):
        raise OpenAIError("'stream' must be true or false", param="stream")
    include_usage = _stream_options(options, bool(stream))
    prompt: str | tuple[int, ...] = ""
    if chat:
        messages = _messages(body.get("messages"))
        max_tokens = _max_tokens(body, "max_completion_tokens") or _max_tokens(body, "max_tokens")
    else:
        messages, prompt = (), _prompt(body.get("prompt"))
        max_tokens = _max_tokens(body, "max_tokens")
    try:
        sampling = SamplingParams.from_json({k: body[k] for k in SAMPLING_FIELDS if k in body})
    except InvalidSampling as exc:
        raise OpenAIError(str(exc), param=exc.field) from None
    if body.get("user") is not None and not isinstance(body["user"], str):
        raise OpenAIError("'user' must be a string", param="user")
    n = _n(body)
    return Ask(chat, model, prompt, messages, max_tokens, _stops(body.get("stop")), bool(stream), include_usage,
               sampling, n, _logprobs(body, chat))


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _n(body: dict[str, Any]) -> int:
    n = body.get("n")
    if n is None:
        n = 1
    elif not _int(n) or not 1 <= n <= MAX_N:
        raise OpenAIError(f"'n' must be an integer in [1, {MAX_N}], got {str(n)[:40]}", param="n")
    best_of = body.get("best_of")
    if best_of is not None and (not _int(best_of) or best_of != n):
        raise OpenAIError(f"'best_of' must equal 'n' ({n}) here: this router returns every choice it makes, "
                          "it does not pick the best of more", param="best_of")
    return int(n)


def _logprobs(body: dict[str, Any], chat: bool) -> int | None:
    """Chat: ``logprobs`` true or false, ``top_logprobs`` 0..20 with it; completions: ``logprobs`` 0..5."""
    value = body.get("logprobs")
    if not chat:
        if value is not None and (not _int(value) or not 0 <= value <= MAX_COMPLETION_LOGPROBS):
            raise OpenAIError(f"'logprobs' must be an integer in [0, {MAX_COMPLETION_LOGPROBS}] (the likeliest "
                              f"tokens to list), got {str(value)[:40]}", param="logprobs")
        return value  # type: ignore[no-any-return]
    if value is not None and not isinstance(value, bool):
        raise OpenAIError(f"'logprobs' must be true or false, got {str(value)[:40]}", param="logprobs")
    top = body.get("top_logprobs")
    if top is not None and (not _int(top) or not 0 <= top <= MAX_CHAT_TOP_LOGPROBS):
        raise OpenAIError(f"'top_logprobs' must be an integer in [0, {MAX_CHAT_TOP_LOGPROBS}], got {str(top)[:40]}",
                          param="top_logprobs")
    if top and not value:
        raise OpenAIError("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    return (top or 0) if value else None


def _neutral(value: Any, allowed: tuple[Any, ...]) -> bool:
    # 0 == False in Python: a bool matches a bool only (temperature false is no temperature).
    return any(value is None if a is None else (value == a and isinstance(value, bool) == isinstance(a, bool))
               for a in allowed)


def _stream_options(options: Any, stream: bool) -> bool:
    if options is None:
        return False
    if not stream:
        raise OpenAIError("'stream_options' is only allowed with 'stream': true", param="stream_options")
    if not isinstance(options, dict) or set(options) - {"include_usage"} or \
            options.get("include_usage", False) not in (True, False):
        raise OpenAIError("'stream_options' takes one field, 'include_usage': true or false", param="stream_options")
    return bool(options.get("include_usage", False))


def _prompt(prompt: Any) -> str | tuple[int, ...]:
    # OpenAI takes a string, a list of token ids, or a batch of either; one prompt per request here.
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise OpenAIError("'prompt' is empty", param="prompt")
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return tuple(prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        raise OpenAIError("'prompt' holds several prompts: this router takes one per request", param="prompt")
    raise OpenAIError("'prompt' must be a non-empty string or a non-empty list of token ids (ints)", param="prompt")


def _messages(messages: Any) -> tuple[Message, ...]:
    if not isinstance(messages, list) or not messages:
        raise OpenAIError("'messages' must be a non-empty list of {role, content}", param="messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or set(m) - {"role", "content", "name"}:
            raise OpenAIError(f"{where} must be an object with 'role' and 'content' only (no tools)", param=where)
        if m.get("role") not in ROLES:
            raise OpenAIError(f"{where}.role must be one of {', '.join(ROLES)}", param=f"{where}.role")
        out.append(Message(m["role"], _content(m.get("content"), where)))
    return tuple(out)


def _content(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) and set(p) == {"type", "text"}
                                         for p in content):
        return "".join(p["text"] for p in content)
    raise OpenAIError(f"{where}.content must be a string or a list of text parts (no images or audio)",
                      param=f"{where}.content")


def _max_tokens(body: dict[str, Any], name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise OpenAIError(f"{name!r} must be a positive integer, got {value!r}", param=name)
    return value


def _stops(stop: Any) -> tuple[str, ...]:
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > MAX_STOPS:
        raise OpenAIError(f"'stop' must be a non-empty string or a list of at most {MAX_STOPS} of them", param="stop")
    return tuple(stops)


# --- answers --------------------------------------------------------------------------------
@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int

    def as_json(self) -> dict[str, int]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}


class Shaper:
    """The id, time and model one answer's objects share, and their shapes; each choice's
    logprobs objects (``kvxfer.router.logprobs``) when the request asked for them."""

    def __init__(self, ask: Ask, model: str, tokenizer: Tokenizer | None = None) -> None:
        self.chat = ask.chat
        self.id = ("chatcmpl-" if ask.chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.model = model
        self._wants_logprobs = ask.logprobs is not None
        self._texts = TokenTexts(tokenizer)
        self._legacy = [CompletionLogprobs(self._texts) for _ in range(ask.n)] if not ask.chat else []

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def _logprobs(self, index: int, entries: tuple[TokenLogprobs, ...]) -> dict[str, Any] | None:
        if not self._wants_logprobs:
            return None
        return chat_content(entries, self._texts) if self.chat else self._legacy[index](entries)

    def choice(self, index: int, text: str, tokens: tuple[int, ...], finish: str,
               logprobs: tuple[TokenLogprobs, ...] = ()) -> dict[str, Any]:
        lp = self._logprobs(index, logprobs)
        if self.chat:
            return {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": lp,
                    "finish_reason": finish}
        return {"index": index, "text": text, "logprobs": lp, "finish_reason": finish, "token_ids": list(tokens)}

    def whole(self, choices: list[dict[str, Any]], usage: Usage) -> dict[str, Any]:
        return {**self._head("chat.completion" if self.chat else "text_completion"), "choices": choices,
                "usage": usage.as_json()}

    def chunk(self, text: str, tokens: tuple[int, ...], finish: str | None, *, first: bool = False, index: int = 0,
              logprobs: tuple[TokenLogprobs, ...] = ()) -> dict[str, Any]:
        lp = self._logprobs(index, logprobs) if logprobs else None
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant", "content": text} if first else \
                ({"content": text} if text or finish is None else {})
            return {**self._head("chat.completion.chunk"),
                    "choices": [{"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish}]}
        return {**self._head("text_completion"),
                "choices": [{"index": index, "text": text, "logprobs": lp, "finish_reason": finish,
                             "token_ids": list(tokens)}]}

    def usage_chunk(self, usage: Usage) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._head(obj), "choices": [], "usage": usage.as_json()}


def model_card(name: str, created: int, max_model_len: int | None) -> dict[str, Any]:
    """A model object as vLLM answers it: OpenAI's fields, ``root``, ``parent`` and
    ``max_model_len`` (the model's positions; None while no worker has said them)."""
    return {"id": name, "object": "model", "created": created, "owned_by": "kvxfer", "root": name,
            "parent": None, "max_model_len": max_model_len}


def models(names: list[str], created: int, max_model_len: int | None = None) -> dict[str, Any]:
    return {"object": "list", "data": [model_card(n, created, max_model_len) for n in names]}
