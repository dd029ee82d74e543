"""OpenAI's completions and chat completions on a Router: text in, text out.

    frontend = OpenAIFrontend(router)                  # the model and tokenizer the workers name
    job = await frontend.prepare(parse(body, chat=True))   # OpenAIError: 400, 404 or 503
    answer = await frontend.complete(job)              # OpenAI's chat.completion object
    async for chunk in await frontend.open_stream(job): ...   # its chunks (503 raised before the first)

The model clients name is the one the workers' /health names (``kvxfer serve --model``), or
the one given here. Its tokenizer and chat template come from the same GGUF, read without
the weights and without torch (``kvxfer.modelfiles.load_tokenizer``); the toy model has none and takes token ids
only. A completion ends at the model's stop id (SmolLM2's ``<|im_end|>``), at a stop
string, or after ``max_tokens``; the router then closes the decode worker's stream.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from typing import Any

from kvxfer.modelfiles import CheckpointError, Tokenizer, load_tokenizer
from kvxfer.router.inputs import InvalidRequest
from kvxfer.router.logprobs import TokenLogprobs
from kvxfer.router.openai_api import (
    CHAT_MAX_TOKENS,
    COMPLETION_MAX_TOKENS,
    Ask,
    OpenAIError,
    Shaper,
    Usage,
    model_card,
    models,
)
from kvxfer.router.results import Completion
from kvxfer.router.router import Router
from kvxfer.router.text import TextStream
from kvxfer.router.tokenizing import DetokenizeAsk, TokenizeAsk

UNAVAILABLE = "service_unavailable_error"


class ClientGone(OpenAIError):
    """The client left before its whole answer: the request ended there. Answered 499 (the
    status nginx logs for a client that closed its request), which nobody reads but the log."""

    def __init__(self, message: str) -> None:
        super().__init__(message, 499, kind="client_closed_request")


@dataclass(frozen=True)
class Job:
    """A checked request, ready to run: its prompt as ids and the tokens it may make."""

    ask: Ask
    model: str
    ids: tuple[int, ...]
    max_tokens: int
    tokenizer: Tokenizer | None


@dataclass(frozen=True)
class _Piece:
    """Some of choice ``index``'s text and tokens (with their logprobs, when asked); its last
    piece has ``finish`` and ``count``, the choice's completion tokens."""

    text: str
    tokens: tuple[int, ...]
    index: int = 0
    finish: str | None = None
    count: int = 0
    logprobs: tuple[TokenLogprobs, ...] = ()


