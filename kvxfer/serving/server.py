"""The HTTP server of the workers and the router: aiohttp's low-level server behind the
``Handler`` interface (``kvxfer.serving.exchange``).

HTTP/1.1 with keep-alive, chunked request bodies and streamed (chunked) answers, HEAD (as
GET, without the body), and the limits of ``exchange``: MAX_HEADER, MAX_BODY, READ_TIMEOUT_S
for the head, the body and an idle connection, MAX_CONNECTIONS. Malformed requests get a 400
with a JSON ``error`` like every other refusal; a handler's exception a 500. One access log
line per request at INFO: method, path, status, seconds (a stream's until its end), and for a
4xx the message of its JSON error.

A handler's ``gate`` (``kvxfer.serving.exchange.Gate``; the key checks of
``kvxfer.serving.keys``) sees each request's head before its body is read: what it refuses is
answered at once, the body unread (dropped for up to DISCARD_S, as any unread body, and the
connection closed when it did not end by then).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from http import HTTPStatus
from typing import Any

from aiohttp import StreamReader, web
from aiohttp.abc import AbstractAccessLogger
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestHandler, RequestPayloadError

from kvxfer.serving.exchange import (
    DISCARD_S,
    MAX_BODY,
    MAX_CONNECTIONS,
    MAX_HEADER,
    READ_TIMEOUT_S,
    BadRequest,
    Gate,
    Handler,
    Request,
    Response,
)

log = logging.getLogger("kvxfer.serving.http")
ACCESS_LOG = "kvxfer.access"
"""The logger of the access lines, unless a server is given another."""


class _BodyRefused(BadRequest):
    """Over MAX_BODY: answered 400, and the connection closed once what is in flight is dropped."""


class _BodyCut(BadRequest):
    """The client sent EOF before its body was whole: answered 400, and the connection closed."""


class _AccessLog(AbstractAccessLogger):
    def log(self, request: web.BaseRequest, response: web.StreamResponse, time: float) -> None:
        reason = _refusal_reason(response) if 400 <= response.status < 500 else ""
        if reason:  # an operator sees why a client was refused, not only that it was
            self.logger.info("%s %s %d %.4fs: %s", request.method, request.path, response.status, time, reason)
        else:
            self.logger.info("%s %s %d %.4fs", request.method, request.path, response.status, time)

    @property
    def enabled(self) -> bool:
        return self.logger.isEnabledFor(logging.INFO)


class _ProtocolLog(logging.LoggerAdapter):  # type: ignore[type-arg]
    """aiohttp's protocol logs a malformed request with its traceback at ERROR: that is the
    client's mistake, answered 400, so it gets one line at INFO here."""

    def exception(self, msg: object, *args: object, exc_info: Any = True, **kwargs: Any) -> None:
        if isinstance(exc_info, HttpProcessingError):
            self.info("%s: %s", str(msg) % args, _one_line(exc_info.message))
        else:
            super().exception(msg, *args, exc_info=exc_info, **kwargs)


