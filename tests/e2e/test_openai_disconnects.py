"""Many clients that leave, against real processes: ``kvxfer serve`` prefill and decode
workers (the toy model, NIXL between them) and ``kvxfer router`` in front. Twelve long
requests, streamed and not, are generating when their clients go (a streamed one after its
first chunk); twelve short ones run beside them to their end. Afterwards the router counts
exactly the twelve as cancelled and the twelve as ok, and neither worker holds a stream, a
lease, a held prefill or reservation, or a pool block."""

from __future__ import annotations

import asyncio
import os
import urllib.request
from pathlib import Path

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from kvxfer.testing.waiting import settle
from kvxfer.worker.procs import ProcessGroup

LONG = 3000  # tokens: minutes of decoding at this concurrency; a request left running is obvious
SHORT = 12
CLIENTS = 12  # of each kind


def samples(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as answer:
        text = answer.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def total(metrics: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str) -> float:
    return sum(v for (n, ls), v in metrics.items() if n == name and set(labels.items()) <= set(ls))


def leftovers(url: str) -> dict[str, float]:
    """What a worker still holds: every figure here is 0 on an idle worker."""
    m = samples(url)
    return {"streams": total(m, "kvxfer_worker_active_streams"), "leases": total(m, "kvxfer_open_leases"),
            "held": total(m, "kvxfer_worker_held_requests"), "quarantined": total(m, "kvxfer_quarantined_slots"),
            "blocks": total(m, "kvxfer_pool_blocks", state="in_use")}


def test_many_clients_that_leave_leave_nothing_behind_on_the_workers(tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with ProcessGroup(tmp_path) as group:
        workers = [group.start(role, ["serve", "--role", role, "--port", "0", "--blocks", "8192"], env)
                   for role in ("prefill", "decode")]
        group.wait_ready(workers, timeout=120)
        router = group.start("router", ["router", "--port", "0", "--prefill", workers[0].url, "--decode",
                                        workers[1].url], env)
        group.wait_ready([router], timeout=60)
        decode = workers[1].url
        statuses = asyncio.run(_clients(router.url, decode))
        assert statuses == {"ok": CLIENTS, "left": CLIENTS}, statuses
        series = "kvxfer_router_requests_total"
        assert settle(lambda: total(samples(router.url), series, result="cancelled") == CLIENTS, timeout=10), \
            samples(router.url)
        assert total(samples(router.url), series, result="ok") == CLIENTS
        for w in workers:
            assert settle(lambda w=w: set(leftovers(w.url).values()) == {0.0}, timeout=10), (w.name, leftovers(w.url))
        generated = total(samples(decode), "kvxfer_generated_tokens_total")
        assert generated < CLIENTS * LONG / 4, generated  # the long requests stopped when their clients left
        codes = group.stop()
    assert codes == {"router": 0, "decode": 0, "prefill": 0}, codes


async def _clients(url: str, decode: str) -> dict[str, int]:
    go = asyncio.Event()
    statuses: dict[str, int] = {"ok": 0, "left": 0}

    async def long(i: int, http: aiohttp.ClientSession) -> None:
        body = {"model": "toy", "prompt": list(range(1, 9 + 3 * i)), "max_tokens": LONG, "stream": i % 2 == 0}
        async with http.post(f"{url}/v1/completions", json=body) as answer:
            assert answer.status == 200, await answer.text()
            if body["stream"]:
                async for line in answer.content:
                    if line.startswith(b"data: "):
                        break  # the first token's chunk: then wait, and leave
            await go.wait() if body["stream"] else await answer.read()

    async def short(i: int, http: aiohttp.ClientSession) -> None:
        body = {"model": "toy", "prompt": list(range(2, 6 + 5 * i)), "max_tokens": SHORT, "stream": i % 2 == 1,
                "temperature": 0.8 if i % 3 else 0, "seed": i}
        async with http.post(f"{url}/v1/completions", json=body) as answer:
            text = await answer.text()
        assert answer.status == 200 and text.count('"finish_reason": "length"') == 1, text[-500:]
        statuses["ok"] += 1

    async with aiohttp.ClientSession() as http:
        leaving = [asyncio.create_task(long(i, http)) for i in range(CLIENTS)]
        # Every long request is generating on the decode worker before the short ones start.
        while total(await asyncio.to_thread(samples, decode), "kvxfer_worker_active_streams") < CLIENTS:
            await asyncio.sleep(0.05)
        await asyncio.gather(*(short(i, http) for i in range(CLIENTS)))
        assert not any(t.done() for t in leaving), [t for t in leaving if t.done()]
        for task in leaving:
            task.cancel()  # the connection closes: the client has gone
        for outcome in await asyncio.gather(*leaving, return_exceptions=True):
            statuses["left"] += isinstance(outcome, asyncio.CancelledError)
    return statuses
