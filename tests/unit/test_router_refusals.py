"""A 400 from a worker's /reserve or /prefill names the client's mistake, not the worker's: the
router must not count the worker as failed nor mark it down (it counted each such answer in
kvxfer_router_worker_failures_total). The /generate case is in test_router.py."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from test_router import CFG, cluster, oracle  # noqa: I001 - pytest puts tests/unit on sys.path

from kvxfer.router import InvalidRequest, ModelLimits, Router
from kvxfer.serving.http import HttpServer, Request, Response
from kvxfer.worker.app import make_handler


def _refusing(inner: Any, path: str) -> Any:
    """A worker's HTTP handler that answers ``path`` with a 400, as for a malformed call."""
    async def handler(request: Request) -> Response:
        if request.path.strip("/") == path:
            return Response.json({"error": f"BadRequest: test refuses /{path}"}, 400)
        return await inner(request)
    return handler


def _blames_nobody(router: Router) -> None:
    assert "kvxfer_router_worker_failures_total{" not in router.metrics_text()
    for e in router.prefill + router.decode:
        assert e.failures == 0 and e.down_until == 0.0, (e.url, e.failures, e.down_until)


@pytest.mark.parametrize("policy", ["fail", "recompute"])
@pytest.mark.parametrize("path", ["reserve", "prefill"])
def test_a_400_from_reserve_or_prefill_counts_no_worker_failure(path: str, policy: str) -> None:
    # Every worker of the role refuses: policy fail reports the 400; policy recompute
    # prefills on a decode worker (after a refused /reserve, on the other one).
    prompt = list(range(1, 12))
    role = "decode" if path == "reserve" else "prefill"

    async def main() -> None:
        async with cluster(1, 2) as c:
            fronts: list[HttpServer] = []
            urls: dict[str, list[str]] = {"prefill": list(c.prefill), "decode": list(c.decode)}
            try:
                for i, url in enumerate(urls[role]):
                    front = HttpServer(_refusing(make_handler(c.workers[url]), path))
                    fronts.append(front)
                    urls[role][i] = f"http://127.0.0.1:{await front.start()}"
                router = Router(urls["prefill"], urls["decode"], on_failure=policy)
                done = await router.generate(prompt, 4)
                if policy == "fail":
                    assert done.error is not None and f"/{path}: HTTP 400" in done.error, done.error
                else:
                    assert done.ok and list(done.tokens) == oracle(prompt, 4), (done.error, done.events)
                    assert done.path == "local" and any(f"/{path}: HTTP 400" in e for e in done.events)
                _blames_nobody(router)
            finally:
                for front in fronts:
                    await front.close()
            for worker in c.workers.values():  # the side that was not refused dropped its part
                assert worker._held == {} and worker._reserved == {}

    asyncio.run(main())


def test_a_reservation_past_max_positions_is_the_clients_mistake() -> None:
    # A real 400: the prompt fits the prefill worker, prompt plus completion does not fit the
    # decode worker's max_positions, so only /reserve refuses.
    async def main() -> None:
        async with cluster(1, 1) as c:
            router = Router(c.prefill, c.decode)
            with pytest.raises(InvalidRequest, match="needs 4098 positions, over the workers' model's 4096"):
                await router.generate([1, 2, 3], CFG.max_positions)  # the router's own check
            # The workers check too (a router's view of their limits may be stale: a worker
            # restarted with another model): past the router's, only /reserve refuses.
            router._limits = ModelLimits("toy", CFG.vocab_size, 10 * CFG.max_positions)
            done = await router.generate([1, 2, 3], CFG.max_positions)
            assert done.error is not None and "/reserve: HTTP 400" in done.error, done.error
            assert "over max_positions" in done.error
            _blames_nobody(router)
            assert c.workers[c.prefill[0]]._held == {}  # the router dropped the prefill it had

    asyncio.run(main())
