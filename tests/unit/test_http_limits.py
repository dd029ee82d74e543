"""The HTTP doors hold against what a careless or hostile client sends: JSON nested too deep,
connections that send nothing, more connections than the server takes, a body over the limit,
and requests the workers' model cannot serve. Real servers on 127.0.0.1, raw sockets."""

from __future__ import annotations

import asyncio
import json

from test_router import CFG, cluster  # noqa: I001 - pytest puts tests/unit on sys.path

from kvxfer.router.router import Router
from kvxfer.router.serve import make_handler as router_handler
from kvxfer.serving.http import MAX_BODY, HttpServer, Request, Response


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


def _post(path: str, body: bytes, length: int | None = None) -> bytes:
    size = len(body) if length is None else length
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {size}\r\n\r\n").encode() + body


def test_json_nested_too_deep_is_a_400_not_a_500() -> None:
    async def main() -> None:
        server = HttpServer(_echo)
        port = await server.start()
        try:
            answer = await _raw(port, _post("/", b"[" * 100_000 + b"]" * 100_000))
            assert answer.startswith(b"HTTP/1.1 400") and b"nested too deep" in answer, answer[:200]
            assert (await _raw(port, _post("/", b"[[1]]"))).endswith(b'{"got": [[1]]}')  # still serving
        finally:
            await server.close()

    asyncio.run(main())


def test_a_content_length_of_other_digits_is_a_400() -> None:
    async def main() -> None:
        server = HttpServer(_echo)
        port = await server.start()
        try:
            head = "POST / HTTP/1.1\r\nContent-Length: \u00b2\r\n\r\n".encode()  # "²".isdigit() is True
            answer = await _raw(port, head)
            assert answer.startswith(b"HTTP/1.1 400") and b"is not a byte count" in answer, answer[:200]
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
            assert answer.startswith(b"HTTP/1.1 503") and b"connections are open" in answer, answer
            for _, writer in held:
                writer.close()
            await asyncio.sleep(0.1)
            assert (await _raw(port, _post("/", b"{}"))).startswith(b"HTTP/1.1 200")
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
            assert answer.startswith(b"HTTP/1.1 400") and b"over the limit" in answer, answer[:200]
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
                    assert answer.startswith(b"HTTP/1.1 400") and words.encode() in answer, (body, answer[:300])
                ok = await _raw(port, _post("/generate", json.dumps({"prompt": [1, 2, 3], "max_new_tokens": 2}).encode()))
                assert ok.startswith(b"HTTP/1.1 200") and b'"error": null' in ok, ok[-400:]
            finally:
                await server.close()
                await router.close()

    asyncio.run(main())
