"""The HTTP stack under the workers and the router (aiohttp): HEAD, chunked request bodies,
one pooled session carrying many calls over one connection, the access log and the router's
warning when a worker call fails, and nothing left running once the router, its session, the
workers and their servers are closed."""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import re
import socket
import warnings
from collections.abc import AsyncIterator

import aiohttp
import pytest
from test_router import cluster, oracle  # noqa: I001 - pytest puts tests/unit on sys.path

from kvxfer.router import Router
from kvxfer.router.app import make_handler as router_handler
from kvxfer.serving.http import (
    HttpClient,
    HttpServer,
    Request,
    Response,
    check_url,
    default_client,
    request_json,
    stream_json,
)

LINE = re.compile(r"^(GET|HEAD|POST) (/\S*) (\d{3}) \d+\.\d{4}s(?:: (.+))?$")


async def _echo(request: Request) -> Response:
    if request.path == "/stream":
        async def events() -> AsyncIterator[dict[str, object]]:
            for i in range(3):
                yield {"i": i}
            yield {"final": True}
        return Response.ndjson(events())  # type: ignore[arg-type]
    if request.path == "/missing":
        return Response.json({"error": "no such thing"}, 404)
    return Response.json({"method": request.method, "got": request.json(),
                          "chunked": request.headers.get("transfer-encoding") == "chunked"})


async def _raw(port: int, data: bytes) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        await writer.drain()
        return await asyncio.wait_for(reader.read(), 10.0)
    finally:
        writer.close()


