"""The HTTP client of the router and the tools: aiohttp, one session per owner, connections
kept alive and reused.

An ``HttpClient`` holds one ``aiohttp.ClientSession``, opened on first use in the running
event loop and closed by ``close()`` (the router closes its own in ``Router.close``), or else
when that loop shuts down (``asyncio.run`` closes it on its way out, with the loop's async
generators). The module's functions (``request_json``, ``request_text``, ``stream_json``)
share one client per event loop; ``close_default_client()`` closes it.

Errors keep the meaning the router's failure handling rests on: a connection refused, cut,
or not made within ``timeout`` is ``HttpError(unreachable=True)`` (the peer is likely gone);
no answer within ``timeout`` is an HttpError that says nothing of the peer; a status of 400
or more is ``HttpError(status=...)`` with the answer's ``error``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import weakref
from collections.abc import AsyncGenerator, AsyncIterator, Mapping
from typing import Any

import aiohttp

from kvxfer.serving.exchange import MAX_BODY, READ_TIMEOUT_S, HttpError, decode, error_message
from kvxfer.serving.urls import check_url  # noqa: F401 - the client's name for it too

KEEPALIVE_S = READ_TIMEOUT_S / 2
"""How long an idle connection stays in the pool: below the servers' idle limit
(READ_TIMEOUT_S), so that the client, not the server, ends it, and a request never goes out
on a connection the server is closing."""


class HttpClient:
    """One pooled session. Usable again after ``close()``: the next call opens a new one.
    A session left open is closed when its event loop shuts down (``asyncio.run`` does that
    on its way out): see ``_close_with_loop``. ``headers`` go with every request (the
    router's cluster key: ``kvxfer.serving.keys``)."""

    def __init__(self, *, keepalive_s: float = KEEPALIVE_S, headers: Mapping[str, str] | None = None) -> None:
        self.keepalive_s = keepalive_s
        self._headers = dict(headers or {})
        self._session: aiohttp.ClientSession | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closer: AsyncGenerator[None, None] | None = None

    @property
    def session(self) -> aiohttp.ClientSession | None:
        """The open session, or None (before the first call and after close())."""
        return self._session if self._session is not None and not self._session.closed else None

    def _open(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        if self._session is not None and (self._session.closed or self._loop is not loop):
            self._session = None  # closed, or of a loop that is gone (its connections went with it)
        if self._session is None:
            # No cap on connections (aiohttp's default is 100): a wait for a free one would
            # read as a worker that cannot be reached. No proxy from the environment.
            connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=self.keepalive_s)
            self._session = aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None))
            self._loop = loop
            self._closer = _close_with_loop(self, self._session)
        return self._session

    async def close(self) -> None:
        session, closer = self._session, self._closer
        self._session = self._loop = self._closer = None
        if closer is not None:
            await closer.aclose()  # closes the session, and no longer waits for the loop's end
        if session is not None and not session.closed:
            await session.close()

    @contextlib.asynccontextmanager
    async def _exchange(self, url: str, method: str, path: str, body: Any, timeout: float,
                        headers: Mapping[str, str] | None = None) -> AsyncIterator[aiohttp.ClientResponse]:
        """Send; the response once its head arrived (connect within ``timeout``, then the head
        within ``timeout``); the connection goes back to the pool when it was read whole."""
        data = None if body is None else json.dumps(body).encode()
        headers = {**self._headers, **(headers or {})}
        if data is not None:
            headers["Content-Type"] = "application/json"
        try:
            response = await self._open().request(
                method, url + path, data=data, headers=headers,
                timeout=aiohttp.ClientTimeout(total=None, connect=timeout, sock_read=timeout))
        except aiohttp.ConnectionTimeoutError:  # first: it is a TimeoutError too
            raise HttpError(f"{url}: cannot connect within {timeout:.1f}s", unreachable=True) from None
        except aiohttp.ClientConnectorError as exc:
            raise HttpError(f"{url}: cannot connect: {exc.strerror or _what(exc)}", unreachable=True) from None
        except asyncio.TimeoutError:
            raise HttpError(f"{url}{path}: no response within {timeout:.1f}s") from None
        except (aiohttp.ClientError, OSError, ValueError) as exc:  # refused, cut; a URL it cannot use
            raise HttpError(f"{url}{path}: connection cut before a response: {_what(exc)}", unreachable=True) from None
        try:
            yield response
        finally:
            # Back to the pool when read to its end, else closed (a stream given up on: the
            # server sees its client leave).
            response.release()

    async def _read(self, url: str, path: str, response: aiohttp.ClientResponse, timeout: float) -> bytes:
        try:
            return await asyncio.wait_for(response.read(), timeout)
        except asyncio.TimeoutError:
            raise HttpError(f"{url}{path}: response not complete within {timeout:.1f}s") from None
        except (aiohttp.ClientError, OSError) as exc:
            raise HttpError(f"{url}{path}: response cut: {_what(exc)}", unreachable=True) from None

    async def request_json(self, url: str, method: str, path: str, body: Any = None, timeout: float = 10.0, *,
                           headers: Mapping[str, str] | None = None) -> Any:
        """One JSON exchange; raises HttpError on a refused/cut connection, timeout or status >= 400."""
        async with self._exchange(url, method, path, body, timeout, headers) as response:
            data = await self._read(url, path, response, timeout)
        return decode(url, path, response.status, data)

    async def request_text(self, url: str, path: str, timeout: float = 10.0, *,
                           headers: Mapping[str, str] | None = None) -> str:
        """GET ``path``'s text; raises HttpError as request_json does."""
        async with self._exchange(url, "GET", path, None, timeout, headers) as response:
            data = await self._read(url, path, response, timeout)
        if response.status >= 400:
            raise HttpError(f"{url}{path}: HTTP {response.status}", response.status)
        return data.decode()

    async def stream_json(self, url: str, path: str, body: Any, timeout: float, idle_timeout: float, *,
                          headers: Mapping[str, str] | None = None) -> AsyncGenerator[dict[str, Any], None]:
        """POST ``body`` and yield each NDJSON event as it arrives.

        ``idle_timeout`` bounds the wait for each event; a connection cut before the stream's
        own end (an event with ``"final": true``) raises HttpError(unreachable=True). Closing
        the generator early closes the connection: the server sees its client leave.
        """
        async with self._exchange(url, "POST", path, body, timeout, headers) as response:
            if response.status >= 400:
                data = await self._read(url, path, response, timeout)
                raise HttpError(error_message(url, path, response.status, data), response.status)
            _no_read_timeout(response)  # from here on, idle_timeout per event
            async for line in _lines(url, path, response, idle_timeout):
                try:
                    event = json.loads(line)
                except ValueError:
                    raise HttpError(f"{url}{path}: stream event is not JSON: {line[:80]!r}") from None
                if not isinstance(event, dict):
                    raise HttpError(f"{url}{path}: stream event is not a JSON object: {line[:80]!r}")
                yield event
                if event.get("final"):
                    return


