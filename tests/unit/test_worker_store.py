"""Workers with a KV store (issue 30, item 3), in this process: prefill workers put their
prompt blocks into a shared store; a decode worker that reserves for a prompt takes from the
store what its own cache lacks, and the prefill worker sends only the rest. Every completion
is token-identical to colocated generation, whatever the store holds, loses or refuses."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import torch
from test_router import CFG, MODEL, oracle  # noqa: I001 - pytest puts tests/unit on sys.path

from kvxfer.backends.blob import MemoryStore
from kvxfer.backends.loopback import LoopbackFabric
from kvxfer.engine import synthetic_prompts
from kvxfer.router import Completion, Router
from kvxfer.serving.http import HttpServer, request_text
from kvxfer.worker.app import make_handler
from kvxfer.worker.core import Worker, WorkerConfig

torch.set_num_threads(1)
BT = CFG.block_tokens  # 4 tokens a block


@contextlib.asynccontextmanager
async def stack(store: MemoryStore, *, prefill_store: bool = True,
                decode_store: bool = True) -> AsyncIterator[tuple[Router, dict[str, Worker]]]:
    """A fresh prefill and decode worker (empty pools) on ``store``, behind a router. /reserve
    runs beside /prefill, so whether a prefill worker's put comes before the decode worker's
    lookup is a race: a test that counts hits leaves one of the two without the store."""
    fabric = LoopbackFabric()
    workers: dict[str, Worker] = {}
    servers: list[HttpServer] = []
    urls: dict[str, str] = {}
    try:
        for role in ("prefill", "decode"):
            use = "memory" if (prefill_store if role == "prefill" else decode_store) else ""
            worker = Worker(WorkerConfig(role=role, model=CFG, num_blocks=256, backend="loopback", name=role,
                                         transfer_timeout_s=5.0, store=use), model=MODEL, fabric=fabric,
                            shared_store=store)
            await worker.start()
            server = HttpServer(make_handler(worker))
            urls[role] = f"http://127.0.0.1:{await server.start()}"
            workers[role] = worker
            servers.append(server)
        async with Router([urls["prefill"]], [urls["decode"]]) as router:
            yield router, {urls[r]: w for r, w in workers.items()} | workers
    finally:
        for server in servers:
            await server.close()
        for worker in workers.values():
            assert (await worker.close())["unquiesced_attempts"] == 0


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0


async def _store_rows(router: Router, role: str, op: str, result: str) -> float:
    url = router.prefill[0].url if role == "prefill" else router.decode[0].url
    text = await request_text(url, "/metrics")
    return _metric(text, f'kvxfer_store_rows_total{{op="{op}",result="{result}"}}')


def _same(done: Completion, prompt: list[int], n: int) -> None:
    assert done.ok and list(done.tokens) == oracle(prompt, n), done.error


def test_a_second_instance_takes_the_prompt_from_the_store_and_moves_only_the_rest() -> None:
    prompt = synthetic_prompts(1, 37, 37, CFG.vocab_size, seed=5)[0]  # 9 named blocks (36 tokens, last one out)
    store = MemoryStore()

    async def main() -> None:
        async with stack(store, decode_store=False) as (router, _):
            done = await router.generate(prompt, 6)
            _same(done, prompt, 6)
            assert await _store_rows(router, "prefill", "put", "hit") == 9
            assert done.transfer is not None and done.transfer.rows_delivered == 10  # all of it
        async with stack(store, prefill_store=False) as (router, _):  # another instance: fresh workers, empty caches
            done = await router.generate(prompt, 6)
            _same(done, prompt, 6)
            assert await _store_rows(router, "decode", "get", "hit") == 9
            assert done.transfer is not None and done.transfer.rows_delivered == 1  # only the last block moved
            assert done.recomputed_tokens == 0

    asyncio.run(main())


def test_a_lost_block_is_a_miss_and_the_prefill_worker_sends_the_rest() -> None:
    prompt = synthetic_prompts(1, 41, 41, CFG.vocab_size, seed=6)[0]  # 10 named blocks
    store = MemoryStore()

    async def main() -> None:
        async with stack(store) as (router, _):
            _same(await router.generate(prompt, 5), prompt, 5)
        keys = sorted(store.blobs)  # the names are opaque: lose any three of the ten
        store.lose(keys[:3])
        async with stack(store, prefill_store=False) as (router, _):  # its put would bring them back
            done = await router.generate(prompt, 5)
            _same(done, prompt, 5)
            assert await _store_rows(router, "decode", "get", "hit") == 7
            assert await _store_rows(router, "decode", "get", "miss") == 3
            assert done.transfer is not None and done.transfer.rows_delivered == 11 - 7

    asyncio.run(main())


def test_a_dead_store_changes_nothing_but_the_misses() -> None:
    prompts = synthetic_prompts(3, 20, 60, CFG.vocab_size, seed=7)
    store = MemoryStore()

    async def main() -> None:
        async with stack(store) as (router, _):
            for p in prompts:
                _same(await router.generate(p, 4), p, 4)
        store.down = True
        async with stack(store) as (router, _):
            for p in prompts:
                done = await router.generate(p, 4)
                _same(done, p, 4)
            assert await _store_rows(router, "decode", "get", "hit") == 0
            assert await _store_rows(router, "decode", "get", "miss") > 0

    asyncio.run(main())
