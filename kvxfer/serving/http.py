"""A minimal HTTP/1.1 server and client on asyncio streams (standard library only).

Only what the control plane needs: every exchange is one request on its own connection
(``Connection: close``), JSON bodies with Content-Length, and streamed responses as
newline-delimited JSON written until the server closes the connection. Loopback
connections are cheap, and one connection per exchange means no keep-alive state, no
chunked decoding, and a dead peer shows up as a refused or cut connection.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from kvxfer.contract import KvxferError

log = logging.getLogger(__name__)
MAX_HEADER = 64 << 10
MAX_BODY = 64 << 20
READ_TIMEOUT_S = 10.0
"""How long a client may take to send its request line, headers and body: a connection
that sends nothing (or dribbles) is closed instead of held for good."""
MAX_CONNECTIONS = 512
"""Open connections a server holds at once; past this a new one is answered 503 and closed."""
_DISCARD_BYTES = 16 << 20  # of a refused body, read and dropped so that the client sees our answer
_DISCARD_S = 2.0
REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed", 409: "Conflict",
           413: "Payload Too Large", 500: "Internal Server Error", 503: "Service Unavailable"}


class HttpError(KvxferError):
    """A request could not be completed: refused, cut, timed out, or an error status."""

    def __init__(self, message: str, status: int = 0, *, unreachable: bool = False) -> None:
        super().__init__(message)
        self.status = status
        self.unreachable = unreachable  # the peer refused or cut the connection: likely dead


@dataclass(frozen=True)
class Request:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        if not self.body:
            return {}
        try:
            return json.loads(self.body)
        except ValueError as exc:
            raise BadRequest(f"body is not JSON: {exc}") from None
        except RecursionError:
            raise BadRequest("body is not JSON this server reads: nested too deep") from None


class BadRequest(KvxferError):
    """The client sent something malformed; answered with 400 and this message."""


class _BodyRefused(BadRequest):
    """Refused before its body was read: ``pending`` bytes of it may still be on the way."""

    def __init__(self, message: str, pending: int) -> None:
        super().__init__(message)
        self.pending = pending


@dataclass
class Response:
    status: int = 200
    body: bytes = b""
    content_type: str = "application/json"
    stream: AsyncGenerator[bytes, None] | None = field(default=None)

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


async def _read_request(reader: asyncio.StreamReader) -> Request:
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.LimitOverrunError:
        raise BadRequest("header too large") from None
    if len(head) > MAX_HEADER:
        raise BadRequest("header too large")
    lines = head.decode("latin-1").split("\r\n")
    try:
        method, path, _ = lines[0].split(" ", 2)
    except ValueError:
        raise BadRequest(f"malformed request line {lines[0]!r}") from None
    headers = {}
    for line in lines[1:]:
        if ":" in line:
            k, v = line.split(":", 1)
            headers[k.strip().lower()] = v.strip()
    raw_length = headers.get("content-length", "0") or "0"
    if not (raw_length.isascii() and raw_length.isdigit()):  # "²".isdigit() is True, int("²") fails
        raise BadRequest(f"Content-Length {raw_length[:40]!r} is not a byte count")
    length = int(raw_length)
    if length > MAX_BODY:
        raise _BodyRefused(f"body of {length} bytes is over the limit of {MAX_BODY}", length)
    body = await reader.readexactly(length) if length else b""
    return Request(method.upper(), path.split("?", 1)[0], headers, body)


def _head(status: int, content_type: str, length: int | None) -> bytes:
    lines = [f"HTTP/1.1 {status} {REASONS.get(status, 'Status')}", f"Content-Type: {content_type}",
             "Connection: close", "Cache-Control: no-store"]
    if length is not None:
        lines.append(f"Content-Length: {length}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


class HttpServer:
    """Serves ``handler`` on 127.0.0.1 (port 0 = ephemeral; read ``port`` after ``start``)."""

    def __init__(self, handler: Handler, host: str = "127.0.0.1", port: int = 0, *,
                 read_timeout_s: float = READ_TIMEOUT_S, max_connections: int = MAX_CONNECTIONS) -> None:
        self._handler = handler
        self.read_timeout_s = read_timeout_s
        self.max_connections = max_connections
        self._host, self._port = host, port
        self._server: asyncio.AbstractServer | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> int:
        self._server = await asyncio.start_server(self._serve, self._host, self._port)
        self._port = self._server.sockets[0].getsockname()[1]
        return self._port

    @property
    def port(self) -> int:
        return self._port

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        # Connections first: from Python 3.12 wait_closed() waits for every open connection,
        # and an idle client would hold it (and the process's shutdown) for good.
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)
        pending = 0  # bytes of a refused body the client may still be sending
        try:
            try:
                if len(self._tasks) > self.max_connections:
                    raise _Busy(f"over {self.max_connections} connections are open; retry later")
                try:
                    request = await asyncio.wait_for(_read_request(reader), self.read_timeout_s)
                except asyncio.TimeoutError:
                    return  # first: since 3.11 the builtin TimeoutError, an OSError
                response = await self._handler(request)
            except _Busy as exc:
                pending = _DISCARD_BYTES  # its request is unread: drop it after answering
                response = Response.json({"error": str(exc)}, 503)
            except BadRequest as exc:
                pending = exc.pending if isinstance(exc, _BodyRefused) else 0
                response = Response.json({"error": str(exc)}, 400)
            except (asyncio.IncompleteReadError, ConnectionError, asyncio.LimitOverrunError):
                return
            except Exception as exc:  # a handler's bug: answer it rather than cut the connection
                log.exception("HTTP handler failed")
                response = Response.json({"error": f"{type(exc).__name__}: {exc}"}, 500)
            if response.stream is None:
                writer.write(_head(response.status, response.content_type, len(response.body)) + response.body)
            else:
                writer.write(_head(response.status, response.content_type, None))
                try:
                    async for chunk in response.stream:
                        # The client sends nothing after its request: EOF means it went away,
                        # so stop producing (a decode would otherwise run on for nobody).
                        if reader.at_eof() or writer.is_closing():
                            break
                        writer.write(chunk)
                        await writer.drain()
                finally:
                    await response.stream.aclose()
            await writer.drain()
            if pending:
                await _discard(reader, writer, pending)
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            writer.close()
            try:
                await writer.wait_closed()
            except (ConnectionError, asyncio.CancelledError):
                pass
            if task is not None:
                self._tasks.discard(task)


class _Busy(KvxferError):
    """Too many open connections: answered 503."""


async def _discard(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, pending: int) -> None:
    """After answering a refused body: say we are done writing, then read and drop what the
    client still sends, a bounded amount for a bounded time. Closing with its bytes unread
    would make the kernel reset the connection, and the client would see the reset, not the
    answer."""
    if writer.can_write_eof():
        writer.write_eof()
    left = min(pending, _DISCARD_BYTES)
    end = asyncio.get_running_loop().time() + _DISCARD_S
    while left > 0:
        timeout = end - asyncio.get_running_loop().time()
        if timeout <= 0:
            return
        try:
            chunk = await asyncio.wait_for(reader.read(min(left, 1 << 20)), timeout)
        except (asyncio.TimeoutError, ConnectionError):
            return
        if not chunk:
            return
        left -= len(chunk)


async def _open(url: str, method: str, path: str, body: Any, timeout: float
                ) -> tuple[int, asyncio.StreamReader, asyncio.StreamWriter]:
    host, _, port = url.removeprefix("http://").rstrip("/").partition(":")
    data = b"" if body is None else json.dumps(body).encode()
    try:
        # The limit bounds one line of a stream: a hint event carries every row's slot, and
        # asyncio's default (64 KiB) is a few thousand rows.
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, int(port), limit=MAX_BODY), timeout)
    except asyncio.TimeoutError:
        raise HttpError(f"{url}: cannot connect within {timeout:.1f}s", unreachable=True) from None
    except OSError as exc:
        raise HttpError(f"{url}: cannot connect: {exc.strerror or exc!r}", unreachable=True) from None
    head = (f"{method} {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n").encode()
    try:
        writer.write(head + data)
        await writer.drain()
        status_head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout)
    except asyncio.TimeoutError:  # first: since 3.11 it is the builtin TimeoutError, an OSError
        writer.close()
        raise HttpError(f"{url}{path}: no response within {timeout:.1f}s") from None
    except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError) as exc:
        writer.close()
        raise HttpError(f"{url}{path}: connection cut before a response: {exc!r}", unreachable=True) from None
    status = int(status_head.split(b" ", 2)[1])
    return status, reader, writer


async def request_json(url: str, method: str, path: str, body: Any = None, timeout: float = 10.0) -> Any:
    """One JSON exchange; raises HttpError on a refused/cut connection, timeout or status >= 400."""
    status, reader, writer = await _open(url, method, path, body, timeout)
    try:
        data = await asyncio.wait_for(reader.read(), timeout)
    except asyncio.TimeoutError:
        raise HttpError(f"{url}{path}: response not complete within {timeout:.1f}s") from None
    except OSError as exc:
        raise HttpError(f"{url}{path}: response cut: {exc!r}", unreachable=True) from None
    finally:
        writer.close()
    return _decode(url, path, status, data)


def _decode(url: str, path: str, status: int, data: bytes) -> Any:
    try:
        payload = json.loads(data) if data else {}
    except ValueError:
        payload = {"error": data[:200].decode("latin-1")}
    if status >= 400:
        message = payload.get("error", "") if isinstance(payload, dict) else ""
        raise HttpError(f"{url}{path}: HTTP {status}: {message}", status)
    return payload


async def request_text(url: str, path: str, timeout: float = 10.0) -> str:
    status, reader, writer = await _open(url, "GET", path, None, timeout)
    try:
        data = await asyncio.wait_for(reader.read(), timeout)
    finally:
        writer.close()
    if status >= 400:
        raise HttpError(f"{url}{path}: HTTP {status}", status)
    return data.decode()


async def stream_json(url: str, path: str, body: Any, timeout: float, idle_timeout: float
                      ) -> AsyncGenerator[dict[str, Any], None]:
    """POST ``body`` and yield each NDJSON event as it arrives.

    ``idle_timeout`` bounds the wait for each event; a connection cut before the stream's
    own end (an event with ``"final": true``) raises HttpError(unreachable=True).
    """
    status, reader, writer = await _open(url, "POST", path, body, timeout)
    try:
        if status >= 400:
            data = await asyncio.wait_for(reader.read(), timeout)
            _decode(url, path, status, data)
        while True:
            try:
                line = await asyncio.wait_for(reader.readline(), idle_timeout)
            except asyncio.TimeoutError:
                raise HttpError(f"{url}{path}: no event within {idle_timeout:.1f}s") from None
            except OSError as exc:
                raise HttpError(f"{url}{path}: stream cut: {exc!r}", unreachable=True) from None
            except ValueError as exc:  # a line over the limit (asyncio's LimitOverrunError, as ValueError)
                raise HttpError(f"{url}{path}: stream event too large: {exc}") from None
            if not line:
                raise HttpError(f"{url}{path}: stream ended before its final event", unreachable=True)
            try:
                event = json.loads(line)
            except ValueError:
                raise HttpError(f"{url}{path}: stream event is not JSON: {line[:80]!r}") from None
            if not isinstance(event, dict):
                raise HttpError(f"{url}{path}: stream event is not a JSON object: {line[:80]!r}")
            yield event
            if event.get("final"):
                return
    finally:
        writer.close()
