"""Workers with a KV store (issue 30, item 3), in this process: prefill workers put their
prompt blocks into a shared store; a decode worker that reserves for a prompt takes from the
store what its own cache lacks, and the prefill worker sends only the rest. Every completion
is token-identical to colocated generation, whatever the store holds, loses or refuses."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

import numpy as np
import pytest
import torch
from test_router import CFG, MODEL, oracle  # noqa: I001 - pytest puts tests/unit on sys.path

from kvxfer.backends.blob import MemoryDriver, MemoryStore, Span, StoreError
from kvxfer.backends.blob.digests import DIGEST_SUFFIX
from kvxfer.backends.common.integrity import MISMATCH
from kvxfer.backends.loopback import LoopbackFabric
from kvxfer.contract import InvalidSubmission, Peer, TransferMode
from kvxfer.engine import synthetic_prompts
from kvxfer.pool import block_names
from kvxfer.router import Completion, Router
from kvxfer.serving.http import HttpServer, request_text
from kvxfer.testing.corruption import Corruptor
from kvxfer.testing.faulty_driver import FaultyDriver
from kvxfer.worker import core
from kvxfer.worker.app import make_handler
from kvxfer.worker.calls import AbortCall, PrefillCall, ReserveCall
from kvxfer.worker.core import Worker, WorkerConfig

torch.set_num_threads(1)
BT = CFG.block_tokens  # 4 tokens a block
T = TypeVar("T")


@contextlib.asynccontextmanager
async def stack(store: MemoryStore, *, prefill_store: bool = True, decode_store: bool = True, layerwise: int = 1,
                mode: TransferMode = TransferMode.PUSH) -> AsyncIterator[tuple[Router, dict[str, Worker]]]:
    """A fresh prefill and decode worker (empty pools) on ``store``, behind a router. /reserve
    runs beside /prefill, so whether a prefill worker's put comes before the decode worker's
    lookup is a race: a test that counts hits leaves one of the two without the store.
    ``layerwise``: both workers' --layerwise (their pools cut into that many layer groups)."""
    fabric = LoopbackFabric()
    workers: dict[str, Worker] = {}
    servers: list[HttpServer] = []
    urls: dict[str, str] = {}
    try:
        for role in ("prefill", "decode"):
            use = "memory" if (prefill_store if role == "prefill" else decode_store) else ""
            worker = Worker(WorkerConfig(role=role, model=CFG, num_blocks=256, backend="loopback", name=role,
                                         transfer_timeout_s=5.0, store=use, layerwise=layerwise, mode=mode),
                            model=MODEL, fabric=fabric,
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


@pytest.mark.parametrize(("groups", "mode"), [(1, TransferMode.PUSH), (2, TransferMode.PUSH), (2, TransferMode.PULL)])
def test_a_second_instance_takes_the_prompt_from_the_store_and_moves_only_the_rest(groups: int,
                                                                                  mode: TransferMode) -> None:
    """With --layerwise each layer group's row of a block is stored under a name of its own:
    every group's rows count, and the prefill worker's groups (streamed as its forward makes
    them) send only each group's rest."""
    prompt = synthetic_prompts(1, 37, 37, CFG.vocab_size, seed=5)[0]  # 9 named blocks (36 tokens, last one out)
    store = MemoryStore()

    async def main() -> None:
        async with stack(store, decode_store=False, layerwise=groups, mode=mode) as (router, _):
            done = await router.generate(prompt, 6)
            _same(done, prompt, 6)
            assert await _store_rows(router, "prefill", "put", "hit") == 9 * groups
            assert done.transfer is not None and done.transfer.rows_delivered == 10 * groups  # all of it
        # another instance: fresh workers, empty caches
        async with stack(store, prefill_store=False, layerwise=groups, mode=mode) as (router, _):
            done = await router.generate(prompt, 6)
            _same(done, prompt, 6)
            assert await _store_rows(router, "decode", "get", "hit") == 9 * groups
            assert done.transfer is not None and done.transfer.rows_delivered == groups  # only the last block moved
            assert done.recomputed_tokens == 0

    asyncio.run(main())


def test_a_block_one_layer_group_lost_is_taken_from_the_prefill_worker_for_that_group_only() -> None:
    """The store holds all 9 blocks of the first group and only the first 4 of the second: the
    decode worker's reservation says 16 tokens came from the store (a block is of use only once
    every group has it), hint D asks the first group for its last block and the second for
    its last 6, and the completion is token-identical with nothing recomputed."""
    prompt = synthetic_prompts(1, 37, 37, CFG.vocab_size, seed=8)[0]
    store = MemoryStore()

    async def main() -> None:
        async with stack(store, decode_store=False, layerwise=2) as (router, workers):
            _same(await router.generate(prompt, 5), prompt, 5)
            pool = workers["prefill"].pool
            assert pool is not None
            first, second = (g.name for g in pool.groups)
            ids = np.asarray(prompt[:36], dtype=np.int64)
            assert all(n in store.blobs for g in (first, second) for n in block_names(pool.identity, g, BT, ids))
            store.lose(block_names(pool.identity, second, BT, ids)[4:])
        async with stack(store, prefill_store=False, layerwise=2) as (router, workers):
            decode = workers["decode"]
            answer = await decode.reserve(ReserveCall("probe", prompt, 5, Peer("p", "1")))
            assert answer["store_tokens"] == 4 * BT
            await decode.abort(AbortCall("probe", rows_safe=True))
            done = await router.generate(prompt, 5)
            _same(done, prompt, 5)
            assert done.transfer is not None and done.transfer.rows_delivered == 1 + 6
            assert done.recomputed_tokens == 0

    asyncio.run(main())


def test_a_lost_block_is_a_miss_and_the_prefill_worker_sends_the_rest() -> None:
    prompt = synthetic_prompts(1, 41, 41, CFG.vocab_size, seed=6)[0]  # 10 named blocks
    store = MemoryStore()

    async def main() -> None:
        async with stack(store) as (router, _):
            _same(await router.generate(prompt, 5), prompt, 5)
        keys = sorted(k for k in store.blobs if not k.endswith(DIGEST_SUFFIX))  # opaque names: lose any 3 of 10
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


# --- a store call that outlives its request (issue 36, item 1): the lease is released, and
# its rows come back once the attempt quiesces, never before -----------------------------------
async def _on_engine(worker: Worker, fn: Callable[[], T]) -> T:
    return await asyncio.get_running_loop().run_in_executor(worker._exec, fn)


async def _until(condition: Callable[[], Awaitable[bool]], timeout: float = 10.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if await condition():
            return True
        await asyncio.sleep(0.01)
    return await condition()


@contextlib.asynccontextmanager
async def stuck_store(monkeypatch: pytest.MonkeyPatch, role: str) -> AsyncIterator[tuple[Worker, FaultyDriver]]:
    """A worker whose store driver holds every call (until ``release``), asserting at the end
    that nothing stayed unquiesced or retained."""
    faulty = FaultyDriver(MemoryDriver(MemoryStore()))
    monkeypatch.setattr(core, "make_store_driver", lambda *a, **kw: faulty)
    worker = Worker(WorkerConfig(role=role, model=CFG, num_blocks=64, backend="loopback", name=role,
                                 transfer_timeout_s=5.0, store="memory"), model=MODEL, fabric=LoopbackFabric())
    await worker.start()
    try:
        faulty.hold()
        yield worker, faulty
    finally:
        faulty.release()
        report = await worker.close()
    assert report == {"unquiesced_attempts": 0, "retained_blocks": 0}


def _blocks(worker: Worker) -> dict[str, int]:
    assert worker.pool is not None and worker.lender is not None
    stats = next(iter(worker.pool.stats().values()))
    return {"free": stats["free"], "pinned": stats["pinned"], "leases": worker.lender.open_leases,
            "held": int(worker.pool.has("r1"))}


async def _cancel_while_stuck(worker: Worker, faulty: FaultyDriver, call: Awaitable[object]) -> dict[str, int]:
    """Start ``call``, cancel it once its store call is stuck in the driver; the pool then."""
    task = asyncio.ensure_future(call)
    assert await _until(lambda: _true(faulty.stuck.is_set()))
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    return await _on_engine(worker, lambda: _blocks(worker))


async def _true(value: bool) -> bool:
    return value


async def _given_back(worker: Worker, free: int) -> bool:
    await worker.refresh_metrics()  # the worker's reclaim: the lender unpins what quiesced
    return await _on_engine(worker, lambda: _blocks(worker)) == {"free": free, "pinned": 0, "leases": 0, "held": 0}


def test_a_put_cancelled_while_stuck_in_the_store_releases_its_lease_and_the_rows_return_once_it_quiesces(
        monkeypatch: pytest.MonkeyPatch) -> None:
    prompt = synthetic_prompts(1, 37, 37, CFG.vocab_size, seed=8)[0]  # 10 blocks, 9 named

    async def main() -> None:
        async with stuck_store(monkeypatch, "prefill") as (worker, faulty):
            free = (await _on_engine(worker, lambda: _blocks(worker)))["free"]
            # The server closing cancels /prefill while its put is in the driver.
            during = await _cancel_while_stuck(worker, faulty, worker.prefill(PrefillCall("r1", prompt)))
            assert during == {"free": free - 9, "pinned": 9, "leases": 0, "held": 0}  # released, not reused
            assert _metric(await worker.metrics_text(), "kvxfer_quarantined_slots") == 9
            faulty.release()
            assert await _until(lambda: _given_back(worker, free))
            text = await worker.metrics_text()
            assert _metric(text, "kvxfer_reclaimed_slots_total") == 9 and _metric(text, "kvxfer_quarantined_slots") == 0

    asyncio.run(main())


def test_a_lookup_cancelled_while_stuck_in_the_store_frees_the_reservation_and_its_rows_return_once_it_quiesces(
        monkeypatch: pytest.MonkeyPatch) -> None:
    prompt = synthetic_prompts(1, 29, 29, CFG.vocab_size, seed=9)[0]  # 7 named blocks to look up

    async def main() -> None:
        async with stuck_store(monkeypatch, "decode") as (worker, faulty):
            free = (await _on_engine(worker, lambda: _blocks(worker)))["free"]
            during = await _cancel_while_stuck(worker, faulty,
                                               worker.reserve(ReserveCall("r1", prompt, 3, Peer("p", "1"))))
            assert during == {"free": free - 7, "pinned": 7, "leases": 0, "held": 0}  # only the fetch's rows stay
            faulty.release()
            assert await _until(lambda: _given_back(worker, free))
            # The worker serves on: the next reservation fetches (the store lacks the blocks) and lends the rest.
            answer = await worker.reserve(ReserveCall("r2", prompt, 3, Peer("p", "1")))
            assert answer["store_tokens"] == 0 and answer["rows"] == 8
            await worker.abort(AbortCall("r2", rows_safe=True))

    asyncio.run(main())


class _RefusingDriver(FaultyDriver):
    """A store that refuses to register the pool's memory (a Mooncake client out of segments)."""

    def register(self, span: Span) -> None:
        raise StoreError("cannot register: no segment left")


def test_a_store_that_refuses_the_pool_at_start_leaves_no_thread_and_its_driver_closed(
        monkeypatch: pytest.MonkeyPatch) -> None:
    driver = _RefusingDriver(MemoryDriver(MemoryStore()))
    monkeypatch.setattr(core, "make_store_driver", lambda *a, **kw: driver)

    async def main() -> None:
        worker = Worker(WorkerConfig(role="decode", model=CFG, num_blocks=64, backend="loopback", name="refused",
                                     store="memory"), model=MODEL, fabric=LoopbackFabric())
        try:
            with pytest.raises(InvalidSubmission, match="no segment left"):
                await worker.start()
        finally:
            await worker.close()

    asyncio.run(main())
    assert driver.closes == 1
    assert not [t.name for t in threading.enumerate() if t.name == "kvxfer-blob-refused-store"]


def test_a_cancelled_prefill_stays_cancelled_when_its_clean_up_fails(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """The server closing cancels /prefill while its put is stuck in the store, and the engine
    refuses work (the worker torn down meanwhile): the clean-up's RuntimeError is logged, and
    the call ends cancelled, not with that error (nor, with the put's error swallowed as a
    store miss, as a prefill that went on to hold its rows)."""
    prompt = synthetic_prompts(1, 21, 21, CFG.vocab_size, seed=10)[0]  # 5 named blocks

    async def main() -> None:
        async with stuck_store(monkeypatch, "prefill") as (worker, faulty):
            task = asyncio.ensure_future(worker.prefill(PrefillCall("r1", prompt)))
            assert await _until(lambda: _true(faulty.stuck.is_set()))
            engine, store = worker._engine, worker._state.store
            assert store is not None
            engine.torn_down = True  # every engine job refused from here on
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert "r1" not in worker._prefill.held
            engine.torn_down = False  # as the clean-up would have: end the put's lease, free the rows
            for token in list(store._moving):
                await worker._run(store._finish, token, None)
            await worker._run(worker._state.free, "r1")
            faulty.release()

    asyncio.run(main())
    failures = [r.getMessage() for r in caplog.records if "clean-up" in r.getMessage()]
    assert any("_finish failed" in m and "is shut down" in m for m in failures), failures
    assert any("free failed" in m for m in failures), failures


def test_rows_that_fail_their_integrity_check_are_counted_by_source() -> None:
    """kvxfer_integrity_rows_failed_total{source}: every row damaged where it landed at the
    decode worker (taken from the store, then sent by the prefill worker) is refused and
    counted there, and the request fails naming the mismatch (the router's policy: fail)."""
    prompt = synthetic_prompts(1, 37, 37, CFG.vocab_size, seed=8)[0]  # 9 named blocks
    store = MemoryStore()

    async def failed(url: str, source: str) -> float:
        text = await request_text(url, "/metrics")
        assert f'kvxfer_integrity_rows_failed_total{{source="{source}"}}' in text  # at 0 from the start
        return _metric(text, f'kvxfer_integrity_rows_failed_total{{source="{source}"}}')

    async def main() -> None:
        async with stack(store, decode_store=False) as (router, _):
            _same(await router.generate(prompt, 4), prompt, 4)  # the store now holds the 9 blocks
        async with stack(store, prefill_store=False) as (router, workers):
            assert workers["decode"].health()["integrity"] == "on"  # what kvxfer doctor --peer shows
            decode = workers["decode"]._state
            damage = Corruptor(seed=4, p_bit=1.0)  # one bit of every landed row
            assert decode.backend is not None and decode.store is not None
            decode.backend.integrity.corrupt = damage  # type: ignore[attr-defined]
            decode.store.backend.integrity.corrupt = damage
            done = await router.generate(prompt, 4)
            assert not done.ok and MISMATCH in done.error
            decode_url, prefill_url = router.decode[0].url, router.prefill[0].url
            from_store, from_transfer = await failed(decode_url, "store"), await failed(decode_url, "transfer")
            assert from_store == 9 and from_transfer > 0
            assert from_store + from_transfer == damage.rows_seen
            assert await failed(prefill_url, "transfer") == 0

    asyncio.run(main())
