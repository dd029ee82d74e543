"""`kvxfer pair`'s client of the router: it waits for each event as long as the router itself
may wait on its workers, so a stalled transfer reaches it as the decode worker's failure or
as the recompute, never as the client's own "no event within" timeout."""

from __future__ import annotations

import asyncio

import pytest
from test_router import CFG, backend, cluster, oracle  # noqa: I001 - pytest puts tests/unit on sys.path

from kvxfer import pair
from kvxfer.engine import synthetic_prompts
from kvxfer.router import Router
from kvxfer.router.http import HttpServer
from kvxfer.router.router import WORKER_SETTLE_S, stream_gap_s
from kvxfer.router.serve import make_handler as router_handler


def test_the_gap_bound_covers_the_routers_longest_single_wait() -> None:
    for t in (0.5, 30.0, 60.0):
        # The decode worker's first event after a stalled fetch (Router._generate), then a
        # recompute on another decode worker: both come before the router has a token to send.
        assert stream_gap_s(t) > 2 * (t + WORKER_SETTLE_S)
    assert stream_gap_s(60.0) > stream_gap_s(30.0)


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_a_stalled_transfer_reaches_the_pair_client_as_the_workers_answer(policy: str) -> None:
    prompt = synthetic_prompts(1, 30, 30, CFG.vocab_size, seed=4)[0]
    timeout = 1.0

    async def main() -> pair.Result:
        async with cluster() as c:
            # The publisher holds its rows past the decode worker's deadline (timeout): the
            # decode worker answers after that deadline, its cancel grace and quiescence.
            backend(c.workers[c.prefill[0]]).delay_s = 4.0
            router = Router(c.prefill, c.decode, on_failure=policy, timeout_s=timeout)
            server = HttpServer(router_handler(router))
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