def test_head_answers_as_get_does_without_the_body() -> None:
    async def main() -> None:
        server = HttpServer(_echo)
        port = await server.start()
        router = Router([], ["http://127.0.0.1:9"])
        front = HttpServer(router_handler(router))
        front_port = await front.start()
        try:
            get = await _raw(port, b"GET /x HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            head = await _raw(port, b"HEAD /x HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            get_head, _, get_body = get.partition(b"\r\n\r\n")
            head_head, _, head_body = head.partition(b"\r\n\r\n")
            assert head_head.startswith(b"HTTP/1.1 200") and head_body == b"", head
            assert json.loads(get_body) == {"method": "GET", "got": {}, "chunked": False}
            length = f"Content-Length: {len(get_body)}".encode()
            assert length in get_head and length in head_head
            # The router's /metrics and /health, with aiohttp's client.
            async with aiohttp.ClientSession() as session:
                # /health is 503 here: its one decode worker (port 9) does not answer.
                for path, status in (("/metrics", 200), ("/health", 503)):
                    async with session.head(f"http://127.0.0.1:{front_port}{path}") as answer:
                        assert answer.status == status and await answer.read() == b"", path
                        assert int(answer.headers["Content-Length"]) > 0
                        kind = "text/plain" if path == "/metrics" else "application/json"
                        assert answer.headers["Content-Type"].startswith(kind)
        finally:
            await front.close()
            await router.close()
            await server.close()

    asyncio.run(main())


def test_chunked_request_bodies_are_read_whole() -> None:
    async def main() -> None:
        server = HttpServer(_echo)
        port = await server.start()
        try:
            body = json.dumps({"prompt": list(range(500))}).encode()
            chunks = b"".join(b"%x\r\n%s\r\n" % (len(body[i:i + 100]), body[i:i + 100])
                              for i in range(0, len(body), 100)) + b"0\r\n\r\n"
            answer = await _raw(port, b"POST /x HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                                      b"Transfer-Encoding: chunked\r\n\r\n" + chunks)
            assert answer.startswith(b"HTTP/1.1 200"), answer[:200]
            got = json.loads(answer.partition(b"\r\n\r\n")[2])
            assert got == {"method": "POST", "got": {"prompt": list(range(500))}, "chunked": True}

            async def pieces() -> AsyncIterator[bytes]:  # aiohttp sends a generator's body chunked
                for i in range(0, len(body), 333):
                    yield body[i:i + 333]
            async with aiohttp.ClientSession() as session:
                async with session.post(f"http://127.0.0.1:{port}/x", data=pieces()) as reply:
                    assert reply.status == 200
                    assert await reply.json() == got
        finally:
            await server.close()

    asyncio.run(main())


def test_one_session_carries_many_calls_over_one_connection() -> None:
    async def main() -> None:
        server = HttpServer(_echo)
        port = await server.start()
        url = f"http://127.0.0.1:{port}"
        client = HttpClient()
        try:
            assert client.session is None  # opened on first use
            for i in range(5):
                assert (await client.request_json(url, "POST", "/x", {"n": i}))["got"] == {"n": i}
                assert server.connections == 1, server.connections  # the same connection, kept alive
            session = client.session
            assert session is not None
            events = [e async for e in client.stream_json(url, "/stream", {}, 5.0, 5.0)]
            assert events[-1] == {"final": True} and client.session is session
            assert (await client.request_json(url, "GET", "/x"))["method"] == "GET"
            assert server.connections <= 2
            # The module's functions: one shared client per loop.
            shared = default_client()
            await request_json(url, "GET", "/x")
            assert [e async for e in stream_json(url, "/stream", {}, 5.0, 5.0)][-1] == {"final": True}
            assert default_client() is shared and shared.session is not None
        finally:
            await client.close()
            assert client.session is None
            await server.close()
        assert server.connections == 0

    asyncio.run(main())


def test_every_request_gets_an_access_log_line(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="kvxfer.test.access")

    async def main() -> None:
        server = HttpServer(_echo, access_log="kvxfer.test.access")
        port = await server.start()
        url = f"http://127.0.0.1:{port}"
        client = HttpClient()
        try:
            await client.request_json(url, "POST", "/x", {"a": 1})
            [e async for e in client.stream_json(url, "/stream", {}, 5.0, 5.0)]
            with pytest.raises(Exception, match="HTTP 404"):
                await client.request_json(url, "GET", "/missing")
            await _raw(port, b"HEAD /x HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            await _raw(port, b"GARBAGE\r\n\r\n")
        finally:
            await client.close()
            await server.close()

    asyncio.run(main())
    lines = [r.getMessage() for r in caplog.records if r.name == "kvxfer.test.access"]
    assert all(r.levelno == logging.INFO for r in caplog.records if r.name == "kvxfer.test.access")
    parsed = [LINE.match(line) for line in lines[:4]]
    assert all(parsed), lines
    # A refusal's line says why (its JSON error's message); the others say no more.
    assert [m.groups() for m in parsed if m] == [("POST", "/x", "200", None), ("POST", "/stream", "200", None),
                                                 ("GET", "/missing", "404", "no such thing"),
                                                 ("HEAD", "/x", "200", None)], lines
    assert len(lines) == 5 and " 400 " in lines[4], lines  # the malformed one too
    assert "s: malformed request: " in lines[4], lines


def test_the_router_warns_when_a_worker_call_fails(caplog: pytest.LogCaptureFixture) -> None:
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{probe.getsockname()[1]}"

    async def main() -> None:
        router = Router([], [dead], on_failure="recompute")
        try:
            done = await router.generate([1, 2, 3], 2)
            assert not done.ok
        finally:
            await router.close()

    with caplog.at_level(logging.WARNING, logger="kvxfer.router"):
        asyncio.run(main())
    warned = [r for r in caplog.records if r.name == "kvxfer.router" and r.levelno == logging.WARNING]
    assert warned and f"decode worker {dead} failed: {dead}: cannot connect" in warned[0].getMessage(), warned


def test_worker_urls_need_a_host_and_a_port() -> None:
    assert check_url("http://127.0.0.1:8001/") == "http://127.0.0.1:8001"
    for bad in ("http://127.0.0.1", "127.0.0.1:8001", "http://:8001", "https://h:1", "http://h:1/x", "http://[::1"):
        with pytest.raises(ValueError, match="give http://HOST:PORT"):
            Router([], [bad])


def test_closing_the_router_and_the_workers_leaves_nothing_running() -> None:
    prompt = [3, 1, 4, 1, 5]
    seen: dict[str, object] = {}

    async def main() -> None:
        async with cluster() as c:
            router = Router(c.prefill, c.decode)
            front = HttpServer(router_handler(router))
            port = await front.start()
            done = await router.generate(prompt, 4)
            assert done.ok and list(done.tokens) == oracle(prompt, 4), done.error
            events = [e async for e in stream_json(f"http://127.0.0.1:{port}", "/generate",
                                                   {"prompt": prompt, "max_new_tokens": 2}, 10.0, 10.0)]
            assert events[-1]["final"] is True
            seen["router_session"] = router._http.session
            seen["default"] = default_client()
            assert seen["router_session"] is not None
            await front.close()
            await router.close()
            assert router._http.session is None and front.connections == 0
            servers = c.servers
        for server in servers:
            assert server.connections == 0
            with pytest.raises(OSError):  # nothing listens there any more
                await asyncio.open_connection("127.0.0.1", server.port)
        assert asyncio.all_tasks() == {asyncio.current_task()}

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        asyncio.run(main())
        gc.collect()
    # The loop's shared client (the /generate above) was closed as asyncio.run shut down.
    assert seen["default"].session is None  # type: ignore[attr-defined]
    leaks = [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)]
    assert leaks == [], leaks