class OpenAIFrontend:
    def __init__(self, router: Router, *, model: str | None = None, tokenizer: Tokenizer | None = None) -> None:
        """``model``: the name clients use and whose GGUF holds the tokenizer (default: the
        workers'); ``tokenizer``: one already loaded (default: loaded on first use)."""
        self.router = router
        self._model = model
        if model is not None:
            router.served_model = model  # the name the router's vllm: metrics carry
        self._tokenizer = tokenizer
        self._loaded = tokenizer is not None
        self._why_none = ""  # why the model has no tokenizer here, for the 400 a text prompt gets
        self._lock = asyncio.Lock()

    async def model_id(self) -> str | None:
        if self._model is not None:
            return self._model
        limits = await self.router.model()
        return limits.name or None if limits is not None else None

    async def max_model_len(self) -> int | None:
        """The model's positions, as the workers' /health says them (None while none answers)."""
        limits = await self.router.model()
        return limits.max_positions if limits is not None else None

    async def models(self, created: int = 0) -> dict[str, Any]:
        model = await self.model_id()
        return models([model] if model else [], created, await self.max_model_len())

    async def model(self, name: str, created: int = 0) -> dict[str, Any]:
        """The model object of ``name`` (``GET /v1/models/{name}``); OpenAIError 404 naming
        it when this router does not serve it."""
        served = await self.model_id()
        if name != served:
            also = f"this router serves {served!r}" if served else "no worker answers, so no model is served yet"
            raise OpenAIError(f"The model {name!r} does not exist here; {also} (GET /v1/models)", 404,
                              param="model", code="model_not_found")
        return model_card(name, created, await self.max_model_len())

    async def tokenizer(self) -> Tokenizer | None:
        """The served model's tokenizer, loaded once (a GGUF's tokenizer takes ~0.2 s)."""
        async with self._lock:
            if not self._loaded:
                name = await self.model_id()
                if name is None:
                    return None  # no worker answers yet: try again on the next request
                self._tokenizer, self._why_none = await asyncio.to_thread(_load, name)
                self._loaded = True
            return self._tokenizer

    # --- vLLM's /tokenize and /detokenize -------------------------------------------------------
    async def tokenize(self, ask: TokenizeAsk) -> dict[str, Any]:
        """vLLM's TokenizeResponse: ``{"count", "max_model_len", "tokens"}``; OpenAIError 400
        for a model without a tokenizer (the toy one), 404 for another model, 503 with none yet."""
        tok = await self._tokenizer_for(ask.model, "/tokenize")
        if ask.chat:
            try:
                text = tok.chat([{"role": m.role, "content": m.content} for m in ask.messages],
                                add_generation_prompt=ask.add_generation_prompt)
            except ValueError as exc:
                raise OpenAIError(f"'messages': {exc}", param="messages") from None
        else:
            text = ask.prompt
        ids = tok.encode(text)
        bos = tok.info.bos_id
        if not ask.add_special_tokens and tok.info.add_bos and ids[:1] == [bos]:
            ids = ids[1:]  # encode adds the BOS the GGUF asks for: the special token this leaves out
        return {"count": len(ids), "max_model_len": await self.max_model_len(), "tokens": ids}

    async def detokenize(self, ask: DetokenizeAsk) -> dict[str, Any]:
        """vLLM's DetokenizeResponse: ``{"prompt"}``, the ids' text (special tokens kept)."""
        tok = await self._tokenizer_for(ask.model, "/detokenize")
        vocab = tok.vocab_size
        bad = [t for t in ask.tokens if not 0 <= t < vocab]
        if bad:
            raise OpenAIError(f"'tokens' must lie in [0, {vocab}) for model {await self.model_id()!r}, "
                              f"got {bad[0]}", param="tokens")
        return {"prompt": tok.decode(ask.tokens)}

    async def _tokenizer_for(self, name: str | None, route: str) -> Tokenizer:
        served = await self.model_id()
        if served is None:
            raise OpenAIError("no worker answers, so no model is served yet", 503, kind=UNAVAILABLE)
        if name is not None and name != served:
            raise OpenAIError(f"model {name!r} is not served here; this router serves {served!r} "
                              "(GET /v1/models)", 404, param="model", code="model_not_found")
        tok = await self.tokenizer()
        if tok is None:
            raise OpenAIError(f"{route} needs the model's tokenizer, and this router has none: {self._why_none}")
        return tok

    async def prepare(self, ask: Ask) -> Job:
        model = await self.model_id()
        if model is None:
            raise OpenAIError("no worker answers, so no model is served yet", 503, kind=UNAVAILABLE)
        if ask.model != model:
            raise OpenAIError(f"model {ask.model!r} is not served here; this router serves {model!r} "
                              "(GET /v1/models)", 404, param="model", code="model_not_found")
        tok = await self.tokenizer()
        ids = self._ids(ask, tok)
        limits = await self.router.model()
        if ask.max_tokens is not None:
            max_tokens = ask.max_tokens
        elif ask.chat and limits is not None:
            max_tokens = max(1, min(CHAT_MAX_TOKENS, limits.max_positions - len(ids) + 1))
        else:
            max_tokens = CHAT_MAX_TOKENS if ask.chat else COMPLETION_MAX_TOKENS
        try:
            await self.router.validate(ids, max_tokens, sampling=ask.sampling)
        except InvalidRequest as exc:
            param = "logit_bias" if str(exc).startswith("'logit_bias'") else \
                "max_tokens" if "positions" in str(exc) else ("messages" if ask.chat else "prompt")
            raise OpenAIError(str(exc), param=param) from None
        return Job(ask, model, ids, max_tokens, tok)

    def _ids(self, ask: Ask, tok: Tokenizer | None) -> tuple[int, ...]:
        needs_text = ask.chat or isinstance(ask.prompt, str) or ask.stop
        if tok is None and needs_text:
            what = "chat" if ask.chat else ("a text prompt" if isinstance(ask.prompt, str) else "stop strings")
            raise OpenAIError(f"{what} needs the model's tokenizer, and this router has none: {self._why_none}",
                              param="messages" if ask.chat else ("prompt" if not ask.stop else "stop"))
        if ask.chat:
            assert tok is not None
            try:
                text = tok.chat([{"role": m.role, "content": m.content} for m in ask.messages])
            except ValueError as exc:
                raise OpenAIError(f"'messages': {exc}", param="messages") from None
            return tuple(tok.encode(text))
        if isinstance(ask.prompt, str):
            assert tok is not None
            return tuple(tok.encode(ask.prompt))
        return ask.prompt

    # --- running ------------------------------------------------------------------------------
    async def complete(self, job: Job, gone: Callable[[], bool] = lambda: False) -> dict[str, Any]:
        """The whole answer; OpenAIError (503 with no usable pair, 500 for a failed request).
        ClientGone once ``gone()`` says the client left: asked after every token, so the
        request (its decode streams, its reservations) ends within a decode step, as a
        streamed one does, rather than running on to ``max_tokens`` for nobody."""
        n = job.ask.n
        text: list[list[str]] = [[] for _ in range(n)]
        tokens: list[list[int]] = [[] for _ in range(n)]
        logprobs: list[list[TokenLogprobs]] = [[] for _ in range(n)]
        finish: list[str] = ["length"] * n
        count = 0
        async with contextlib.aclosing(self._pieces(job)) as pieces:
            async for piece in pieces:
                if gone():
                    raise ClientGone("the client closed its connection before the answer was whole")
                i = piece.index
                text[i].append(piece.text)
                tokens[i].extend(piece.tokens)
                logprobs[i].extend(piece.logprobs)
                if piece.finish is not None:
                    finish[i], count = piece.finish, count + piece.count
        shape = Shaper(job.ask, job.model, job.tokenizer)
        choices = [shape.choice(i, "".join(text[i]), tuple(tokens[i]), finish[i], tuple(logprobs[i]))
                   for i in range(n)]
        return shape.whole(choices, Usage(len(job.ids), count))

    async def open_stream(self, job: Job) -> AsyncGenerator[dict[str, Any], None]:
        """The answer's chunks. The first token is awaited here: a request no worker pair
        can serve raises OpenAIError (503) before any chunk; a failure after that ends the
        stream with an ``{"error": ...}`` chunk."""
        pieces = self._pieces(job)
        try:
            first = await pieces.__anext__()
        except BaseException:
            await pieces.aclose()
            raise
        return self._chunks(job, pieces, first)

    async def _chunks(self, job: Job, pieces: AsyncGenerator[_Piece, None],
                      first: _Piece) -> AsyncGenerator[dict[str, Any], None]:
        shape = Shaper(job.ask, job.model, job.tokenizer)
        chat = job.ask.chat
        opening = [True] * job.ask.n  # a chat choice's first chunk names the role
        ended = count = 0
        piece = first
        try:
            while True:
                i = piece.index
                if piece.text or piece.finish is not None or opening[i] or not chat or piece.logprobs:
                    yield shape.chunk(piece.text, piece.tokens, piece.finish, first=opening[i] and chat, index=i,
                                      logprobs=piece.logprobs)
                    opening[i] = False
                if piece.finish is not None:
                    ended, count = ended + 1, count + piece.count
                    if ended == job.ask.n:
                        if job.ask.include_usage:
                            yield shape.usage_chunk(Usage(len(job.ids), count))
                        return
                piece = await pieces.__anext__()
        except OpenAIError as exc:
            yield exc.body()
        finally:
            await pieces.aclose()

    def _pieces(self, job: Job) -> AsyncGenerator[_Piece, None]:
        """Every choice's pieces, as they come; each choice's ends with its finish."""
        if job.ask.n == 1:
            return self._choice(job, 0)
        return merged([self._choice(job, i) for i in range(job.ask.n)])

    async def _choice(self, job: Job, index: int) -> AsyncGenerator[_Piece, None]:
        tok = job.tokenizer
        texts = TextStream(tok, job.ask.stop) if tok is not None else None
        stop_ids = tok.stop_ids if tok is not None else frozenset()
        stream = self.router.stream(job.ids, job.max_tokens, stop_ids=stop_ids,
                                    until=lambda _: texts is not None and texts.stopped,
                                    sampling=job.ask.sampling.for_choice(index), logprobs=job.ask.logprobs)
        async with contextlib.aclosing(stream):
            async for item in stream:
                if isinstance(item, Completion):
                    yield _last(item, texts, index)
                    return
                lp = (TokenLogprobs(item.token, item.logprob, item.top_logprobs),) if item.logprob is not None else ()
                if item.token in stop_ids or texts is None:
                    yield _Piece("", (item.token,), index, logprobs=lp)  # a stop id ends the text, not part of it
                else:
                    yield _Piece(texts.feed(item.token), (item.token,), index, logprobs=lp)


