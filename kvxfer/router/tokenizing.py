"""vLLM's ``/tokenize`` and ``/detokenize`` requests, as the router reads them: every field
checked, unknown ones refused, errors in OpenAI's shape (``OpenAIError``, 400). No I/O
here: ``OpenAIFrontend.tokenize`` and ``.detokenize`` run them with the model's tokenizer.

    POST /tokenize    {"model"?, "prompt": str, "add_special_tokens"?: true}
                   or {"model"?, "messages": [...], "add_generation_prompt"?: true,
                       "continue_final_message"?: false, "add_special_tokens"?: false}
                      -> {"count", "max_model_len", "tokens"}
    POST /detokenize  {"model"?, "tokens": [ids]} -> {"prompt"}

What differs from vLLM, said in the 400: no ``return_token_strs``, no
``continue_final_message``, no chat template, template arguments or tools of the client's
own (the model's GGUF template renders the messages).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvxfer.router.openai_api import Message, OpenAIError
from kvxfer.router.openai_api import _messages as messages_of

PROMPT_FIELDS = frozenset({"model", "prompt", "add_special_tokens", "return_token_strs"})
CHAT_FIELDS = frozenset({"model", "messages", "add_generation_prompt", "continue_final_message",
                         "add_special_tokens", "return_token_strs", "chat_template", "chat_template_kwargs",
                         "tools", "mm_processor_kwargs", "media_io_kwargs"})
DETOKENIZE_FIELDS = frozenset({"model", "tokens"})
_ABSENT_ONLY = ("chat_template", "chat_template_kwargs", "tools", "mm_processor_kwargs", "media_io_kwargs")


@dataclass(frozen=True)
class TokenizeAsk:
    """A /tokenize request, checked: ``prompt`` text, or ``messages`` (the chat form)."""

    model: str | None
    prompt: str
    messages: tuple[Message, ...]
    add_special_tokens: bool
    add_generation_prompt: bool

    @property
    def chat(self) -> bool:
        return bool(self.messages)


@dataclass(frozen=True)
class DetokenizeAsk:
    model: str | None
    tokens: tuple[int, ...]


def parse_tokenize(body: Any) -> TokenizeAsk:
    """OpenAIError (400) naming the field that is missing, of the wrong type, unknown, or
    asks for what this router does not do."""
    if not isinstance(body, dict):
        raise OpenAIError("the request body must be a JSON object")
    chat = "messages" in body
    if chat and "prompt" in body:
        raise OpenAIError("send 'prompt' (text) or 'messages' (a chat), not both", param="prompt")
    _unknown(body, CHAT_FIELDS if chat else PROMPT_FIELDS, "/tokenize with 'messages'" if chat else "/tokenize")
    model = _model(body)
    if body.get("return_token_strs") not in (None, False):
        raise OpenAIError("'return_token_strs' is not supported by this router: only the ids come back",
                          param="return_token_strs")
    special = _flag(body, "add_special_tokens", not chat)
    if not chat:
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise OpenAIError("'prompt' must be a string (or send 'messages' for a chat)", param="prompt")
        return TokenizeAsk(model, prompt, (), special, False)
    for name in _ABSENT_ONLY:
        if body.get(name) is not None:
            raise OpenAIError(f"{name!r} is not supported: the model's own chat template renders the messages",
                              param=name)
    generation = _flag(body, "add_generation_prompt", True)
    if _flag(body, "continue_final_message", False):
        raise OpenAIError("'continue_final_message' is not supported by this router", param="continue_final_message")
    return TokenizeAsk(model, "", messages_of(body.get("messages")), special, generation)


def parse_detokenize(body: Any) -> DetokenizeAsk:
    if not isinstance(body, dict):
        raise OpenAIError("the request body must be a JSON object")
    _unknown(body, DETOKENIZE_FIELDS, "/detokenize")
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise OpenAIError("'tokens' must be a list of token ids (ints)", param="tokens")
    return DetokenizeAsk(_model(body), tuple(tokens))


def _unknown(body: dict[str, Any], fields: frozenset[str], where: str) -> None:
    unknown = sorted(set(body) - fields)
    if unknown:
        raise OpenAIError(f"unknown field {unknown[0]!r}: {where} takes {', '.join(sorted(fields))}",
                          param=unknown[0])


def _model(body: dict[str, Any]) -> str | None:
    model = body.get("model")
    if model is not None and (not isinstance(model, str) or not model):
        raise OpenAIError("'model' must be a model id from GET /v1/models (or absent)", param="model")
    return model


def _flag(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise OpenAIError(f"{name!r} must be true or false", param=name)
    return value
