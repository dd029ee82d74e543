"""`kvxfer pair`'s client of the router: the router sends "waiting" events while it waits on its
workers, so a stalled transfer reaches the client as the decode worker's failure or as the
recompute, never as the client's own "no event within" timeout, while a router that stops
sending anything is given up on after a short silence."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from test_router import CFG, backend, cluster, oracle  # noqa: I001 - pytest puts tests/unit on sys.path

from kvxfer import pair
from kvxfer.engine import synthetic_prompts
from kvxfer.router import Router
from kvxfer.router.app import make_handler as router_handler
from kvxfer.serving.http import HttpServer, Request, Response


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_a_stalled_transfer_reaches_the_pair_client_as_the_workers_answer(policy: str,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    # The client's silence limit (1 s here) is far shorter than the stall: only the router's
    # keepalives (every 0.2 s here) keep it waiting for the worker's answer.
    monkeypatch.setattr(pair, "ROUTER_SILENCE_S", 1.0)
    prompt = synthetic_prompts(1, 30, 30, CFG.vocab_size, seed=4)[0]
    timeout = 1.0

    async def main() -> pair.Result:
        async with cluster() as c:
            # The publisher holds its rows past the decode worker's deadline (timeout): the
            # decode worker answers after that deadline, its cancel grace and quiescence.
            backend(c.workers[c.prefill[0]]).delay_s = 4.0
            router = Router(c.prefill, c.decode, on_failure=policy, timeout_s=timeout)
            server = HttpServer(router_handler(router, keepalive_s=0.2))
            url = f"http://127.0.0.1:{await server.start()}"
            try:
                [result] = await pair.run_workload(url, [prompt], [oracle(prompt, 4)], 4, 1, timeout,
                                                   pair.Progress(1, enabled=False))
            finally:
                await server.close()
                await router.close()
            return result

    result = asyncio.run(main())
    assert "no event within" not in (result.error or ""), result.error
    if policy == "recompute":
        assert result.matched and result.path == "resumed", (result.error, result.events)
        assert result.transfer is not None and result.transfer["status"] != "delivered", result.transfer
    else:
        assert result.error is not None and "transfer cancelled" in result.error, result.error
        assert "policy is fail" in result.error
        assert result.error.startswith("decode http://127.0.0.1:"), result.error  # the worker's own answer


def test_a_router_that_goes_silent_is_given_up_on_after_the_silence_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    # A router that answers the request and then sends nothing, not even a keepalive, has
    # hung: the client reports it after its silence limit instead of waiting for minutes.
    monkeypatch.setattr(pair, "ROUTER_SILENCE_S", 0.5)

    async def silent(request: Request) -> Response:
        async def nothing() -> AsyncIterator[dict[str, object]]:
            await asyncio.sleep(3600)
            yield {}
        return Response.ndjson(nothing())

    async def main() -> pair.Result:
        server = HttpServer(silent)
        url = f"http://127.0.0.1:{await server.start()}"
        try:
            [result] = await pair.run_workload(url, [[1, 2, 3]], [[4]], 1, 1, 5.0, pair.Progress(1, enabled=False))
        finally:
            await server.close()
        return result

    result = asyncio.run(main())
    assert result.error is not None and "no event within 0.5s" in result.error, result.error
