"""Malformed input to the workers' and the router's HTTP APIs gets a 4xx naming what is wrong."""

from __future__ import annotations

import asyncio
import json

import pytest
from test_router import cluster  # noqa: I001 - pytest puts tests/unit on sys.path

from kvxfer.router import Router
from kvxfer.router.app import make_handler as router_handler
from kvxfer.serving.http import HttpError, HttpServer, Request, Response, request_json, request_text


async def _raw(port: int, data: bytes) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    await writer.drain()
    out = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    return out


def test_bad_content_length_is_a_400_and_a_failing_handler_a_500() -> None:
    async def handler(request: Request) -> Response:
        if request.path == "/boom":
            raise ValueError("handler bug")
        return Response.json({"ok": True})

    async def main() -> None:
        server = HttpServer(handler)
        port = await server.start()
        try:
            # Refused by the parser, which answers as HTTP/1.0 (the request's version was never read).
            out = await _raw(port, b"POST /x HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n")
            assert out.startswith(b"HTTP/1.0 400") and b"Invalid character in Content-Length" in out, out
            assert b"application/json" in out and b'"error": "malformed request: ' in out, out
            out = await _raw(port, b"POST /x HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\n\r\n")
            assert out.startswith(b"HTTP/1.0 400"), out
            with pytest.raises(HttpError) as info:
                await request_json(f"http://127.0.0.1:{port}", "GET", "/boom")
            assert info.value.status == 500 and "ValueError: handler bug" in str(info.value)
        finally:
            await server.close()

    asyncio.run(main())


def test_worker_flags_and_timeouts_must_have_their_json_types() -> None:
    """``rows_safe: "false"`` used to read as true (rows a peer may write into were reused);
    a string timeout was a 500 (ValueError) instead of a 400."""
    async def main() -> None:
        async with cluster(0, 1) as c:
            d = c.decode[0]
            await request_json(d, "POST", "/reserve", {"request": "a", "prompt": list(range(10)),
                                                      "max_new_tokens": 2, "publisher": {"agent": "p", "run": "1"}})
            cases = [("/abort", {"request": "a", "rows_safe": "false"}, "'rows_safe' must be true or false"),
                     ("/generate", {"request": "a", "timeout_s": "soon"}, "'timeout_s' must be a positive number"),
                     ("/generate", {"request": "a", "timeout_s": -1}, "'timeout_s' must be a positive number"),
                     # an int past a float's range was a 500 (OverflowError in float())
                     ("/generate", {"request": "a", "timeout_s": 10**400}, "'timeout_s' must be a positive number"),
                     ("/generate", {"request": "a", "rows_safe": 1}, "'rows_safe' must be true or false")]
            for path, body, words in cases:
                with pytest.raises(HttpError) as info:
                    await request_json(d, "POST", path, body)
                assert info.value.status == 400 and words in str(info.value), (path, str(info.value))
            health = await request_json(d, "GET", "/health")
            assert health["reserved"] == 1  # nothing was dropped by the refused calls
            await request_json(d, "POST", "/abort", {"request": "a", "rows_safe": False})
            assert "kvxfer_quarantined_slots 3.0\n" in await request_text(d, "/metrics")

    asyncio.run(main())


def test_router_refuses_boolean_token_ids() -> None:
    async def main() -> None:
        server = HttpServer(router_handler(Router([], ["http://127.0.0.1:9"])))
        port = await server.start()
        try:
            for body, words in (({"prompt": [True, 2]}, "'prompt'"), ({"prompt": [1], "max_new_tokens": True},
                                                                       "'max_new_tokens'")):
                with pytest.raises(HttpError) as info:
                    await request_json(f"http://127.0.0.1:{port}", "POST", "/generate", body)
                assert info.value.status == 400 and words in str(info.value)
        finally:
            await server.close()

    asyncio.run(main())


def test_a_transfer_past_its_deadline_is_recomputed_on_the_same_decode_worker() -> None:
    """Policy recompute: the decode worker cancels a fetch at ``timeout_s`` and resumes; the
    router's idle timer for /generate used to be the same ``timeout_s``, so it always fired
    first and the request failed ("no other decode worker to recompute on")."""
    from test_router import backend, oracle  # noqa: I001 - pytest puts tests/unit on sys.path

    from kvxfer.engine import synthetic_prompts
    from kvxfer.router import Router

    prompt = synthetic_prompts(1, 30, 30, 128, seed=4)[0]

    async def main() -> None:
        async with cluster() as c:
            backend(c.workers[c.prefill[0]]).delay_s = 4.0  # the publisher holds its rows past the deadline
            done = await Router(c.prefill, c.decode, on_failure="recompute", timeout_s=1.0).generate(prompt, 4)
            assert done.ok, (done.error, done.events)
            assert list(done.tokens) == oracle(prompt, 4)
            assert done.decode == c.decode[0] and done.path == "resumed"

    asyncio.run(main())


def test_long_stream_events_bad_lines_and_an_idle_client_at_close() -> None:
    """A stream event longer than asyncio's default line limit (64 KiB: a hint of a few
    thousand rows) is read whole; a line that is not JSON is an HttpError, not a crash; and
    close() returns while an idle client holds a connection open (from Python 3.12
    wait_closed() waited for it)."""
    from kvxfer.serving.http import stream_json

    big = "x" * (1 << 20)

    async def handler(request: Request) -> Response:
        async def events():  # type: ignore[no-untyped-def]
            if request.path == "/junk":
                yield b"not json\n"
                return
            yield (json.dumps({"event": "published", "hint": big}) + "\n").encode()
            yield b'{"final": true}\n'
        return Response(200, b"", "application/x-ndjson", events())

    async def main() -> None:
        server = HttpServer(handler)
        port = await server.start()
        url = f"http://127.0.0.1:{port}"
        idle_reader, idle_writer = await asyncio.open_connection("127.0.0.1", port)  # sends nothing
        try:
            got = [e async for e in stream_json(url, "/publish", {}, 10, 10)]
            assert got[0]["hint"] == big and got[-1] == {"final": True}
            with pytest.raises(HttpError, match="not JSON"):
                _ = [e async for e in stream_json(url, "/junk", {}, 10, 10)]
        finally:
            await asyncio.wait_for(server.close(), 5)
            idle_writer.close()

    asyncio.run(main())
