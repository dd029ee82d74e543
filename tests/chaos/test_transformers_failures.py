"""The transformers engine (``kvxfer serve --engine transformers``, a small Llama of
transformers' own with seeded weights: the toy model's shape) when a transfer fails: a worker SIGKILLed while a request's KV is in
flight over NIXL, or a client that leaves mid-transfer. Whatever happens, both engines'
caches end consistent, read from each worker's /metrics as an operator reads them: every one
of transformers' blocks free or in its prefix cache again (``kvxfer_pool_blocks{state="in_use"}``
0), no lease, reservation, held prefill, set-aside row or stream left; and the survivor serves
the next request token-identical to transformers' own ``generate_batch``.

The kill lands mid-transfer whatever the load: the worker killed is the transfer's active
end, paced (``--nixl-chunk-pause``: one block per chunk, then an hour's pause), so that it has
posted its first block and sends no more; the test waits until both ends run the request's
stream, then kills. The survivor is the passive end, whose heartbeat finds the peer dead (an
active end paced so would find out only at its next post). So a killed prefill worker is a
push publisher, and a killed decode worker a pull fetcher.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from kvxfer.adapters.transformers import _internals as hf
from kvxfer.engine import ModelConfig
from kvxfer.router import Completion, Router
from kvxfer.serving.http import request_text
from kvxfer.testing.processes import assert_nothing_left
from kvxfer.testing.progress_hold import hold_progress
from kvxfer.testing.served import served_workers
from kvxfer.worker.core import WorkerConfig
from kvxfer.worker.forked import preload
from kvxfer.worker.hf_engine import MAX_BATCH_TOKENS, PAGE_SIZE
from kvxfer.worker.procs import Child, ProcessGroup

BLOCKS = 32
NEW = 4
# 40 tokens: three blocks, so that a paced transfer is cut after its first. No two share a
# block-long prefix (a prefix the decode engine holds is not fetched again).
PROMPTS = {name: list(range(start, start + 40)) for name, start in
           (("killed", 1000), ("failed", 3000), ("after", 5000), ("moved", 7000), ("next", 9000), ("left", 11000))}
# The toy model's shape with a vocabulary the prompts fit in: transformers' Llama with seeded
# weights, the same at both ends and in the oracle (with SmolLM2 the module took 44 CPU-s against
# 35-37, its conversion kept; the e2e pair tests cover SmolLM2 itself).
SHAPE = ModelConfig(vocab_size=12288)
FLAGS = ["--engine", "transformers", "--vocab", str(SHAPE.vocab_size), "--blocks", str(BLOCKS), "--port", "0",
         "--transfer-timeout", "30"]
PACED = ["--nixl-chunk-bytes", "1", "--nixl-chunk-pause", "3600"]  # one block per chunk, then an hour
SETTLE_S = 15.0  # from a kill or a client leaving to a quiet worker, on a loaded 2-core machine


class Oracle:
    """The workers' model in this process, built when first asked for: a test starts its workers first, so
    that they and this load run at once. ``tokens``: transformers' own colocated continuous
    batching (``generate_batch``), greedy, on the workers' weights."""

    def __init__(self) -> None:
        self._model: Any = None
        self._tokens: dict[str, list[int]] = {}

    @property
    def model(self) -> Any:
        if self._model is None:
            from kvxfer.worker.hf_engine import seeded_model

            torch.set_num_threads(1)
            self._model = seeded_model(SHAPE, "cpu")
        return self._model

    def tokens(self) -> dict[str, list[int]]:
        if not self._tokens:
            names = list(PROMPTS)
            got = hf.colocated(self.model, [PROMPTS[n] for n in names], NEW,
                               hf.batching_config(PAGE_SIZE, BLOCKS, MAX_BATCH_TOKENS))
            self._tokens = dict(zip(names, got))
        return self._tokens


@pytest.fixture(scope="module")
def oracle() -> Oracle:
    # The workers' fork server (if this module starts it) imports transformers and the model's
    # code once: transformers imports a model's module when it first loads one, 2-3 s a worker.
    preload("kvxfer.worker.hf_engine", "transformers.models.llama.modeling_llama")
    return Oracle()