class _Protocol(RequestHandler):
    """aiohttp's connection handler, with what the server adds: a client that half-closes
    after its request (sends EOF) still gets its answer, and then the connection closes; the
    server knows each connection's task, to count them and to end them at close(); and a
    malformed request's 400 carries a JSON ``error``."""

    def __init__(self, owner: HttpServer, manager: web.Server, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self.owner = owner
        self.peer_done = False
        self.reading: StreamReader | None = None
        self.body_cut = False

    async def start(self) -> None:
        task = asyncio.current_task()
        assert task is not None
        self.owner._tasks.add(task)
        try:
            await super().start()  # CancelledError when close() below ends an idle wait
        finally:
            self.owner._tasks.discard(task)
            if self.transport is not None and not self.transport.is_closing():
                self.transport.close()  # its requests are done: so is the connection

    def eof_received(self) -> bool:  # type: ignore[override]  # True: asyncio keeps the transport open
        # aiohttp closes the connection here, before the answer to a request that arrived
        # with the EOF is written. Keep it open for writing, take no further request, and
        # close it after the answer (at once when there is none to give: see start()).
        self.peer_done = True
        self.watch_body(self.reading)
        self.close()
        return True

    def watch_body(self, body: StreamReader | None) -> None:
        """While a handler reads a request's body: once the client has sent EOF, a body not
        yet whole never will be: it ends now (``body_cut``), not at the read timeout."""
        self.reading = body
        if body is not None and self.peer_done and not body.is_eof():
            self.body_cut = True
            body.feed_eof()

    def handle_error(self, request: web.BaseRequest, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        super().handle_error(request, status, exc, message)  # logs; raises if an answer is under way
        what = _one_line(message) if message else HTTPStatus(status).phrase
        return _json({"error": f"malformed request: {what}" if status == 400 else what}, status, close=True)


REASON_CHARS = 500
"""The most of a refusal's message an access line carries."""


def _refusal_reason(response: web.StreamResponse) -> str:
    """The message of a 4xx answer's JSON error, ``{"error": "..."}`` or OpenAI's
    ``{"error": {"message": ...}}``, on one line; "" for any other body."""
    body = response.body if isinstance(response, web.Response) else None
    if not isinstance(body, bytes):
        return ""
    try:
        error = json.loads(body).get("error")
    except (ValueError, AttributeError):
        return ""
    message = error.get("message") if isinstance(error, dict) else error
    if not isinstance(message, str):
        return ""
    line = _one_line(message)
    return line if len(line) <= REASON_CHARS else line[:REASON_CHARS] + "..."


def _one_line(message: str) -> str:
    """aiohttp's parser errors span lines, with a caret under the bad byte: one line of them."""
    return " ".join(line.strip() for line in message.splitlines() if line.strip().strip("^"))


def _json(data: Any, status: int, *, close: bool = False) -> web.Response:
    out = web.Response(status=status, body=json.dumps(data).encode(),
                       headers={"Content-Type": "application/json", "Cache-Control": "no-store"})
    if close:
        out.force_close()
    return out


def _gone(raw: web.BaseRequest) -> bool:
    """The client went away (or said it is done): a stream stops producing."""
    protocol = raw.protocol
    transport = raw.transport
    return transport is None or transport.is_closing() or getattr(protocol, "peer_done", False)


async def _read_body(raw: web.BaseRequest) -> bytes:
    chunks: list[bytes] = []
    size = 0
    while chunk := await raw.content.readany():
        size += len(chunk)
        if size > MAX_BODY:  # a chunked body says its size only as it comes
            raise _BodyRefused(f"body is over the limit of {MAX_BODY} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def _head_size(raw: web.BaseRequest) -> int:
    return len(raw.method) + len(raw.raw_path) + sum(len(k) + len(v) + 4 for k, v in raw.raw_headers)


def _head(raw: web.BaseRequest) -> Request:
    """The request as a handler sees it, but its body (not read yet)."""
    if _head_size(raw) > MAX_HEADER:
        raise BadRequest("header too large")
    method = "GET" if raw.method == "HEAD" else raw.method
    headers = {k.lower(): v for k, v in raw.headers.items()}
    return Request(method, raw.raw_path.split("?", 1)[0], headers, b"", gone=lambda: _gone(raw))


def _whole(raw: web.BaseRequest, response: Response, *, close: bool = False) -> web.Response:
    """A handler's answer with its body whole."""
    out = web.Response(status=response.status, body=response.body,
                       headers={**response.headers, "Content-Type": response.content_type,
                                "Cache-Control": "no-store"})
    if close or _gone(raw):
        out.force_close()
    return out


class HttpServer:
    """Serves ``handler`` on ``host`` (127.0.0.1 by default; port 0 = ephemeral: read ``port``
    after ``start``). ``close()`` stops listening, ends every connection and waits for their
    handlers, whose streams are closed (their clean-up runs then). ``access_log``: the
    logger's name for the per-request lines."""

    def __init__(self, handler: Handler, host: str = "127.0.0.1", port: int = 0, *,
                 read_timeout_s: float = READ_TIMEOUT_S, max_connections: int = MAX_CONNECTIONS,
                 access_log: str = ACCESS_LOG) -> None:
        self._handler = handler
        self._gate: Gate | None = getattr(handler, "gate", None)
        self.read_timeout_s = read_timeout_s
        self.max_connections = max_connections
        self.access_log = access_log
        self._host, self._port = host, port
        self._server: asyncio.AbstractServer | None = None
        self._web: web.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()  # one per open connection

    async def start(self) -> int:
        loop = asyncio.get_running_loop()
        self._web = web_server = web.Server(self._handle)
        kwargs: dict[str, Any] = {
            "loop": loop, "keepalive_timeout": self.read_timeout_s, "lingering_time": DISCARD_S,
            "max_line_size": MAX_HEADER, "max_field_size": MAX_HEADER, "auto_decompress": False,
            "access_log_class": _AccessLog, "access_log": logging.getLogger(self.access_log),
            "logger": _ProtocolLog(log, {})}
        self._server = await loop.create_server(lambda: _Protocol(self, web_server, **kwargs), self._host, self._port)
        self._port = self._server.sockets[0].getsockname()[1]
        return self._port

    @property
    def port(self) -> int:
        return self._port

    @property
    def connections(self) -> int:
        """Connections open now."""
        return len(self._tasks)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        # Each connection's task ends when its handler has: a stream's generator is closed
        # there (CancelledError at its await), so its clean-up has run when this returns.
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._web is not None:
            for connection in self._web.connections:
                connection.force_close()
        if self._server is not None:
            await self._server.wait_closed()

    async def _handle(self, raw: web.BaseRequest) -> web.StreamResponse:
        if len(self._tasks) > self.max_connections:
            return _json({"error": f"over {self.max_connections} connections are open; retry later"}, 503, close=True)
        try:
            head = _head(raw)
        except BadRequest as exc:
            return _json({"error": str(exc)}, 400)
        refused = self._gate(head) if self._gate is not None else None
        if refused is not None:  # before the body is read: a request without its key sends none in vain
            return _whole(raw, refused, close=not raw.content.is_eof())
        try:
            request = await self._request(raw, head)
        except BadRequest as exc:
            return _json({"error": str(exc)}, 400, close=isinstance(exc, (_BodyRefused, _BodyCut)))
        except asyncio.TimeoutError:
            return _json({"error": f"body not received within {self.read_timeout_s:g}s"}, 408, close=True)
        except (RequestPayloadError, ConnectionError) as exc:  # the client went away mid-body
            return _json({"error": f"body cut: {exc}"}, 400, close=True)
        try:
            response = await self._handler(request)
        except BadRequest as exc:
            return _json({"error": str(exc)}, 400)
        except Exception as exc:  # a handler's bug: answer it rather than cut the connection
            log.exception("HTTP handler failed")
            return _json({"error": f"{type(exc).__name__}: {exc}"}, 500)
        if response.stream is not None:
            return await self._stream(raw, response)
        return _whole(raw, response)

    async def _request(self, raw: web.BaseRequest, head: Request) -> Request:
        """``head`` with its body, read whole."""
        if raw.content_length is not None and raw.content_length > MAX_BODY:
            raise _BodyRefused(f"body of {raw.content_length} bytes is over the limit of {MAX_BODY}")
        protocol = raw.protocol
        assert isinstance(protocol, _Protocol)
        protocol.watch_body(raw.content)
        try:
            body = await asyncio.wait_for(_read_body(raw), self.read_timeout_s)
        finally:
            protocol.watch_body(None)
        if protocol.body_cut:
            raise _BodyCut("the client closed the connection before its body was whole")
        return dataclasses.replace(head, body=body)

    async def _stream(self, raw: web.BaseRequest, response: Response) -> web.StreamResponse:
        assert response.stream is not None
        out = web.StreamResponse(status=response.status,
                                 headers={**response.headers, "Content-Type": response.content_type,
                                          "Cache-Control": "no-store"})
        try:
            if raw.method == "HEAD":
                return out  # the head alone: nothing is produced
            await out.prepare(raw)
            async for chunk in response.stream:
                # The client sends nothing after its request: EOF means it went away, so
                # stop producing (a decode would otherwise run on for nobody).
                if _gone(raw):
                    out.force_close()
                    break
                await out.write(chunk)
        except ConnectionError:
            out.force_close()
        finally:
            await response.stream.aclose()
        return out