def _what(exc: BaseException) -> str:
    """An error of the exchange in one line: its type and message, never its repr. The repr
    of aiohttp's ClientResponseError (a malformed answer's head, say) holds the request's
    headers, the cluster key among them; this line is logged, and answered to API clients as
    a completion's error."""
    text = exc.message if isinstance(exc, aiohttp.ClientResponseError) else str(exc)
    # A parser's message spans lines, with a caret under the bad byte: one line of it.
    text = " ".join(" ".join(line.split()) for line in text.splitlines() if line.strip().strip("^"))
    text = text[:_WHAT_CHARS]
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


_WHAT_CHARS = 200
"""A message's length at most: what a peer sent back (a garbage head) goes into it."""


def _no_read_timeout(response: aiohttp.ClientResponse) -> None:
    """Lift the head's read timeout (``sock_read``) off a stream, as aiohttp does for a
    websocket: the stream's own wait per event is ``idle_timeout``."""
    protocol = response.connection.protocol if response.connection is not None else None
    if protocol is not None:
        protocol.read_timeout = None
        protocol.start_timeout()  # cancels the timer set for the head


async def _lines(url: str, path: str, response: aiohttp.ClientResponse, idle_timeout: float
                 ) -> AsyncIterator[bytes]:
    """Each line of the body, each within ``idle_timeout`` of the last, until it ends."""
    pending = bytearray()
    while True:
        try:
            chunk = await asyncio.wait_for(response.content.readany(), idle_timeout)
        except asyncio.TimeoutError:
            raise HttpError(f"{url}{path}: no event within {idle_timeout:.1f}s") from None
        except (aiohttp.ClientError, OSError) as exc:
            raise HttpError(f"{url}{path}: stream cut: {_what(exc)}", unreachable=True) from None
        if not chunk:
            raise HttpError(f"{url}{path}: stream ended before its final event", unreachable=True)
        pending += chunk
        while (end := pending.find(b"\n")) >= 0:
            line = bytes(pending[:end + 1])
            del pending[:end + 1]
            if line.strip():
                yield line
        if len(pending) > MAX_BODY:
            raise HttpError(f"{url}{path}: stream event too large: over {MAX_BODY} bytes")


