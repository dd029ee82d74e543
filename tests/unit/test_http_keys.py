"""Keys on the HTTP doors (kvxfer.serving.keys): the router's API key on its OpenAI routes and
/generate, the workers' cluster key on every control route, /health and /metrics open on
both; a missing or wrong key answered 401 in OpenAI's error shape; the key in no log line,
answer or repr; and the one-line warning of a server that listens beyond this machine with
no key. Real workers and a real router behind real HTTP servers on port 0 (test_router's
cluster: loopback backend)."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
from pathlib import Path

import aiohttp
import pytest
from test_router import cluster, oracle  # noqa: I001 - pytest puts tests/unit on sys.path

from kvxfer import pair
from kvxfer.doctor import peer as doctor_peer
from kvxfer.doctor import report as doctor
from kvxfer.router import Router
from kvxfer.router import serve as router_serve
from kvxfer.router.app import make_handler as router_handler
from kvxfer.serving.client import HttpClient
from kvxfer.serving.http import HttpError, HttpServer, request_json, request_text
from kvxfer.serving.keys import BearerKey, InvalidKey, is_loopback, keys_from_args, open_door_warning
from kvxfer.worker import serve as worker_serve

API = BearerKey("sk-api-0123456789abcdef", "test")
CLUSTER = BearerKey("cluster-fedcba9876543210", "test")
WRONG = "sk-wrong-5555555555555555"
PROMPT = [3, 1, 4, 1, 5, 9, 2, 6, 5]
CONTROL = [("POST", "/prefill", {"request": "k", "prompt": [1, 2]}),
           ("POST", "/publish", {"request": "k", "hint": "AAAA"}),
           ("POST", "/reserve", {"request": "k", "prompt": [1, 2], "max_new_tokens": 2}),
           ("POST", "/generate", {"request": "k"}), ("POST", "/abort", {"request": "k"}),
           ("POST", "/withdraw", {"hint": "AAAA"}), ("GET", "/doctor/probe", None),
           ("POST", "/doctor/probe", {"bytes": 1 << 20}), ("DELETE", "/doctor/probe/x", None)]


async def _ask(session: aiohttp.ClientSession, method: str, url: str, body: object = None,
               key: str | None = None) -> tuple[int, dict[str, str], bytes]:
    headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
    async with session.request(method, url, json=body, headers=headers) as answer:
        return answer.status, dict(answer.headers), await answer.read()


def _is_401(status: int, headers: dict[str, str], data: bytes, sent: str | None) -> None:
    assert status == 401, (status, data)
    error = json.loads(data)["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert error["type"] == "invalid_request_error" and error["code"] == "invalid_api_key"
    assert error["message"].startswith("no key" if sent is None else "wrong key"), error
    assert headers.get("WWW-Authenticate", "").startswith("Bearer"), headers
    if sent is not None:
        assert sent not in data.decode()  # what a client sent is never answered back


def test_the_router_wants_its_api_key_on_openai_routes_and_generate_only(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)

    async def main() -> None:
        async with cluster() as c, Router(c.prefill, c.decode) as router:
            server = HttpServer(router_handler(router, api_key=API))
            url = f"http://127.0.0.1:{await server.start()}"
            try:
                async with aiohttp.ClientSession() as session:
                    for method, path, body in (("POST", "/v1/completions", {"model": "x", "prompt": [1]}),
                                               ("POST", "/v1/chat/completions", {"model": "x", "messages": []}),
                                               ("GET", "/v1/models", None), ("POST", "/generate", {"prompt": [1]}),
                                               ("GET", "/elsewhere", None)):
                        for sent in (None, WRONG, API.secret.upper(), API.secret[:-1]):
                            _is_401(*await _ask(session, method, url + path, body, sent), sent)
                    for path in ("/health", "/health/", "/", "/metrics"):
                        assert (await _ask(session, "GET", url + path))[0] == 200, path
                    async with session.head(url + "/health") as answer:
                        assert answer.status == 200
                    assert (await _ask(session, "GET", url + "/v1/models", key=API.secret))[0] == 200
                    status, _, data = await _ask(session, "POST", url + "/generate",
                                                 {"prompt": PROMPT, "max_new_tokens": 4}, f"  {API.secret} ")
                    assert status == 200, data
                    done = json.loads(data.splitlines()[-1])["completion"]
                    assert done["tokens"] == oracle(PROMPT, 4), done
                    # The scheme's case is free (RFC 9110), and the key then compared exactly.
                    async with session.get(url + "/v1/models", headers={"authorization": f"bearer {API.secret}"}) as a:
                        assert a.status == 200
                # kvxfer pair sends the router's API key (KVXFER_API_KEY) with each request.
                expected = oracle(PROMPT, 4)
                [sent] = await pair.run_workload(url, [PROMPT], [expected], 4, 1, 10.0, pair.Progress(1, enabled=False),
                                                 API)
                assert sent.matched, sent.error
                [unsent] = await pair.run_workload(url, [PROMPT], [expected], 4, 1, 10.0,
                                                   pair.Progress(1, enabled=False))
                assert "HTTP 401" in (unsent.error or ""), unsent.error
            finally:
                await server.close()

    asyncio.run(main())
    assert "/v1/completions 401" in caplog.text  # the access log saw them, without a key
    assert API.secret not in caplog.text and WRONG not in caplog.text


def test_workers_want_the_cluster_key_on_every_control_route_and_the_router_sends_it(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)

    async def main() -> None:
        async with cluster(cluster_key=CLUSTER) as c:
            p, d = c.prefill[0], c.decode[0]
            async with aiohttp.ClientSession() as session:
                for url in (p, d):
                    for method, path, body in CONTROL:
                        for sent in (None, WRONG):
                            _is_401(*await _ask(session, method, url + path, body, sent), sent)
                    for path in ("/health", "/metrics", "/"):
                        assert (await _ask(session, "GET", url + path))[0] == 200, (url, path)
                # A 401 comes before the body is read as a call: nothing was reserved or held.
                for url in (p, d):
                    health = await request_json(url, "GET", "/health")
                    assert health["held"] == 0 and health.get("reserved", 0) == 0, health
                metrics = await (await session.get(d + "/metrics")).text()
                assert 'kvxfer_worker_requests_total{endpoint="reserve",result="unauthorized"} 2.0' in metrics
            async with Router(c.prefill, c.decode, cluster_key=CLUSTER) as router:
                done = await router.generate(PROMPT, 5)
                assert done.ok and list(done.tokens) == oracle(PROMPT, 5), done.error
            async with Router(c.prefill, c.decode) as router:  # without the key
                done = await router.generate(PROMPT, 5)
                assert not done.ok and "HTTP 401" in (done.error or "") and "cluster key" in (done.error or "")
            async with Router(c.prefill, c.decode, cluster_key=BearerKey(WRONG)) as router:
                assert "HTTP 401" in ((await router.generate(PROMPT, 5)).error or "")
            # With the cluster key, a worker's control route answers as before.
            with pytest.raises(HttpError) as info:
                await request_json(p, "POST", "/prefill", {"request": "x", "prompt": []}, headers=CLUSTER.headers())
            assert info.value.status == 400
            for url in (p, d):
                health = await request_json(url, "GET", "/health")
                assert health["held"] == 0, health

    asyncio.run(main())
    assert "/reserve 401" in caplog.text
    assert CLUSTER.secret not in caplog.text and WRONG not in caplog.text


def test_a_key_is_read_whole_and_refused_by_its_source_never_by_its_value(tmp_path: Path) -> None:
    path = tmp_path / "key"
    path.write_text(f"  {API.secret}\n")
    loaded = BearerKey.from_file(str(path), "--api-key-file")
    assert loaded.secret == API.secret and loaded.source == f"--api-key-file {path}"
    assert API.secret not in repr(loaded) and API.secret not in str(loaded)
    assert BearerKey.from_env("K", {"K": f" {API.secret}\n"}) == BearerKey(API.secret, "K")
    assert BearerKey.from_env("K", {"K": "  "}) is None and BearerKey.from_env("K", {}) is None
    for secret, words in (("", "is empty"), ("two words", "a space"), ("caf\u00e9-key", "non-ASCII"),
                          ("x" * 5000, "over 4096 characters")):
        with pytest.raises(InvalidKey, match=words) as info:
            BearerKey(secret, "KVXFER_API_KEY")
        assert str(info.value).startswith("KVXFER_API_KEY") and (not secret or secret not in str(info.value))
    with pytest.raises(InvalidKey, match="cannot read a key there"):
        BearerKey.from_file(str(tmp_path / "absent"), "--cluster-key-file")
    key = BearerKey("abc")
    assert key.accepts("Bearer abc") and key.accepts("BEARER  abc ") and not key.accepts("Bearer abcd")
    assert not key.accepts("Basic abc") and not key.accepts("abc") and not key.accepts(None)
    assert not key.accepts("Bearer ab\u00e7")
    asked = BearerKey("ab?")  # a non-ASCII character sent is not taken for the '?'
    assert asked.accepts("Bearer ab?") and not asked.accepts("Bearer ab\u00e7") and not asked.accepts("Bearer ab\udcff")
    assert key.headers() == {"Authorization": "Bearer abc"}


def _parsed(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    args = parser.parse_args(argv)
    keys_from_args(parser, args)
    return args


def test_the_command_lines_take_a_key_from_a_flag_a_file_or_the_environment(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv("KVXFER_API_KEY", raising=False)
    monkeypatch.delenv("KVXFER_CLUSTER_KEY", raising=False)
    router, worker = router_serve.build_parser(), worker_serve.build_parser()
    base = ["--decode", "http://127.0.0.1:9"]
    args = _parsed(router, base)
    assert args.api_key is None and args.cluster_key is None
    monkeypatch.setenv("KVXFER_API_KEY", API.secret)
    monkeypatch.setenv("KVXFER_CLUSTER_KEY", CLUSTER.secret)
    args = _parsed(router, base)
    assert args.api_key == BearerKey(API.secret, "KVXFER_API_KEY") and args.cluster_key.secret == CLUSTER.secret
    (tmp_path / "api").write_text("from-file\n")
    (tmp_path / "cluster").write_text("cluster-from-file")
    args = _parsed(router, [*base, "--api-key-file", str(tmp_path / "api"), "--cluster-key-file",
                            str(tmp_path / "cluster")])
    assert args.api_key.secret == "from-file" and args.cluster_key.secret == "cluster-from-file"
    assert _parsed(router, [*base, "--api-key", "from-flag"]).api_key.secret == "from-flag"
    assert _parsed(worker, ["--role", "decode"]).cluster_key.secret == CLUSTER.secret
    assert not hasattr(_parsed(worker, ["--role", "decode"]), "api_key")  # a worker has no API door
    for argv, words in (([*base, "--api-key", "a", "--api-key-file", str(tmp_path / "api")], "give one"),
                        ([*base, "--api-key", "two words"], "--api-key holds a space"),
                        ([*base, "--cluster-key-file", str(tmp_path / "none")], "--cluster-key-file")):
        with pytest.raises(SystemExit) as stopped:
            _parsed(router, argv)
        assert stopped.value.code == 2
        err = capsys.readouterr().err
        assert words in err and "two words" not in err, err


def test_a_server_beyond_loopback_with_no_key_says_so_in_one_line() -> None:
    for host in ("127.0.0.1", "127.0.0.2", "localhost", "::1", "[::1]"):
        assert is_loopback(host), host
    for host in ("0.0.0.0", "::", "", "10.0.0.7", "no-such-host.invalid"):
        assert not is_loopback(host), host
    line = open_door_warning("kvxfer router", "0.0.0.0", None, "API key", "run completions")
    assert line is not None and "\n" not in line
    assert line.startswith("kvxfer router: warning: listening on 0.0.0.0 with no API key")
    assert open_door_warning("kvxfer router", "0.0.0.0", API, "API key", "run completions") is None
    assert open_door_warning("kvxfer serve", "127.0.0.1", None, "cluster key", "reserve") is None


def test_the_doctor_reaches_a_keyed_worker_only_with_the_cluster_key(tmp_path: Path) -> None:
    async def main() -> None:
        async with cluster(cluster_key=CLUSTER) as c:
            d = c.decode[0]
            for key in (None, BearerKey(WRONG)):
                with pytest.raises(doctor_peer.PeerError) as info:
                    await asyncio.to_thread(doctor_peer.connect, d, 10.0, key)
                line = str(info.value)
                assert "HTTP 401" in line and "cluster key" in line and WRONG not in line, line
            worker = await asyncio.to_thread(doctor_peer.connect, d, 10.0, CLUSTER)
            assert worker["role"] == "decode" and worker["probe"]["active"] is None

    asyncio.run(main())
    (tmp_path / "key").write_text(CLUSTER.secret)
    args = _parsed(doctor._parser(), ["--peer", "http://127.0.0.1:9", "--cluster-key-file", str(tmp_path / "key")])
    assert args.cluster_key.secret == CLUSTER.secret


async def _garbage_server(answer: bytes) -> tuple[asyncio.AbstractServer, str]:
    """A raw TCP server that reads a request's first bytes and answers ``answer``, then closes."""
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(1 << 16)
        writer.write(answer)
        await writer.drain()
        writer.close()
    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"