# --- what a worker's /metrics says ----------------------------------------------------------
async def gauges(url: str) -> dict[str, float]:
    """A worker's figures that are 0 once it is idle and consistent, with its cache's blocks."""
    text = await request_text(url, "/metrics")
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            key = s.name if s.name != "kvxfer_pool_blocks" else f"blocks_{s.labels['state']}"
            if s.name == "kvxfer_worker_held_requests":
                key = f"held_{s.labels['table']}"
            values[key] = s.value
    return values


LEFT = ("kvxfer_worker_active_streams", "kvxfer_open_leases", "kvxfer_quarantined_slots", "held_prefill",
        "held_reservation", "held_starting", "blocks_in_use")


async def until(what: str, check: Callable[[], Awaitable[bool]], timeout: float = SETTLE_S) -> None:
    deadline = time.monotonic() + timeout
    while not await check():
        assert time.monotonic() < deadline, f"not within {timeout:g}s: {what}"
        await asyncio.sleep(0.05)


async def consistent(url: str) -> dict[str, float]:
    """Wait until the worker holds nothing for any request: every block of transformers' cache
    free or in its prefix cache (as many as it had at the start), no stream, lease,
    reservation, held prefill or set-aside row."""
    async def quiet() -> bool:
        g = await gauges(url)
        return all(g[k] == 0 for k in LEFT)
    await until(f"{url} idle and consistent", quiet)
    g = await gauges(url)
    assert g["blocks_free"] + g["blocks_cached"] == g["blocks_blocks"] == BLOCKS, g
    return g


async def in_flight(tasks: list[asyncio.Task[Completion]], *urls: str) -> None:
    """Both ends run each request's stream: its publish is posted (its first block went) and
    the decode worker waits on, or is about to post, its fetch."""
    async def streaming() -> bool:
        for task in tasks:
            assert not task.done(), task.result()
        counts = [(await gauges(url))["kvxfer_worker_active_streams"] for url in urls]
        return counts == [len(tasks)] * len(urls)
    await until("the requests' transfers in flight", streaming, 60)


def start(group: ProcessGroup, oracle: Oracle, *specs: tuple[str, str, list[str]]
          ) -> tuple[list[Child], dict[str, list[int]]]:
    """The workers ``specs`` name ((name, role, flags) each), ready, and the oracle's tokens,
    computed while they start (the first start waits for the fork server's imports)."""
    with ThreadPoolExecutor(1, thread_name_prefix="oracle") as pool:
        tokens = pool.submit(oracle.tokens)
        children = [group.start(name, ["serve", "--role", role, "--name", name, *FLAGS, *extra])
                    for name, role, extra in specs]
        expected = tokens.result()
    group.wait_ready(children, 180)
    return children, expected


def named_dead(error: str | None, victim: Child) -> bool:
    """The error names the killed worker: by URL (the router saw it die) or by its NIXL agent
    (the survivor's transfer saw the disconnect)."""
    text = error or ""
    return victim.url in text or f"kvxfer-{victim.name}-" in text


# --- the tests ------------------------------------------------------------------------------
def test_prefill_worker_killed_mid_transfer(tmp_path: Path, oracle: Oracle) -> None:
    """Push: the prefill worker dies after the first of three blocks of two requests went out.
    The one under policy recompute is prefilled again in the decode worker's own batch; the one
    under policy fail fails, naming the dead worker. The decode engine's cache ends as it
    started, and it serves the next request as generate_batch does."""
    group = ProcessGroup(tmp_path)
    with group:
        (p, d), expected = start(group, oracle, ("p", "prefill", PACED), ("d", "decode", []))

        async def main() -> None:
            await consistent(d.url)
            async with (Router([p.url], [d.url], on_failure="recompute", timeout_s=30) as recompute,
                        Router([p.url], [d.url], on_failure="fail", timeout_s=30) as fail):
                tasks = [asyncio.create_task(recompute.generate(PROMPTS["killed"], NEW)),
                         asyncio.create_task(fail.generate(PROMPTS["failed"], NEW))]
                await in_flight(tasks, p.url, d.url)
                assert (await gauges(d.url))["blocks_in_use"] == 6  # the reservations p writes into
                p.kill()
                recomputed, failed = [await t for t in tasks]
            assert recomputed.ok, recomputed.error
            assert list(recomputed.tokens) == expected["killed"]
            transfer = recomputed.transfer
            assert transfer is not None and transfer.status == "failed", transfer
            # Found dead by the fetch's heartbeat (or, were the fetch posted after the kill, at once).
            assert named_dead(transfer.reason, p), transfer
            assert "disconnected" in transfer.reason or "unreachable" in transfer.reason, transfer
            assert recomputed.path == "resumed" and recomputed.recomputed_tokens == 40, recomputed
            assert not failed.ok and "policy is fail" in (failed.error or ""), failed
            assert named_dead(failed.error, p), failed.error
            await consistent(d.url)

            async with Router([], [d.url], on_failure="recompute", timeout_s=30) as router:
                done = await router.generate(PROMPTS["after"], NEW)
            assert done.ok and done.path == "local", done
            assert list(done.tokens) == expected["after"]
            await consistent(d.url)

        asyncio.run(main())
        codes = group.stop()
    assert codes == {"d": 0, "p": -9}, codes
    assert_nothing_left([{"pid": c.pid, "port": c.port} for c in (p, d)])