async def merged(choices: list[AsyncGenerator[_Piece, None]]) -> AsyncGenerator[_Piece, None]:
    """The pieces of several choices, each as soon as it comes (the lower index first among
    those ready together). Closed, or failing in one choice, it closes every choice at its
    next piece, not mid-call, as ``kvxfer.router.app.with_keepalive`` does for one: each
    router stream settles its worker calls and counts itself cancelled."""
    pending: dict[asyncio.Future[_Piece], int] = {}
    try:
        for i, choice in enumerate(choices):
            pending[asyncio.ensure_future(choice.__anext__())] = i
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for future in sorted(done, key=pending.__getitem__):
                i = pending.pop(future)
                try:
                    piece = future.result()
                except StopAsyncIteration:
                    continue
                yield piece
                pending[asyncio.ensure_future(choices[i].__anext__())] = i
    finally:
        if pending:
            try:
                await asyncio.wait(pending)
            except asyncio.CancelledError:
                for future in pending:
                    future.cancel()
                await asyncio.gather(*pending, return_exceptions=True)
                raise
            for future in pending:
                if not future.cancelled():
                    future.exception()  # retrieved: a choice failing while another failed first
        for choice in choices:
            await choice.aclose()


def _last(c: Completion, texts: TextStream | None, index: int) -> _Piece:
    if c.error is not None:
        if c.finish_reason == "unavailable":
            raise OpenAIError(f"no usable prefill/decode worker pair: {c.error}", 503, kind=UNAVAILABLE)
        raise OpenAIError(f"the request failed: {c.error}", 500, kind="server_error")
    rest = texts.finish() if texts is not None else ""
    return _Piece(rest, (), index, c.finish_reason, len(c.tokens))


def _load(name: str) -> tuple[Tokenizer | None, str]:
    """The tokenizer ``name``'s GGUF holds, or None and why (the toy model has none; a GGUF
    or package missing on the router's host is named)."""
    try:
        tok = load_tokenizer(name)
    except CheckpointError as exc:
        return None, f"model {name!r}: {exc}"
    return tok, "" if tok is not None else f"model {name!r} has none: send token ids"