def test_a_malformed_answer_is_named_without_the_key_the_request_carried(caplog: pytest.LogCaptureFixture) -> None:
    """aiohttp's ClientResponseError holds the request's headers in its repr: the client's
    errors, logged by the router and answered to its clients, name the problem without it."""
    caplog.set_level(logging.DEBUG)

    async def main() -> None:
        bad_head, head_url = await _garbage_server(b"garbage garbage\r\n\r\n")
        bad_decode, decode_url = await _garbage_server(b"garbage garbage\r\n\r\n")
        bad_body, body_url = await _garbage_server(b"HTTP/1.1 200 OK\r\nContent-Type: application/x-ndjson\r\n"
                                                   b"Content-Length: 100\r\n\r\n{}")  # then cut
        client = HttpClient(headers=CLUSTER.headers())
        try:
            with pytest.raises(HttpError) as info:
                await client.request_json(head_url, "POST", "/prefill", {"request": "k"})
            line = str(info.value)
            assert "Bad status line" in line and "ClientResponseError" in line and info.value.unreachable, line
            assert CLUSTER.secret not in line and "Authorization" not in line, line
            with pytest.raises(HttpError) as info:
                await client.request_json(body_url, "GET", "/health")
            assert "response cut: ClientPayloadError" in str(info.value), info.value
            with pytest.raises(HttpError) as info:
                async for _ in client.stream_json(body_url, "/generate", {"request": "k"}, 5.0, 5.0):
                    pass
            assert "stream cut: ClientPayloadError" in str(info.value), info.value
            async with Router([head_url], [decode_url], cluster_key=CLUSTER) as router:
                done = await router.generate(PROMPT, 2)
            assert not done.ok and done.error, done
            assert CLUSTER.secret not in done.error and "Authorization" not in done.error, done.error
        finally:
            await client.close()
            for server in (bad_head, bad_decode, bad_body):
                server.close()
                await server.wait_closed()
        assert "Bad status line" in caplog.text  # the router's log names it

    asyncio.run(main())
    assert CLUSTER.secret not in caplog.text and "Authorization" not in caplog.text