def _close_with_loop(client: HttpClient, session: aiohttp.ClientSession) -> AsyncGenerator[None, None]:
    """Close ``session`` when its loop shuts down, if nothing closed it before: an async
    generator, started here, is closed by ``loop.shutdown_asyncgens()``, which ``asyncio.run``
    calls once its tasks are done (and by the loop's finalizer if it is dropped unclosed)."""
    async def closer() -> AsyncGenerator[None, None]:
        try:
            yield
        finally:
            if client._session is session:  # let go of the loop too: it may be collected
                client._session = client._loop = client._closer = None
            if not session.closed:
                await session.close()
    agen = closer()
    step = agen.asend(None)  # its first step: the running loop's first-iteration hook registers it
    try:
        step.send(None)
    except StopIteration:
        pass
    return agen  # the client holds it (the loop only weakly)


# --- one client per event loop, for the module's functions -------------------------------------
_DEFAULT: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, HttpClient] = weakref.WeakKeyDictionary()


def default_client() -> HttpClient:
    """The running loop's shared client (made now if it has none)."""
    loop = asyncio.get_running_loop()
    client = _DEFAULT.get(loop)
    if client is None:
        client = _DEFAULT[loop] = HttpClient()
    return client


async def close_default_client() -> None:
    """Close the running loop's shared client now (the next call makes another)."""
    client = _DEFAULT.pop(asyncio.get_running_loop(), None)
    if client is not None:
        await client.close()


async def request_json(url: str, method: str, path: str, body: Any = None, timeout: float = 10.0, *,
                       headers: Mapping[str, str] | None = None) -> Any:
    """One JSON exchange; raises HttpError on a refused/cut connection, timeout or status >= 400."""
    return await default_client().request_json(url, method, path, body, timeout, headers=headers)


async def request_text(url: str, path: str, timeout: float = 10.0, *, headers: Mapping[str, str] | None = None) -> str:
    return await default_client().request_text(url, path, timeout, headers=headers)


async def stream_json(url: str, path: str, body: Any, timeout: float, idle_timeout: float, *,
                      headers: Mapping[str, str] | None = None) -> AsyncGenerator[dict[str, Any], None]:
    """``HttpClient.stream_json`` on the running loop's shared client."""
    events = default_client().stream_json(url, path, body, timeout, idle_timeout, headers=headers)
    try:
        async for event in events:
            yield event
    finally:
        await events.aclose()
