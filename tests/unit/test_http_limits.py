"""The HTTP doors hold against what a careless or hostile client sends: JSON nested too deep,
connections that send nothing, more connections than the server takes, a body or a header
over the limit, a body that never comes, and requests the workers' model cannot serve. Real
servers on 127.0.0.1, raw sockets (each request says ``Connection: close``, so that the
server's close ends the answer)."""

from __future__ import annotations

import asyncio
import json

import pytest
from test_router import CFG, cluster  # noqa: I001 - pytest puts tests/unit on sys.path

from kvxfer.router.app import make_handler as router_handler
from kvxfer.router.router import Router
from kvxfer.serving.http import MAX_BODY, MAX_HEADER, HttpServer, Request, Response


async def _echo(request: Request) -> Response:
    return Response.json({"got": request.json()})


async def _raw(port: int, data: bytes, *, read: bool = True) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        await writer.drain()
        return await asyncio.wait_for(reader.read(), 10.0) if read else b""
    finally:
        writer.close()


def _post(path: str, body: bytes, length: int | None = None, extra: str = "") -> bytes:
    size = len(body) if length is None else length
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n{extra}Content-Length: {size}\r\n\r\n"
            ).encode() + body


def _status(answer: bytes) -> int:
    """The status of an answer. A request the parser refuses is answered as HTTP/1.0 (its
    version was never read), any other as HTTP/1.1."""
    assert answer[:9] in (b"HTTP/1.1 ", b"HTTP/1.0 "), answer[:200]
    return int(answer[9:12])


def test_json_nested_too_deep_is_a_400_not_a_500() -> None:
    async def main() -> None:
        server = HttpServer(_echo)
        port = await server.start()
        try:
            answer = await _raw(port, _post("/", b"[" * 100_000 + b"]" * 100_000))
            assert _status(answer) == 400 and b"nested too deep" in answer, answer[:200]
            assert (await _raw(port, _post("/", b"[[1]]"))).endswith(b'{"got": [[1]]}')  # still serving
        finally:
            await server.close()

    asyncio.run(main())


def test_a_content_length_of_other_digits_is_a_400() -> None:
    async def main() -> None:
        server = HttpServer(_echo)
        port = await server.start()
        try:
            for value in ("\u00b2", "abc", "-1", " 1e3", "99999999999999999999999"):  # "²".isdigit() is True
                head = f"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: {value}\r\n\r\n".encode()
                answer = await _raw(port, head)
                assert _status(answer) == 400 and b"Content-Length" in answer, (value, answer[:300])
                assert b'"got"' not in answer  # the handler never saw it
        finally:
            await server.close()

    asyncio.run(main())


def test_idle_connections_are_closed_after_the_read_timeout() -> None:
    async def main() -> None:
        server = HttpServer(_echo, read_timeout_s=0.5)
        port = await server.start()
        try:
            streams = [await asyncio.open_connection("127.0.0.1", port) for _ in range(20)]
            # Each sends half a request line and then nothing: the server must hang up on all.
            for _, writer in streams:
                writer.write(b"POST / HT")
            ends = await asyncio.wait_for(asyncio.gather(*(r.read() for r, _ in streams)), 5.0)
            assert ends == [b""] * 20
            for _, writer in streams:
                writer.close()
        finally:
            await server.close()

    asyncio.run(main())


def test_connections_past_the_cap_are_answered_503() -> None:
    async def main() -> None:
        server = HttpServer(_echo, read_timeout_s=5.0, max_connections=4)
        port = await server.start()
        try:
            held = [await asyncio.open_connection("127.0.0.1", port) for _ in range(4)]
            await asyncio.sleep(0.1)  # the server has accepted all four
            answer = await _raw(port, _post("/", b"{}"))
            assert _status(answer) == 503 and b"connections are open" in answer, answer
            for _, writer in held:
                writer.close()
            await asyncio.sleep(0.1)
            assert _status(await _raw(port, _post("/", b"{}"))) == 200
        finally:
            await server.close()

    asyncio.run(main())


