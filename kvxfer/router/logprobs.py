"""OpenAI's logprobs objects, from the logprobs the workers computed where they picked each
token (``kvxfer.engine.sampling.with_logprobs``: log-softmax of the model's raw logits, before
bias, penalties and temperature, as vLLM's default "raw" logprobs).

Chat (``logprobs: true``, ``top_logprobs: k`` up to 20): ``{"content": [{"token", "logprob",
"bytes", "top_logprobs": [{"token", "logprob", "bytes"}, ...]}, ...]}``. Legacy completions
(``logprobs: k`` up to 5): ``{"tokens", "token_logprobs", "top_logprobs": [{token: logprob}],
"text_offset"}``, ``text_offset`` counting characters from the completion's start (no echo).

One entry per completion token, a stop id included (its text is the control token's own,
``<|im_end|>``): so there are as many entries as ``usage.completion_tokens`` counts. A token's
text is what the tokenizer decodes it to alone (a byte-level piece of a character decodes to
U+FFFD; ``bytes`` has its true bytes); the toy model, without a tokenizer, names tokens
``token_id:N`` (vLLM's spelling for tokens returned as ids).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvxfer.modelfiles import Tokenizer


@dataclass(frozen=True)
class TokenLogprobs:
    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # the k likeliest (token id, logprob), likeliest first


class TokenTexts:
    """Token ids' texts and bytes, as the logprobs objects name tokens (each looked up once)."""

    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self._tok = tokenizer
        self._seen: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token: int) -> tuple[str, list[int]]:
        found = self._seen.get(token)
        if found is None:
            if self._tok is None:
                text = f"token_id:{token}"
                found = (text, list(text.encode()))
            else:
                found = (self._tok.decode([token]), list(self._tok.token_bytes(token)))
            if len(self._seen) < 65536:
                self._seen[token] = found
        return found


def chat_content(entries: tuple[TokenLogprobs, ...], texts: TokenTexts) -> dict[str, Any]:
    def one(token: int, logprob: float) -> dict[str, Any]:
        text, raw = texts(token)
        return {"token": text, "logprob": logprob, "bytes": raw}

    return {"content": [{**one(e.token, e.logprob), "top_logprobs": [one(t, lp) for t, lp in e.top]}
                        for e in entries]}


class CompletionLogprobs:
    """One choice's legacy logprobs, piece by piece: ``text_offset`` goes on across pieces."""

    def __init__(self, texts: TokenTexts) -> None:
        self._texts = texts
        self._offset = 0

    def __call__(self, entries: tuple[TokenLogprobs, ...]) -> dict[str, Any]:
        tokens, offsets = [], []
        for e in entries:
            text = self._texts(e.token)[0]
            tokens.append(text)
            offsets.append(self._offset)
            self._offset += len(text)
        return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
                "top_logprobs": [{self._texts(t)[0]: lp for t, lp in e.top} for e in entries],
                "text_offset": offsets}
