"""The router's HTTP API (``kvxfer router`` serves it; an embedder may serve it too).

OpenAI-compatible (``kvxfer.router.openai_api`` says what differs):
    POST /v1/completions       {"model", "prompt": text or [ids], "max_tokens"?, "stop"?, "stream"?, ...}
    POST /v1/chat/completions  {"model", "messages": [{role, content}], ...}
         -> OpenAI's objects; with "stream": true, server-sent events ("data: {chunk}" ...
            "data: [DONE]"), and a ": waiting" comment whenever KEEPALIVE_S passed without one
    GET  /v1/models            -> its one model object, with vLLM's "root", "parent", "max_model_len"
    GET  /v1/models/{id}       -> that object; 404 (code "model_not_found") for an id not served
vLLM's (``kvxfer.router.tokenizing``; the model's tokenizer, so not the toy model's: 400):
    POST /tokenize   {"model"?, "prompt", "add_special_tokens"?} or {"model"?, "messages", ...}
                     -> {"count", "max_model_len", "tokens"}
    POST /detokenize {"model"?, "tokens"} -> {"prompt"}
    GET  /version    -> {"version": kvxfer.__version__}
    errors: {"error": {"message", "type", "param", "code"}} with 400 (a field unknown, of the
    wrong type, or past the model's vocabulary or positions), 404 (another model), 503 (no
    usable prefill/decode pair), 500 (the request failed)

kvxfer's own:
    POST /generate {"prompt": [ids], "max_new_tokens": N, "request"?: str, "stop_ids"?: [ids],
                    "temperature"?, "top_p"?, "top_k"?, "min_p"?, "seed"?, "presence_penalty"?,
                    "frequency_penalty"?, "repetition_penalty"?, "logit_bias"?: {"id": bias}, "logprobs"?: k}
         (``kvxfer.engine.sampling``; greedy without them; sampling without a seed gets a random
         one, which completion.seed names)
         -> NDJSON: {"event": "token", "index", "token", "at_s"} (with "logprobs": k, also
            "logprob" and "top_logprobs": [[id, logprob], ...]) ... then
            {"event": "done", "final": true, "completion": {...}}  (completion.error set on failure)
            and {"event": "waiting"} whenever KEEPALIVE_S passed without another event
         "request" comes back as completion.request; the workers see the router's own id instead
    GET  /health   -> 200 {"status": "ok" | "degraded", "reason", "workers": {url: answers}, ...},
                      503 with "status": "unavailable" when no prefill/decode pair is usable
    GET  /metrics  -> Prometheus text (prometheus_client's, of ``Router.metrics``)
    HEAD on any GET -> its status and headers, no body

With an API key (``make_handler(..., api_key=)``, ``kvxfer router --api-key``), every route but
/health (and /) and /metrics wants ``Authorization: Bearer <key>``: 401 in OpenAI's error shape,
code "invalid_api_key", otherwise, before the body is read.

A /generate the workers' model cannot serve is answered 400 with what ``Router.validate``
says in this process (``InvalidRequest``), as is malformed JSON or an unknown field.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import AsyncGenerator
from typing import Any
from urllib.parse import unquote

from kvxfer import __version__
from kvxfer.engine.sampling import FIELDS as SAMPLING_FIELDS
from kvxfer.engine.sampling import InvalidSampling, SamplingParams
from kvxfer.router.constants import KEEPALIVE_S
from kvxfer.router.frontend import OpenAIFrontend
from kvxfer.router.inputs import InvalidRequest, check_logprobs
from kvxfer.router.openai_api import OpenAIError, parse
from kvxfer.router.results import Completion
from kvxfer.router.router import Router
from kvxfer.router.tokenizing import parse_detokenize, parse_tokenize
from kvxfer.serving.http import BadRequest, Request, Response
from kvxfer.serving.keys import API_KEY, BearerKey, refusal
from kvxfer.serving.metrics import CONTENT_TYPE

GENERATE_FIELDS = frozenset({"prompt", "max_new_tokens", "request", "stop_ids", "logprobs", *SAMPLING_FIELDS})
_WAITING = object()


def completion_json(c: Completion) -> dict[str, Any]:
    return dataclasses.asdict(c)


def make_handler(router: Router, frontend: OpenAIFrontend | None = None,  # type: ignore[no-untyped-def]
                 keepalive_s: float = KEEPALIVE_S, *, api_key: BearerKey | None = None):
    """The router's HTTP handler; with ``api_key``, every route but /health and /metrics
    wants ``Authorization: Bearer <key>`` (401 otherwise: ``kvxfer.serving.keys``), from
    ``handler.gate``, which an ``HttpServer`` asks before it reads the body."""
    openai = frontend if frontend is not None else OpenAIFrontend(router)
    started = int(time.time())

    def gate(request: Request) -> Response | None:
        return refusal(api_key, request, API_KEY)

    async def handle(request: Request) -> Response:
        refused = gate(request)  # HttpServer asked it before the body: this is for other callers
        if refused is not None:
            return refused
        path = request.path.rstrip("/") or "/"
        route = (request.method, path)
        if route == ("GET", "/metrics"):
            return Response(200, router.metrics_text().encode(), CONTENT_TYPE)
        if route in (("GET", "/"), ("GET", "/health")):
            health = await router.health()
            return Response.json(health.as_json(), 200 if health.usable else 503)
        if route == ("POST", "/generate"):
            return await _generate(router, request.json(), keepalive_s)
        if route == ("GET", "/v1/models"):
            return Response.json(await openai.models(started))
        if request.method == "GET" and path.startswith("/v1/models/"):
            return await _model(openai, unquote(path[len("/v1/models/"):]), started)
        if route == ("GET", "/version"):
            return Response.json({"version": __version__})
        if route in (("POST", "/tokenize"), ("POST", "/detokenize")):
            return await _tokens(openai, request, path == "/tokenize")
        if route in (("POST", "/v1/completions"), ("POST", "/v1/chat/completions")):
            return await _openai(openai, request, path.endswith("chat/completions"), keepalive_s)
        if path.startswith("/v1/"):
            return Response.json(OpenAIError(f"no {request.method} {path} here", 404, code="unknown_url").body(), 404)
        return Response.json({"error": f"no {request.method} {path}"}, 404)
    handle.gate = gate  # type: ignore[attr-defined]
    return handle


async def _generate(router: Router, body: Any, keepalive_s: float) -> Response:
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    unknown = sorted(set(body) - GENERATE_FIELDS)
    if unknown:
        raise BadRequest(f"unknown field {unknown[0]!r}: /generate takes {', '.join(sorted(GENERATE_FIELDS))}")
    prompt, max_new, stop_ids = body.get("prompt"), body.get("max_new_tokens", 16), body.get("stop_ids", [])
    if not isinstance(stop_ids, list):
        raise BadRequest("'stop_ids' must be a list of token ids")
    try:
        sampling = SamplingParams.from_json({k: body[k] for k in SAMPLING_FIELDS if k in body})
        await router.validate(prompt, max_new, stop_ids, sampling)  # type: ignore[arg-type]
        check_logprobs(body.get("logprobs"))
    except (InvalidRequest, InvalidSampling) as exc:
        raise BadRequest(str(exc)) from None
    rid = body.get("request")
    stream = router.stream(prompt, max_new, rid if isinstance(rid, str) else None,  # type: ignore[arg-type]
                           stop_ids=stop_ids, sampling=sampling, logprobs=body.get("logprobs"))
    return Response.ndjson(_events(stream, keepalive_s))


async def _events(stream: AsyncGenerator[Any, None], keepalive_s: float) -> AsyncGenerator[dict[str, Any], None]:
    async for item in with_keepalive(stream, keepalive_s):
        if item is _WAITING:
            yield {"event": "waiting"}  # writing it also shows whether the client is still there
        elif isinstance(item, Completion):
            yield {"event": "done", "final": True, "completion": completion_json(item)}
        elif item.logprob is None:
            yield {"event": "token", "index": item.index, "token": item.token, "at_s": item.at_s}
        else:
            yield {"event": "token", "index": item.index, "token": item.token, "at_s": item.at_s,
                   "logprob": item.logprob, "top_logprobs": [list(t) for t in item.top_logprobs]}


async def _model(openai: OpenAIFrontend, name: str, started: int) -> Response:
    try:
        return Response.json(await openai.model(name, started))
    except OpenAIError as exc:
        return Response.json(exc.body(), exc.status)


async def _tokens(openai: OpenAIFrontend, request: Request, tokenize: bool) -> Response:
    try:
        body = request.json()
        if tokenize:
            return Response.json(await openai.tokenize(parse_tokenize(body)))
        return Response.json(await openai.detokenize(parse_detokenize(body)))
    except BadRequest as exc:  # the body is not JSON
        return Response.json(OpenAIError(str(exc)).body(), 400)
    except OpenAIError as exc:
        return Response.json(exc.body(), exc.status)


async def _openai(openai: OpenAIFrontend, request: Request, chat: bool, keepalive_s: float) -> Response:
    try:
        ask = parse(request.json(), chat)
        job = await openai.prepare(ask)
        if not ask.stream:
            return Response.json(await openai.complete(job, request.gone))
        chunks = await openai.open_stream(job)
    except BadRequest as exc:  # the body is not JSON
        return Response.json(OpenAIError(str(exc)).body(), 400)
    except OpenAIError as exc:
        return Response.json(exc.body(), exc.status)
    return Response(200, b"", "text/event-stream", _sse(chunks, keepalive_s))


async def _sse(chunks: AsyncGenerator[dict[str, Any], None], keepalive_s: float) -> AsyncGenerator[bytes, None]:
    async for chunk in with_keepalive(chunks, keepalive_s):
        yield b": waiting\n\n" if chunk is _WAITING else b"data: " + json.dumps(chunk).encode() + b"\n\n"
    yield b"data: [DONE]\n\n"


async def with_keepalive(items: AsyncGenerator[Any, None], keepalive_s: float) -> AsyncGenerator[Any, None]:
    """``items`` as they come, and ``_WAITING`` after each ``keepalive_s`` without one."""
    pending: asyncio.Future[Any] | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(items.__anext__())
            done, _ = await asyncio.wait({pending}, timeout=keepalive_s)
            if not done:
                yield _WAITING
                continue
            finished, pending = pending, None
            try:
                item = finished.result()
            except StopAsyncIteration:
                return
            yield item
    finally:
        if pending is not None:
            # A client that went away: the router's stream runs on to its next item and is
            # closed there, at a yield, where every worker call it made can be settled (a
            # publish in flight, say, has no clean way back from a cancel). Its own timers
            # bound the wait. Only the server's shutdown cancels it mid-call.
            try:
                await asyncio.wait({pending})
            except asyncio.CancelledError:
                pending.cancel()
                await asyncio.gather(pending, return_exceptions=True)
                raise
        await items.aclose()
