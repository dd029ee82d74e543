"""Rows set aside after a fault come back once nothing can touch them, and never before.

Real workers behind the router (loopback backend, one fabric), policy recompute:

- 100 faults of two kinds: a prefill worker whose publish raises (rule 3: access may have
  escaped, and no attempt says when it ends), and one too slow for the decode worker's
  deadline (the decode end's wait concludes, withdraws, and quiesces when the publisher
  confirms). The raising publisher never used hint D, so it takes it back at once
  (/withdraw) and the decode worker reuses its reservation; its own read lease waits for its
  backend's shutdown. The slow kind's rows return while the workers run.
- Publishes whose answer reaches the router too late while the publisher's write is still to
  come: the decode worker sets the reservation aside, the router keeps asking the publisher
  to take hint D back, and once its write has quiesced the decode worker gets the rows back,
  while everything still runs.
"""

from __future__ import annotations

import asyncio
import re
import time
from typing import Any

from test_hint_replay import stack  # noqa: I001 - pytest puts tests/unit on sys.path
from test_router import CFG, oracle

import kvxfer.router.cleanup as router_module
from kvxfer.backends.loopback import LoopbackBackend
from kvxfer.router import Router
from kvxfer.serving.http import Request, Response, request_text
from kvxfer.worker.core import Worker

FAULTS = 100


def _metric(text: str, name: str) -> float:
    found = re.search(rf"^{re.escape(name)} ([0-9.e+]+)$", text, re.M)
    return float(found.group(1)) if found else 0.0


PINNED = 'kvxfer_pool_blocks{group="full",state="pinned"}'


def _prompts(n: int, salt: int) -> list[list[int]]:
    return [[(7 * i + j + salt) % CFG.vocab_size for j in range(9)] for i in range(n)]


async def _run_all(router: Router, prompts: list[list[int]]) -> None:
    sem = asyncio.Semaphore(8)

    async def one(prompt: list[int]) -> Any:
        async with sem:
            return await router.generate(prompt, 3)

    for prompt, c in zip(prompts, await asyncio.gather(*(one(q) for q in prompts))):
        assert c.ok, c.error
        assert list(c.tokens) == oracle(prompt, 3)


def test_a_hundred_faults_end_with_both_pools_whole() -> None:
    async def main() -> None:
        async with stack() as s:
            # Room for every set-aside row and the recomputes beside them: 100 requests of 3 blocks.
            p, d = await s.add("prefill", "prefill0", 1024), await s.add("decode", "decode0", 1024)
            prefill, decode = s.workers[p], s.workers[d]
            publisher = prefill.backend
            assert isinstance(publisher, LoopbackBackend)
            real_publish = publisher.publish
            calls = 0

            def faulty_publish(*args: Any, **kwargs: Any) -> Any:
                nonlocal calls
                calls += 1
                if calls % 2:
                    raise OSError("transport fell over mid-post")
                return real_publish(*args, **kwargs)

            publisher.publish = faulty_publish  # type: ignore[method-assign]
            publisher.delay_s = 1.0       # every publish that is posted starts after the deadline below
            decode.backend.deadline_s = 0.2  # type: ignore[union-attr]
            router = Router([p], [d], on_failure="recompute", timeout_s=10.0)
            await _run_all(router, _prompts(FAULTS, 0))
            await router.close()
            assert calls == FAULTS
            # The decode worker holds nothing back: the raising publisher took every hint D
            # back, and the slow kind's rows came back as their waits quiesced.
            end = time.monotonic() + 10.0
            text = await request_text(d, "/metrics")
            while time.monotonic() < end and _metric(text, PINNED) != 0:
                await asyncio.sleep(0.1)
                text = await request_text(d, "/metrics")
            assert _metric(text, "kvxfer_quarantined_slots") == 0 and _metric(text, PINNED) == 0, text
            # The prefill worker holds exactly the raising kind's read leases, until shutdown, once
            # the last slow publishes (posted 1 s after their submission) have ended: on a loaded
            # 2-core host that took over 10 s once, so the wait (a poll, free when it is quick) is 30.
            end = time.monotonic() + 30.0
            text = await request_text(p, "/metrics")
            while time.monotonic() < end and _metric(text, PINNED) != FAULTS // 2 * 3:
                await asyncio.sleep(0.1)
                text = await request_text(p, "/metrics")
            set_aside = _metric(text, "kvxfer_quarantined_slots_total")
            assert set_aside == FAULTS // 2 * 3 and _metric(text, "kvxfer_quarantined_slots") == set_aside, text
            assert _metric(text, "kvxfer_reclaimed_slots_total") == 0 and _metric(text, PINNED) == set_aside
            for url, worker in ((p, prefill), (d, decode)):
                report = await _close(s, url, worker)
                assert report == {"unquiesced_attempts": 0, "retained_blocks": 0}, (url, report)
                text = worker.metrics.render()
                assert _metric(text, "kvxfer_reclaimed_slots_total") == _metric(text, "kvxfer_quarantined_slots_total")

    asyncio.run(main())


def test_a_reservation_set_aside_after_a_late_publish_comes_back_once_the_write_quiesced(
        monkeypatch: Any) -> None:
    monkeypatch.setattr(router_module, "RECLAIM_POLL_S", 0.1)
    late = 0.6  # the router's timeout is 0.3 s: each /publish answer comes after it

    async def main() -> None:
        async with stack() as s:
            p, d = await s.add("prefill", "prefill0", 512), await s.add("decode", "decode0", 512)
            publisher = s.workers[p].backend
            assert isinstance(publisher, LoopbackBackend)
            publisher.delay_s = 1.0  # the write lands after the router gave up, and after its first /withdraw
            inner = s.servers[p]._handler

            async def answers_late(request: Request) -> Response:
                response = await inner(request)
                if request.path.strip("/") == "publish":
                    await asyncio.sleep(late)
                return response

            s.servers[p]._handler = answers_late
            router = Router([p], [d], on_failure="recompute", timeout_s=0.3)
            prompts = _prompts(6, 1)
            sem = asyncio.Semaphore(3)

            async def one(prompt: list[int]) -> Any:
                async with sem:
                    return await router.generate(prompt, 3)

            done = await asyncio.gather(*(one(q) for q in prompts))
            for prompt, c in zip(prompts, done):
                assert c.ok and list(c.tokens) == oracle(prompt, 3), c.error
            text = await request_text(d, "/metrics")
            set_aside = _metric(text, "kvxfer_quarantined_slots_total")
            assert set_aside == len(prompts) * 3, text  # every reservation was set aside at first
            end = time.monotonic() + 10.0
            while time.monotonic() < end:
                text = await request_text(d, "/metrics")
                # All three at once: the counter moves the moment a row comes back, while the
                # gauges are a snapshot taken as the scrape began (one scrape may show both).
                if (_metric(text, "kvxfer_reclaimed_slots_total") == set_aside
                        and _metric(text, "kvxfer_quarantined_slots") == 0 and _metric(text, PINNED) == 0):
                    break
                await asyncio.sleep(0.1)
            assert _metric(text, "kvxfer_reclaimed_slots_total") == set_aside, text
            assert _metric(text, "kvxfer_quarantined_slots") == 0 and _metric(text, PINNED) == 0, text
            await router.close()

    asyncio.run(main())


async def _close(s: Any, url: str, worker: Worker) -> dict[str, int]:
    await s.servers.pop(url).close()
    s.workers.pop(url)
    return await worker.close()
