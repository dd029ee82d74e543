"""Rows set aside after a fault come back once nothing can touch them, and never before.

100 faults through real workers behind the router (loopback backend, one fabric), of two
kinds: a prefill worker whose publish raises (rule 3: access may have escaped, and no
attempt says when it ends), and one too slow for the decode worker's deadline (the decode
end's wait concludes, withdraws, and quiesces when the publisher confirms). Every request
still completes (policy recompute); the rows of the slow kind return while the workers run,
those of the raising kind when each backend's shutdown proves nothing can touch them; then
both pools are whole."""

from __future__ import annotations

import asyncio
import re
from typing import Any

from test_hint_replay import stack  # noqa: I001 - pytest puts tests/unit on sys.path
from test_router import CFG, oracle

from kvxfer.backends.loopback import LoopbackBackend
from kvxfer.router import Router
from kvxfer.router.http import request_text
from kvxfer.worker.core import Worker

FAULTS = 100


def _metric(text: str, name: str) -> float:
    found = re.search(rf"^{name} ([0-9.e+]+)$", text, re.M)
    return float(found.group(1)) if found else 0.0


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
            prompts = [[(7 * i + j) % CFG.vocab_size for j in range(9)] for i in range(FAULTS)]
            sem = asyncio.Semaphore(8)

            async def one(prompt: list[int]) -> Any:
                async with sem:
                    return await router.generate(prompt, 3)

            done = await asyncio.gather(*(one(q) for q in prompts))
            await router.close()
            assert calls == FAULTS
            for prompt, c in zip(prompts, done):
                assert c.ok, c.error
                assert list(c.tokens) == oracle(prompt, 3)
                assert c.path != "disaggregated" or (c.transfer is not None and c.transfer.status != "delivered")
            # The slow kind's rows came back while the workers ran; the raising kind's wait for shutdown.
            for url in (p, d):
                text = await request_text(url, "/metrics")
                set_aside = _metric(text, "kvxfer_quarantined_slots_total")
                assert set_aside > 0 and _metric(text, "kvxfer_quarantined_slots") == set_aside, (url, text)
                assert _metric(text, "kvxfer_reclaimed_slots_total") == 0
                # Only those rows are held: the slow kind's came back as its waits quiesced.
                assert _metric(text, 'kvxfer_pool_blocks{group="full",state="pinned"}') == set_aside, (url, text)
            reports = {url: await _close(s, url, worker) for url, worker in ((p, prefill), (d, decode))}
            for url, (report, worker) in reports.items():
                assert report == {"unquiesced_attempts": 0, "retained_blocks": 0}, (url, report)
                text = worker.metrics.render()
                assert _metric(text, "kvxfer_reclaimed_slots_total") == _metric(text, "kvxfer_quarantined_slots_total")

    asyncio.run(main())


async def _close(s: Any, url: str, worker: Worker) -> tuple[dict[str, int], Worker]:
    await s.servers.pop(url).close()
    s.workers.pop(url)
    return await worker.close(), worker
