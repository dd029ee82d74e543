"""What the HTTP server and client share: the limits, the errors, and a request and a response
as handlers see them. Import these from ``kvxfer.serving.http``, which re-exports them."""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from kvxfer.contract import KvxferError

MAX_HEADER = 64 << 10
"""Bytes of a request's line and headers together (and of any one of them)."""
MAX_BODY = 64 << 20
"""Bytes of a request body, and of one event of a stream the client reads."""
READ_TIMEOUT_S = 10.0
"""How long a client may take to send its request line and headers, and then its body; and
how long a kept-alive connection may sit idle. A connection that sends nothing (or dribbles)
is closed instead of held for good."""
MAX_CONNECTIONS = 512
"""Open connections a server holds at once; a request on one past this is answered 503 and
its connection closed."""
DISCARD_S = 2.0
"""After answering a refused body: how long the server reads and drops what the client still
sends. Closing with its bytes unread would make the kernel reset the connection, and the
client would see the reset, not the answer."""


class HttpError(KvxferError):
    """A request could not be completed: refused, cut, timed out, or an error status."""

    def __init__(self, message: str, status: int = 0, *, unreachable: bool = False) -> None:
        super().__init__(message)
        self.status = status
        self.unreachable = unreachable  # the peer refused or cut the connection: likely dead


class BadRequest(KvxferError):
    """The client sent something malformed; answered with 400 and this message."""


@dataclass(frozen=True)
class Request:
    """A request as a handler sees it: its body read whole (at most MAX_BODY bytes, with a
    Content-Length or chunked), header names in lower case, the path without its query. A
    HEAD request comes as a GET; the server drops the body of the answer."""

    method: str
    path: str
    headers: dict[str, str]
    body: bytes
    gone: Callable[[], bool] = field(default=lambda: False, compare=False, repr=False)
    """Whether the client has gone away (closed its connection, or said it is done): a handler
    that works long for a whole answer asks it between steps and stops for nobody."""

    def json(self) -> Any:
        if not self.body:
            return {}
        try:
            return json.loads(self.body)
        except ValueError as exc:
            raise BadRequest(f"body is not JSON: {exc}") from None
        except RecursionError:
            raise BadRequest("body is not JSON this server reads: nested too deep") from None


@dataclass
class Response:
    """A handler's answer: ``body`` whole, or ``stream``'s chunks as they come (chunked);
    ``headers``: any beyond the content type (a 401's ``WWW-Authenticate``)."""

    status: int = 200
    body: bytes = b""
    content_type: str = "application/json"
    stream: AsyncGenerator[bytes, None] | None = field(default=None)
    headers: dict[str, str] = field(default_factory=dict)

    @classmethod
    def json(cls, data: Any, status: int = 200) -> Response:
        return cls(status, json.dumps(data).encode())

    @classmethod
    def ndjson(cls, events: AsyncGenerator[dict[str, Any], None]) -> Response:
        async def lines() -> AsyncGenerator[bytes, None]:
            try:
                async for event in events:
                    yield json.dumps(event).encode() + b"\n"
            finally:
                await events.aclose()  # its own clean-up runs now, not at garbage collection
        return cls(200, b"", "application/x-ndjson", lines())


Handler = Callable[[Request], Awaitable[Response]]
"""A server's handler. It may carry a ``gate`` attribute (a ``Gate``): ``HttpServer`` asks it
first, with the request's head alone, and answers what it returns without reading the body."""
Gate = Callable[[Request], Response | None]
"""A refusal on the head alone (a missing key's 401), or None to go on: called with the request's
``body`` empty."""


def error_message(url: str, path: str, status: int, data: bytes) -> str:
    """An error status's message: the JSON body's ``error``, or the start of the text."""
    try:
        payload = json.loads(data) if data else {}
    except ValueError:
        payload = {"error": data[:200].decode("latin-1")}
    message = payload.get("error", "") if isinstance(payload, dict) else ""
    if isinstance(message, dict):  # OpenAI's shape: {"error": {"message": ..., "type": ..., "code": ...}}
        message = message.get("message", "")
    return f"{url}{path}: HTTP {status}: {message}"


def decode(url: str, path: str, status: int, data: bytes) -> Any:
    """A JSON answer; HttpError for a status of 400 or more."""
    if status >= 400:
        raise HttpError(error_message(url, path, status, data), status)
    try:
        return json.loads(data) if data else {}
    except ValueError:
        return {"error": data[:200].decode("latin-1")}