def test_decode_worker_killed_mid_transfer(tmp_path: Path, oracle: Oracle) -> None:
    """Pull: the decode worker dies after it read the first of three blocks. The prefill
    worker's blocks stay pinned while the dead peer's read may be under way, then go back to
    transformers once its attempt concluded and quiesced; under policy recompute the request
    goes on at the other decode worker, and the prefill worker serves the next request."""
    group = ProcessGroup(tmp_path)
    with group:
        pull = ["--mode", "pull"]
        (p, d0, d1), expected = start(group, oracle, ("p", "prefill", pull), ("d0", "decode", [*pull, *PACED]),
                                      ("d1", "decode", pull))

        async def main() -> None:
            await consistent(p.url)
            async with Router([p.url], [d0.url, d1.url], on_failure="recompute", timeout_s=30) as router:
                task = asyncio.create_task(router.generate(PROMPTS["moved"], NEW))
                await in_flight([task], p.url, d0.url)
                # Pinned for the read: neither free nor cached while d0 may read them.
                assert (await gauges(p.url))["blocks_in_use"] == 3
                d0.kill()
                done = await task
                assert done.ok, done.error
                assert list(done.tokens) == expected["moved"]
                assert done.decode == d1.url and done.path == "local", done
                assert any(d0.url in e for e in done.events), done.events
                await consistent(p.url)
            # The next request, disaggregated again: its blocks lent, read, given back.
            async with Router([p.url], [d1.url], timeout_s=30) as router:
                done = await router.generate(PROMPTS["next"], NEW)
            assert done.ok and done.path == "disaggregated" and done.decode == d1.url, done
            assert done.transfer is not None and done.transfer.status == "delivered", done.transfer
            assert list(done.tokens) == expected["next"]
            await consistent(p.url)
            await consistent(d1.url)

        asyncio.run(main())
        codes = group.stop()
    assert codes == {"d1": 0, "d0": -9, "p": 0}, codes
    assert_nothing_left([{"pid": c.pid, "port": c.port} for c in (p, d0, d1)])


def in_process(model: Any) -> Any:
    """A prefill and a decode worker of this process (transformers' engine, the loopback
    backend) behind HTTP servers: their URLs and the workers."""
    return served_workers({role: (WorkerConfig(role=role, model=SHAPE, num_blocks=BLOCKS, backend="loopback",
                                               name=role, transfer_timeout_s=30.0, engine="transformers",
                                               model_name="toy"), model) for role in ("prefill", "decode")})


