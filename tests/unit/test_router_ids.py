"""Request ids: a client's id is only echoed back; the workers see the router's own, one per
request. The router used to send the client's id to the workers as their key, so two clients
choosing one id met there: the later one's /prefill and /reserve were refused (400)."""

from __future__ import annotations

import asyncio
from typing import Any

from test_router import cluster, oracle  # noqa: I001 - pytest puts tests/unit on sys.path

from kvxfer.engine import synthetic_prompts
from kvxfer.router import Completion, Router, Token
from kvxfer.router.app import make_handler as router_handler
from kvxfer.serving.http import HttpServer, Request, Response, stream_json
from kvxfer.worker.app import make_handler

CLIENT_ID = "same"


def test_two_requests_with_one_client_id_both_complete_and_abandoning_one_spares_the_other() -> None:
    # Both requests hold a prefill and a reservation on the same two workers at once (each
    # stopped at its first token, before its publish); then the first client leaves, and
    # the router drops that request on both workers while the second one goes on.
    prompt_a, prompt_b = synthetic_prompts(2, 9, 21, 128, seed=7)

    async def main() -> None:
        async with cluster(1, 1) as c:
            p, d = c.workers[c.prefill[0]], c.workers[c.decode[0]]
            router = Router(c.prefill, c.decode)  # policy fail: a refused call fails the request
            a = router.stream(prompt_a, 6, CLIENT_ID)
            b = router.stream(prompt_b, 6, CLIENT_ID)
            first_a, first_b = await a.__anext__(), await b.__anext__()
            assert isinstance(first_a, Token) and first_a.token == oracle(prompt_a, 1)[0], first_a
            assert isinstance(first_b, Token) and first_b.token == oracle(prompt_b, 1)[0], first_b
            keys = set(p._held)
            assert len(keys) == 2 and keys == set(d._reserved) and CLIENT_ID not in keys, (keys, set(d._reserved))

            await a.aclose()  # abandons a's prefill and reservation in the background
            for _ in range(500):
                if len(p._held) == 1 and len(d._reserved) == 1:
                    break
                await asyncio.sleep(0.01)
            assert set(p._held) == set(d._reserved)  # b's, untouched

            rest = [item async for item in b]
            done = rest[-1]
            assert isinstance(done, Completion) and done.ok, (done.error, done.events)
            assert done.request == CLIENT_ID and list(done.tokens) == oracle(prompt_b, 6)
            assert done.path == "disaggregated" and done.transfer is not None
            assert done.transfer.status == "delivered"
            assert p._held == {} and d._reserved == {}

    asyncio.run(main())


def _recording(inner: Any, seen: list[str]) -> Any:
    """A worker's HTTP handler that notes the request id of each call it gets."""
    async def handler(request: Request) -> Response:
        body = request.json()
        if isinstance(body, dict) and "request" in body:
            seen.append(f"{request.path.strip('/')} {body['request']}")
        return await inner(request)
    return handler


def test_the_http_front_echoes_client_ids_that_no_worker_ever_sees() -> None:
    # Concurrent clients: two with one id, one with the id the router made for an earlier
    # request, one with an id the workers would refuse (over 200 characters, with '#').
    prompts = synthetic_prompts(5, 9, 21, 128, seed=8)
    odd = "#" * 250

    async def main() -> None:
        async with cluster(1, 1) as c:
            seen: list[str] = []
            fronts = [HttpServer(_recording(make_handler(c.workers[u]), seen)) for u in c.prefill + c.decode]
            urls = [f"http://127.0.0.1:{await f.start()}" for f in fronts]
            router = Router(urls[:1], urls[1:])
            server = HttpServer(router_handler(router))
            url = f"http://127.0.0.1:{await server.start()}"
            try:
                async def one(prompt: list[int], rid: str | None) -> dict[str, Any]:
                    body: dict[str, Any] = {"prompt": prompt, "max_new_tokens": 5}
                    if rid is not None:
                        body["request"] = rid
                    events = [e async for e in stream_json(url, "/generate", body, 10, 10)]
                    completion: dict[str, Any] = events[-1]["completion"]
                    assert completion["error"] is None and completion["tokens"] == oracle(prompt, 5), completion
                    assert [e["token"] for e in events[:-1]] == oracle(prompt, 5)
                    return completion

                made = (await one(prompts[0], None))["request"]
                ids = [CLIENT_ID, CLIENT_ID, made, odd]
                done = await asyncio.gather(*(one(pr, rid) for pr, rid in zip(prompts[1:], ids)))
                assert [x["request"] for x in done] == ids
            finally:
                await server.close()
                for f in fronts:
                    await f.close()
            prefills = [s.split(" ", 1)[1] for s in seen if s.startswith("prefill ")]
            assert len(prefills) == 5 and len(set(prefills)) == 5, prefills
            assert not {s.split(" ", 1)[1] for s in seen} & {CLIENT_ID, odd}, seen
            assert prefills.count(made) == 1  # only the request it was made for

    asyncio.run(main())
