"""A decode hint replayed at a prefill worker other than the one it was made for: another
worker, the same worker after a restart, or the same worker long after (more transfers
than its used-hint guard once kept). In push mode the hint lets its holder WRITE into the
decode worker's rows, which after the first transfer hold a cached prefix: before hints
were bound to one publisher and expired, each replay was "delivered", and every later
request with that prompt answered wrong tokens with no error.

Real workers behind real HTTP servers in this process, moving rows with the loopback
backend (whose publish writes into the peer's memory as NIXL's WRITE does)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from test_router import CFG, MODEL, oracle  # noqa: I001 - pytest puts tests/unit on sys.path

import kvxfer.backends.common.transfers as transfers
from kvxfer.backends.loopback import LoopbackFabric
from kvxfer.serving.http import HttpError, HttpServer, request_json, stream_json
from kvxfer.worker.app import make_handler
from kvxfer.worker.core import Worker, WorkerConfig

PROMPT_A = [5, 17, 3, 99, 42, 7, 61, 8, 23, 11, 90, 4, 77]  # 13 tokens: 3 full blocks cached, 4 rows move
PROMPT_B = [9, 88, 14, 2, 70, 31, 6, 55, 19, 101, 45, 27, 63]
NEW = 6


@dataclass
class Stack:
    fabric: LoopbackFabric = field(default_factory=LoopbackFabric)
    servers: dict[str, HttpServer] = field(default_factory=dict)
    workers: dict[str, Worker] = field(default_factory=dict)

    async def add(self, role: str, name: str, num_blocks: int = 128) -> str:
        worker = Worker(WorkerConfig(role=role, model=CFG, num_blocks=num_blocks, backend="loopback", name=name,
                                     transfer_timeout_s=5.0), model=MODEL, fabric=self.fabric)
        await worker.start()
        server = HttpServer(make_handler(worker))
        url = f"http://127.0.0.1:{await server.start()}"
        self.servers[url], self.workers[url] = server, worker
        return url

    async def remove(self, url: str) -> None:
        await self.servers.pop(url).close()
        await self.workers.pop(url).close()


@contextlib.asynccontextmanager
async def stack() -> AsyncIterator[Stack]:
    s = Stack()
    try:
        yield s
    finally:
        for url in list(s.servers):
            await s.remove(url)


async def _publisher(p: str) -> Any:
    return (await request_json(p, "GET", "/health")).get("publisher")


async def _events(url: str, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    return [e async for e in stream_json(url, path, body, 10.0, 10.0)]


async def serve(p: str, d: str, rid: str, prompt: list[int]) -> tuple[list[int], str, int]:
    """One request by hand, as the router runs it: the tokens, hint D, and the tokens that
    the decode worker reused from its prefix cache."""
    reserved = await request_json(d, "POST", "/reserve", {"request": rid, "prompt": prompt, "max_new_tokens": NEW,
                                                          "publisher": await _publisher(p)})
    first = (await request_json(p, "POST", "/prefill", {"request": rid, "prompt": prompt}))["token"]
    published = await _events(p, "/publish", {"request": rid, "hint": reserved["hint"]})
    assert published[0]["event"] == "published" and published[-1]["status"] == "delivered", published
    events = await _events(d, "/generate", {"request": rid, "hint": published[0]["hint"], "first_token": first})
    assert events[-1]["event"] == "done", events
    tokens = [first] + [e["token"] for e in events if e["event"] == "token" and e["index"] > 0]
    return tokens, reserved["hint"], reserved["reused_tokens"]


async def replay(p: str, rid: str, hint_d: str) -> str | None:
    """Prefill ``rid`` with another prompt at ``p`` and publish it with an old hint D: the
    refusal, or None when the publisher wrote (the hole)."""
    await request_json(p, "POST", "/prefill", {"request": rid, "prompt": PROMPT_B})
    try:
        events = await _events(p, "/publish", {"request": rid, "hint": hint_d})
    except HttpError as exc:
        return str(exc)
    if events[-1].get("status") != "delivered":
        return str(events[-1])
    return None


async def check_prefix_still_right(p: str, d: str) -> None:
    tokens, _, reused = await serve(p, d, "r-after", PROMPT_A)
    assert reused == 12  # the 3 full blocks the first request left named at the decode worker
    assert tokens == oracle(PROMPT_A, NEW), "the decode worker's cached prefix was overwritten"


def test_a_hint_replayed_at_a_second_prefill_worker_is_refused() -> None:
    async def main() -> None:
        async with stack() as s:
            p1, p2, d = await s.add("prefill", "prefill0"), await s.add("prefill", "prefill1"), await s.add(
                "decode", "decode0")
            tokens, hint_d, _ = await serve(p1, d, "rA", PROMPT_A)
            assert tokens == oracle(PROMPT_A, NEW)
            refusal = await replay(p2, "rA", hint_d)
            await check_prefix_still_right(p1, d)
            assert refusal is not None and "409" in refusal and "bound to" in refusal, refusal

    asyncio.run(main())


def test_a_hint_replayed_at_a_restarted_prefill_worker_is_refused() -> None:
    async def main() -> None:
        async with stack() as s:
            p1, d = await s.add("prefill", "prefill0"), await s.add("decode", "decode0")
            tokens, hint_d, _ = await serve(p1, d, "rA", PROMPT_A)
            assert tokens == oracle(PROMPT_A, NEW)
            await s.remove(p1)
            p1 = await s.add("prefill", "prefill0")  # same agent name, a new run
            refusal = await replay(p1, "rA", hint_d)
            await check_prefix_still_right(p1, d)
            assert refusal is not None and "409" in refusal and "run" in refusal, refusal

    asyncio.run(main())


def test_a_hint_replayed_after_more_transfers_than_the_guard_once_kept_is_refused(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(transfers, "_RETIRED_KEPT", 8)  # the used-hint set's old bound, 65,536, made small

    async def main() -> None:
        async with stack() as s:
            p1, d = await s.add("prefill", "prefill0"), await s.add("decode", "decode0")
            tokens, hint_d, _ = await serve(p1, d, "rA", PROMPT_A)
            assert tokens == oracle(PROMPT_A, NEW)
            for i in range(12):
                await serve(p1, d, f"filler-{i}", [i + 1, 2, 3])
            refusal = await replay(p1, "rA", hint_d)
            await check_prefix_still_right(p1, d)
            assert refusal is not None and "409" in refusal and "used" in refusal, refusal

    asyncio.run(main())


def test_the_router_reserves_again_for_a_prefill_worker_that_restarted_behind_its_url() -> None:
    # The router learnt the prefill worker's run from /health; the worker then restarts behind
    # the same address (a new run, same name). The next request's hint D, bound to the old run,
    # would be refused at publish: the router sees the new run in /prefill's answer, drops the
    # reservation (hint D went nowhere) and reserves again for the new run.
    from kvxfer.router import Router

    async def main() -> None:
        async with stack() as s:
            p, d = await s.add("prefill", "prefill0"), await s.add("decode", "decode0")
            router = Router([p], [d])
            first = await router.generate(PROMPT_A, NEW)
            assert first.ok and list(first.tokens) == oracle(PROMPT_A, NEW)
            old = s.workers[p]
            fresh = Worker(WorkerConfig(role="prefill", model=CFG, num_blocks=128, backend="loopback",
                                        name="prefill0-restarted", transfer_timeout_s=5.0), model=MODEL, fabric=s.fabric)
            await fresh.start()
            s.servers[p]._handler = make_handler(fresh)  # same address, another worker behind it
            s.workers[p] = fresh
            await old.close()
            again = await router.generate(PROMPT_B, NEW)
            assert again.ok and list(again.tokens) == oracle(PROMPT_B, NEW), again.error
            assert again.path == "disaggregated" and any("another run now" in e for e in again.events), again.events
            await router.close()

    asyncio.run(main())