def test_a_client_that_leaves_mid_transfer_leaves_both_caches_consistent(oracle: Oracle) -> None:
    """The prefill worker's backend is held (its progress thread posts nothing), so the publish
    waits once posted; the client leaves; then the transfer goes on. The decode worker drops the
    reservation once the fetch quiesced (the request is never adopted), the prefill worker
    unpins its blocks once the publish did."""
    async def main() -> None:
        expected = oracle.tokens()
        async with in_process(oracle.model) as (urls, workers):
            backend: Any = workers["prefill"].backend
            held, gate = hold_progress(backend)
            try:
                assert held.wait(10)
                async with Router([urls["prefill"]], [urls["decode"]], timeout_s=30) as router:
                    task = asyncio.create_task(router.generate(PROMPTS["left"], NEW))
                    await in_flight([task], urls["prefill"], urls["decode"])
                    assert (await gauges(urls["prefill"]))["blocks_in_use"] == 3  # pinned for the publish
                    assert (await gauges(urls["decode"]))["blocks_in_use"] == 3   # reserved for it
                    task.cancel()
                    gate.set()
                    with pytest.raises(asyncio.CancelledError):
                        await task
                    for url in urls.values():
                        await consistent(url)
                    done = await router.generate(PROMPTS["left"], NEW)
                assert done.ok and done.path == "disaggregated", done
                assert list(done.tokens) == expected["left"]
                for url in urls.values():
                    await consistent(url)
            finally:
                gate.set()

    asyncio.run(main())


# --- a hybrid model: sliding-window layers beside full attention -----------------------------
WINDOW = 24  # under the prompts' 40 tokens: the ring wrapped, so a gap anywhere recomputes from 0


async def reusable(url: str) -> dict[str, float]:
    """A hybrid cache's blocks each group may take now (no group has a total of its own)."""
    text = await request_text(url, "/metrics")
    return {s.labels["group"]: s.value for family in text_string_to_metric_families(text) for s in family.samples
            if s.name == "kvxfer_pool_blocks" and s.labels.get("state") == "reusable"}


async def hybrid_consistent(url: str, start: dict[str, float]) -> None:
    """Nothing held for any request, and each group's reusable blocks as many as at the start."""
    async def quiet() -> bool:
        g = await gauges(url)
        return all(g[k] == 0 for k in LEFT if k != "blocks_in_use") and await reusable(url) == start
    await until(f"{url} idle, both groups' blocks back", quiet)


def test_a_hybrid_prefill_worker_killed_mid_transfer(tmp_path: Path) -> None:
    """--sliding-window: each request moves two transfers, the full-attention blocks and the
    ring. Push, the prefill worker dies after each group's first block went out: the request
    (its ring wrapped) is prefilled again from 0 in the decode worker's batch, as generate_batch
    makes it; both groups' blocks go back, and the next request runs there token-identical."""
    preload("transformers.models.qwen2.modeling_qwen2")
    from kvxfer.worker.hf_engine import seeded_model

    torch.set_num_threads(1)
    group = ProcessGroup(tmp_path)
    window = ["--sliding-window", str(WINDOW)]
    with group:
        p = group.start("p", ["serve", "--role", "prefill", "--name", "p", *FLAGS, *window, *PACED])
        d = group.start("d", ["serve", "--role", "decode", "--name", "d", *FLAGS, *window])
        model = seeded_model(SHAPE, "cpu", sliding_window=WINDOW)
        expected = hf.colocated(model, [PROMPTS["killed"], PROMPTS["after"]], NEW,
                                hf.batching_config(PAGE_SIZE, BLOCKS, MAX_BATCH_TOKENS))
        group.wait_ready([p, d], 180)

        async def main() -> None:
            start = await reusable(d.url)
            assert sorted(start) == [hf.FULL, hf.SLIDING], start
            async with Router([p.url], [d.url], on_failure="recompute", timeout_s=30) as router:
                task = asyncio.create_task(router.generate(PROMPTS["killed"], NEW))
                await in_flight([task], p.url, d.url)
                p.kill()
                done = await task
            assert done.ok, done.error
            assert done.transfer is not None and done.transfer.status == "failed", done.transfer
            assert named_dead(done.transfer.reason, p), done.transfer
            assert done.recomputed_tokens == 40 and list(done.tokens) == expected[0], done
            await hybrid_consistent(d.url, start)
            async with Router([], [d.url], on_failure="recompute", timeout_s=30) as router:
                after = await router.generate(PROMPTS["after"], NEW)
            assert after.ok and after.path == "local" and list(after.tokens) == expected[1], after
            await hybrid_consistent(d.url, start)

        asyncio.run(main())
        codes = group.stop()
    assert codes == {"d": 0, "p": -9}, codes
    assert_nothing_left([{"pid": c.pid, "port": c.port} for c in (p, d)])