async def _head_only(url: str, path: str, key: str | None = None) -> tuple[int, dict[str, str], bytes]:
    """Send a request's head declaring a large body, and none of the body: the answer."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        auth = f"Authorization: Bearer {key}\r\n" if key is not None else ""
        writer.write(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n{auth}"
                     f"Content-Length: {32 << 20}\r\n\r\n".encode())
        await writer.drain()
        # Without the gate the server waits for the body (READ_TIMEOUT_S, 10 s) and answers 408.
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5.0)
        status_line, *lines = head.decode().split("\r\n")
        headers = dict(line.split(": ", 1) for line in lines if line)
        data = await asyncio.wait_for(reader.readexactly(int(headers["Content-Length"])), 5.0)
        return int(status_line.split()[1]), headers, data
    finally:
        writer.close()


def test_a_request_without_its_key_is_refused_before_its_body_is_read() -> None:
    async def main() -> None:
        async with cluster(cluster_key=CLUSTER) as c:
            for url in (c.prefill[0], c.decode[0]):
                for path in ("/reserve", "/prefill", "/doctor/probe"):
                    for sent in (None, WRONG):
                        _is_401(*await _head_only(url, path, sent), sent)
            metrics = await request_text(c.decode[0], "/metrics")
            assert 'kvxfer_worker_requests_total{endpoint="reserve",result="unauthorized"} 2.0' in metrics
            async with Router(c.prefill, c.decode, cluster_key=CLUSTER) as router:
                server = HttpServer(router_handler(router, api_key=API))
                url = f"http://127.0.0.1:{await server.start()}"
                try:
                    for path in ("/v1/completions", "/generate"):
                        _is_401(*await _head_only(url, path), None)
                finally:
                    await server.close()

    asyncio.run(main())