def test_a_body_over_the_limit_gets_its_400_not_a_reset() -> None:
    async def main() -> None:
        server = HttpServer(_echo)
        port = await server.start()
        try:
            # The client sends 4 MiB of its announced body before it reads the answer.
            answer = await _raw(port, _post("/", b"x" * (4 << 20), length=MAX_BODY + 1))
            assert _status(answer) == 400 and b"over the limit" in answer, answer[:200]
        finally:
            await server.close()

    asyncio.run(main())


def test_the_router_refuses_what_the_workers_model_cannot_serve_with_400() -> None:
    async def main() -> None:
        async with cluster() as c:
            router = Router(c.prefill, c.decode)
            server = HttpServer(router_handler(router))
            port = await server.start()
            try:
                cases = [({"prompt": [1, CFG.vocab_size], "max_new_tokens": 2}, "token ids must lie in [0, 128)"),
                         ({"prompt": [-1, 2], "max_new_tokens": 2}, "token ids must lie in [0, 128)"),
                         ({"prompt": [1] * (CFG.max_positions + 1), "max_new_tokens": 1}, "positions"),
                         ({"prompt": [1, 2], "max_new_tokens": 10**9}, "over the workers' model's"),
                         ({"prompt": [1, 2], "max_new_tokens": "many"}, "positive integer")]
                for body, words in cases:
                    answer = await _raw(port, _post("/generate", json.dumps(body).encode()))
                    assert _status(answer) == 400 and words.encode() in answer, (body, answer[:300])
                ok = await _raw(port, _post("/generate", json.dumps({"prompt": [1, 2, 3], "max_new_tokens": 2}).encode()))
                assert _status(ok) == 200 and b'"error": null' in ok, ok[-400:]
            finally:
                await server.close()
                await router.close()

    asyncio.run(main())


def test_headers_over_the_limit_and_bodies_that_never_come_whole_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    import kvxfer.serving.server as server_module

    monkeypatch.setattr(server_module, "MAX_BODY", 1000)  # a chunked body over it, cheaply

    async def main() -> None:
        server = HttpServer(_echo, read_timeout_s=0.5)
        port = await server.start()
        try:
            # One header line over MAX_HEADER: the parser refuses it.
            answer = await _raw(port, _post("/", b"{}", extra=f"X-Big: {'a' * (MAX_HEADER + 1)}\r\n"))
            assert _status(answer) == 400 and b"malformed request" in answer, answer[:300]
            # Lines under it, together over it.
            many = "".join(f"X-H{i}: {'a' * 1000}\r\n" for i in range(80))
            answer = await _raw(port, _post("/", b"{}", extra=many))
            assert _status(answer) == 400 and b"header too large" in answer, answer[:300]
            # A body announced and never sent: answered 408 at the read timeout, not held.
            started = asyncio.get_running_loop().time()
            answer = await _raw(port, _post("/", b"{", length=10))
            assert _status(answer) == 408 and b"body not received within 0.5s" in answer, answer[:300]
            assert asyncio.get_running_loop().time() - started < 5.0
            # The client says it is done (EOF) before its body is whole: answered at once.
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(_post("/", b"{", length=10))
            writer.write_eof()
            answer = await asyncio.wait_for(reader.read(), 2.0)
            writer.close()
            assert _status(answer) == 400 and b"before its body was whole" in answer, answer[:300]
            # A chunked body says its size only as it comes: refused once past MAX_BODY.
            chunks = b"".join(b"%x\r\n%s\r\n" % (300, b"x" * 300) for _ in range(4)) + b"0\r\n\r\n"
            head = b"POST / HTTP/1.1\r\nHost: x\r\nConnection: close\r\nTransfer-Encoding: chunked\r\n\r\n"
            answer = await _raw(port, head + chunks)
            assert _status(answer) == 400 and b"body is over the limit of 1000 bytes" in answer, answer[:300]
        finally:
            await server.close()

    asyncio.run(main())
