"""Router and worker logic with real workers in this process: real Worker objects behind real
HTTP servers, moving rows with the loopback backend (one fabric), checked against the
colocated oracle. Processes and NIXL are covered by tests/e2e and tests/chaos."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from kvxfer.backends.loopback import LoopbackBackend, LoopbackFabric
from kvxfer.engine import LlamaModel, ModelConfig, colocated_generate, synthetic_prompts
from kvxfer.router import Completion, InvalidRequest, Router, Token
from kvxfer.serving.http import HttpError, HttpServer, Request, Response, request_json, request_text
from kvxfer.serving.keys import BearerKey
from kvxfer.worker.app import make_handler
from kvxfer.worker.core import Worker, WorkerConfig

torch.set_num_threads(1)
CFG = ModelConfig(vocab_size=128, hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, intermediate=96,
                  block_tokens=4)
MODEL = LlamaModel(CFG)


@dataclass
class Cluster:
    prefill: list[str]
    decode: list[str]
    workers: dict[str, Worker]
    servers: list[HttpServer]


@contextlib.asynccontextmanager
async def cluster(n_prefill: int = 1, n_decode: int = 1, cluster_key: BearerKey | None = None,
                  **config: object) -> AsyncIterator[Cluster]:
    fabric = LoopbackFabric()
    servers: list[HttpServer] = []
    workers: dict[str, Worker] = {}
    urls: dict[str, list[str]] = {"prefill": [], "decode": []}
    try:
        for role, count in (("prefill", n_prefill), ("decode", n_decode)):
            for i in range(count):
                worker = Worker(WorkerConfig(role=role, model=CFG, num_blocks=256, backend="loopback",
                                             name=f"{role}{i}", transfer_timeout_s=5.0, **config),  # type: ignore[arg-type]
                                model=MODEL, fabric=fabric)
                await worker.start()
                server = HttpServer(make_handler(worker, cluster_key=cluster_key))
                port = await server.start()
                servers.append(server)
                url = f"http://127.0.0.1:{port}"
                workers[url] = worker
                urls[role].append(url)
        yield Cluster(urls["prefill"], urls["decode"], workers, servers)
    finally:
        for server in servers:
            await server.close()
        for worker in workers.values():
            await worker.close()


def oracle(prompt: list[int], n: int) -> list[int]:
    return colocated_generate(MODEL, prompt, n)


def backend(worker: Worker) -> LoopbackBackend:
    assert isinstance(worker.backend, LoopbackBackend)
    return worker.backend


def test_router_streams_token_identical_completions() -> None:
    prompts = synthetic_prompts(8, 1, 41, CFG.vocab_size, seed=2)

    async def main() -> None:
        async with cluster() as c:
            router = Router(c.prefill, c.decode)

            async def one(prompt: list[int]) -> tuple[list[Token], Completion]:
                tokens: list[Token] = []
                async for item in router.stream(prompt, 6):
                    if isinstance(item, Completion):
                        return tokens, item
                    tokens.append(item)
                raise AssertionError("no completion")

            results = await asyncio.gather(*(one(p) for p in prompts))
            for prompt, (tokens, done) in zip(prompts, results):
                assert done.ok, done.error
                assert list(done.tokens) == oracle(prompt, 6)
                assert [t.index for t in tokens] == list(range(6))
                assert [t.token for t in tokens] == list(done.tokens)
                assert done.path == "disaggregated" and done.recomputed_tokens == 0
                blocks = -(-len(prompt) // CFG.block_tokens)
                assert done.transfer is not None and done.transfer.status == "delivered"
                assert done.transfer.rows == done.transfer.rows_delivered == blocks
                assert done.transfer.bytes == blocks * CFG.group_spec().row_bytes
                assert done.ttft_s is not None and 0 < done.ttft_s <= done.total_s
            text = await request_text(c.decode[0], "/metrics")
            assert f'kvxfer_transfers_total{{status="delivered"}} {len(prompts)}.0\n' in text
            assert "kvxfer_open_leases 0.0\n" in text
            assert f'kvxfer_router_requests_total{{path="disaggregated",result="ok"}} {len(prompts)}.0\n' \
                in router.metrics_text()

    asyncio.run(main())


def test_round_robin_and_least_outstanding_pick_differently() -> None:
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]

    async def main() -> None:
        async with cluster(1, 2) as c:
            for selection, want in (("round_robin", [1, 0]), ("least_outstanding", [1, 1])):
                router = Router(c.prefill, c.decode, selection=selection)
                held = router.stream(prompt, 40)
                first = await held.__anext__()  # request 1 stays open on decode worker 0
                assert isinstance(first, Token)
                picked = []
                for _ in range(2):
                    done = await router.generate(prompt, 3)
                    assert done.ok and list(done.tokens) == oracle(prompt, 3)
                    picked.append(c.decode.index(done.decode))
                assert picked == want, selection
                rest = [item async for item in held]
                assert isinstance(rest[-1], Completion) and rest[-1].ok and c.decode.index(rest[-1].decode) == 0

    asyncio.run(main())


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_partial_transfer_follows_the_failure_policy(policy: str) -> None:
    prompt = synthetic_prompts(1, 30, 30, CFG.vocab_size, seed=4)[0]

    async def main() -> None:
        async with cluster() as c:
            backend(c.workers[c.prefill[0]]).fail_after_rows = 2  # the publisher (push) fails after 2 rows
            done = await Router(c.prefill, c.decode, on_failure=policy).generate(prompt, 5)
            assert done.transfer is not None and done.transfer.status == "failed"
            assert done.transfer.rows_delivered == 2 and done.transfer.rows == 8
            if policy == "fail":
                assert done.error is not None and "2 of 8 rows arrived" in done.error and "policy" in done.error
                assert list(done.tokens) == oracle(prompt, 5)[:1]  # only the prefill worker's token
            else:
                assert done.ok, done.error
                assert list(done.tokens) == oracle(prompt, 5)
                assert done.path == "resumed" and done.recomputed_tokens == 30 - 2 * CFG.block_tokens
            text = await request_text(c.decode[0], "/metrics")
            assert 'kvxfer_transfer_failures_total{reason="injected"} 1.0\n' in text
            assert "kvxfer_open_leases 0.0\n" in text

    asyncio.run(main())


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_unreachable_prefill_worker_follows_the_failure_policy(policy: str) -> None:
    prompt = [7, 7, 1, 2, 3]

    async def main() -> None:
        async with cluster(0, 1) as c:
            dead = HttpServer(make_handler(c.workers[c.decode[0]]))
            dead_url = f"http://127.0.0.1:{await dead.start()}"
            await dead.close()  # nothing listens there any more
            router = Router([dead_url], c.decode, on_failure=policy, probe_interval_s=60)
            done = await router.generate(prompt, 4)
            if policy == "fail":
                assert done.error is not None and dead_url in done.error and "cannot connect" in done.error
                again = await router.generate(prompt, 4)  # now known down: refused without trying
                assert again.error is not None and "no prefill worker is reachable" in again.error
            else:
                assert done.ok and list(done.tokens) == oracle(prompt, 4) and done.path == "local"
                assert done.recomputed_tokens == len(prompt)
            text = await request_text(c.decode[0], "/metrics")
            assert "kvxfer_open_leases 0" in text

    asyncio.run(main())


def test_silent_decode_worker_times_out_with_a_named_error() -> None:
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await asyncio.sleep(30)

    async def main() -> None:
        async with cluster(1, 0) as c:
            server = await asyncio.start_server(silent, "127.0.0.1", 0)
            url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
            try:
                router = Router(c.prefill, [url], timeout_s=0.5)
                done = await router.generate([1, 2, 3], 4)  # the error names the 0.5 s limit it hit
                assert done.error is not None and url in done.error and "no response within 0.5s" in done.error
                health = await request_json(c.prefill[0], "GET", "/health")
                assert health["held"] == 0  # the router told the prefill worker to drop the request
            finally:
                server.close()
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(server.wait_closed(), 1)

    asyncio.run(main())


def test_workers_refuse_malformed_calls_with_named_errors() -> None:
    async def main() -> None:
        async with cluster() as c:
            p, d = c.prefill[0], c.decode[0]
            cases = [
                (p, "/prefill", {"request": "x", "prompt": []}, "'prompt' must be a non-empty list"),
                (p, "/prefill", {"request": "x", "prompt": [1, 999]}, "[0, 128)"),
                (p, "/reserve", {"request": "x", "prompt": [1], "max_new_tokens": 2}, "this is a prefill worker"),
                (d, "/reserve", {"request": "x", "prompt": [1], "max_new_tokens": 0}, "'max_new_tokens'"),
                (p, "/publish", {"request": "never", "hint": "AAAA"}, "WireError"),  # malformed before unknown
            ]
            for url, path, body, words in cases:
                with pytest.raises(HttpError) as info:
                    await request_json(url, "POST", path, body)
                assert info.value.status == 400 and words in str(info.value), (path, str(info.value))
            publisher = (await request_json(p, "GET", "/health"))["publisher"]
            hint = (await request_json(d, "POST", "/reserve", {"request": "h", "prompt": [1, 2], "max_new_tokens": 2,
                                                               "publisher": publisher}))["hint"]
            with pytest.raises(HttpError, match="not held here") as info:
                await request_json(p, "POST", "/publish", {"request": "never", "hint": hint})
            assert info.value.status == 400
            await request_json(d, "POST", "/abort", {"request": "h", "rows_safe": True})
            await request_json(p, "POST", "/prefill", {"request": "y", "prompt": [1, 2]})
            with pytest.raises(HttpError, match="WireError") as info:
                await request_json(p, "POST", "/publish", {"request": "y", "hint": "AAAA"})
            assert info.value.status == 400
            await request_json(p, "POST", "/abort", {"request": "y"})
            assert (await request_json(p, "GET", "/health"))["held"] == 0

    asyncio.run(main())


def test_workers_of_different_models_refuse_each_other_before_any_byte_moves() -> None:
    """A layout mismatch is refused by the publisher before it submits (409), so the decode
    rows are safe to reuse; the router names the refusal, or, recomputing, the split."""
    prompt = [9, 8, 7, 6, 5, 4]

    async def main() -> None:
        other = LlamaModel(CFG.with_(seed=1))
        fabric = LoopbackFabric()
        p = Worker(WorkerConfig(role="prefill", model=CFG, num_blocks=64, backend="loopback", name="p"),
                   model=MODEL, fabric=fabric)
        d = Worker(WorkerConfig(role="decode", model=other.config, num_blocks=64, backend="loopback", name="d"),
                   model=other, fabric=fabric)
        servers = [HttpServer(make_handler(w)) for w in (p, d)]
        try:
            for w in (p, d):
                await w.start()
            urls = [f"http://127.0.0.1:{await s.start()}" for s in servers]
            for policy in ("fail", "recompute"):
                done = await Router(urls[:1], urls[1:], on_failure=policy).generate(prompt, 3)
                assert done.transfer is None
                if policy == "fail":
                    assert done.error is not None and "publish on" in done.error and "HTTP 409" in done.error
                    assert "layout" in done.error.lower()
                else:  # the decode worker recomputes with its own model: the router sees the split
                    assert done.error is not None and "token 0 diverged on recompute" in done.error
                    assert done.path == "local" and list(done.tokens) == colocated_generate(MODEL, prompt, 1)
            text = await request_text(urls[1], "/metrics")
            assert "kvxfer_quarantined_slots 0.0\n" in text and "kvxfer_open_leases 0.0\n" in text
            assert 'kvxfer_transfers_total' not in text.replace("# HELP kvxfer_transfers_total", "").replace(
                "# TYPE kvxfer_transfers_total", "")  # no transfer was ever submitted
        finally:
            for s in servers:
                await s.close()
            for w in (p, d):
                await w.close()

    asyncio.run(main())


def test_reservation_dropped_without_proof_is_quarantined() -> None:
    """Rows a prefill worker may still write into (it holds hint D, and nothing proves it
    stopped) are never reused; rows it cannot reach are released."""
    async def main() -> None:
        async with cluster(0, 1) as c:
            d = c.decode[0]
            for rid, safe in (("a", False), ("b", True)):
                await request_json(d, "POST", "/reserve", {"request": rid, "prompt": list(range(10)),
                                                          "max_new_tokens": 2, "publisher": {"agent": "p", "run": "1"}})
                dropped = await request_json(d, "POST", "/abort", {"request": rid, "rows_safe": safe})
                assert dropped["dropped"] == "reserved"
            text = await request_text(d, "/metrics")
            assert "kvxfer_quarantined_slots 3.0\n" in text  # request a: 10 tokens = 3 blocks of 4
            assert "kvxfer_open_leases 1.0\n" in text  # a's lease is held for good; b's was released
            blocks = {line.split("} ")[0]: float(line.split("} ")[1]) for line in text.splitlines()
                      if line.startswith("kvxfer_pool_blocks{")}
            assert blocks['kvxfer_pool_blocks{group="full",state="pinned"'] == 3

    asyncio.run(main())


def test_decode_worker_with_the_prefix_cached_asks_only_for_the_rest() -> None:
    """The decode worker keeps a finished prompt's full blocks; the same prefix later moves
    only the blocks it lacks, and decodes to the same tokens."""
    prompt = synthetic_prompts(1, 22, 22, CFG.vocab_size, seed=9)[0]  # 5 full blocks of 4, and 2 tokens

    async def main() -> None:
        async with cluster() as c:
            router = Router(c.prefill, c.decode)
            first = await router.generate(prompt, 4)
            again = await router.generate(prompt, 4)
            longer = await router.generate(prompt + [1, 2, 3, 4, 5, 6], 4)
            assert [list(d.tokens) for d in (first, again)] == [oracle(prompt, 4)] * 2
            assert list(longer.tokens) == oracle(prompt + [1, 2, 3, 4, 5, 6], 4)
            assert first.transfer is not None and first.transfer.rows_delivered == 6
            # The last token's block always moves; the 5 cached full blocks do not.
            assert again.transfer is not None and again.transfer.rows_delivered == 1
            assert longer.transfer is not None and longer.transfer.rows_delivered == 7 - 5
            assert all(d.transfer is not None and d.transfer.status == "delivered" for d in (first, again, longer))

    asyncio.run(main())


def test_a_client_that_leaves_mid_stream_stops_the_decode_and_frees_its_rows() -> None:
    async def main() -> None:
        async with cluster() as c:
            router = Router(c.prefill, c.decode)
            stream = router.stream([5, 4, 3, 2, 1], 400)
            got = [await stream.__anext__() for _ in range(3)]
            assert [t.index for t in got if isinstance(t, Token)] == [0, 1, 2]
            await stream.aclose()
            d = c.decode[0]
            for _ in range(100):
                text = await request_text(d, "/metrics")
                if "kvxfer_worker_active_streams 0.0\n" in text:
                    break
                await asyncio.sleep(0.02)
            assert "kvxfer_worker_active_streams 0.0\n" in text and "kvxfer_open_leases 0.0\n" in text
            produced = float(text.split("\nkvxfer_generated_tokens_total ")[1].split()[0])
            assert produced < 100  # stopped long before the 400 tokens asked for
            assert c.workers[d].pool is not None and c.workers[d].pool.requests == ()

    asyncio.run(main())


def test_a_client_that_leaves_before_the_transfer_frees_both_ends() -> None:
    # The client takes the first token (from the prefill worker) and leaves before hint D
    # went to the prefill worker: both ends drop the request now, and the decode worker's
    # reserved rows are released (nothing can write into them), not quarantined later.
    async def main() -> None:
        async with cluster() as c:
            router = Router(c.prefill, c.decode)
            stream = router.stream([5, 4, 3, 2, 1], 8)
            first = await stream.__anext__()
            assert isinstance(first, Token) and first.index == 0
            await stream.aclose()
            p, d = c.prefill[0], c.decode[0]
            for _ in range(200):
                if c.workers[p].pool.requests == () and c.workers[d].pool.requests == ():  # type: ignore[union-attr]
                    break
                await asyncio.sleep(0.01)
            text = await request_text(d, "/metrics")
            assert c.workers[d].pool.requests == () and c.workers[p].pool.requests == ()  # type: ignore[union-attr]
            assert "kvxfer_open_leases 0.0\n" in text and "kvxfer_quarantined_slots 0.0\n" in text, text

    asyncio.run(main())


def _cutting(inner: Any, at: Any, after: bool) -> Any:
    """A worker's HTTP handler whose /generate stream is cut at the first chunk ``at`` accepts
    (``after``: once that chunk is sent, else before it): the worker's death, as the router sees it."""
    async def handler(request: Request) -> Response:
        response = await inner(request)
        if request.path.strip("/") != "generate" or response.stream is None:
            return response
        source = response.stream

        async def cut():  # type: ignore[no-untyped-def]
            try:
                async for chunk in source:
                    if at(chunk) and not after:
                        return
                    yield chunk
                    if at(chunk):
                        return
            finally:
                await source.aclose()
        return Response(200, b"", response.content_type, cut())
    return handler


def test_a_decode_worker_cut_after_its_last_token_leaves_the_request_complete() -> None:
    # The worker streams every token asked for, then its stream is cut before "done": the
    # request is complete (recomputing 0 tokens elsewhere was a 400 that failed it).
    async def main() -> None:
        async with cluster(1, 2) as c:
            # The worker is gone between its last token and "done".
            server = HttpServer(_cutting(make_handler(c.workers[c.decode[0]]), lambda chunk: b'"done"' in chunk, False))
            port = await server.start()
            try:
                router = Router(c.prefill, [f"http://127.0.0.1:{port}", c.decode[1]], on_failure="recompute")
                prompt = list(range(1, 20))
                done = await router.generate(prompt, 4)
                assert done.ok and list(done.tokens) == oracle(prompt, 4), done.error
            finally:
                await server.close()

    asyncio.run(main())


def test_worker_ids_in_use_and_lengths_are_refused_before_anything_is_touched() -> None:
    # A local /generate whose id a /reserve took before the stream started fails alone: the
    # reservation stays whole (the stream's clean-up used to drop it and free its rows). Two
    # prefills of one id at once: the second is a 400, not a pool error (500). A local
    # /generate past max_positions is refused before it streams anything.
    from kvxfer.contract import Peer
    from kvxfer.worker.calls import AbortCall, GenerateCall, PrefillCall, ReserveCall
    from kvxfer.worker.core import Refused

    async def main() -> None:
        worker = Worker(WorkerConfig(role="decode", model=CFG, num_blocks=256, backend="loopback"), model=MODEL,
                        fabric=LoopbackFabric())
        await worker.start()
        prefill = Worker(WorkerConfig(role="prefill", model=CFG, num_blocks=256, backend="loopback"), model=MODEL,
                         fabric=LoopbackFabric())
        await prefill.start()
        try:
            stream = await worker.generate(GenerateCall("X", prompt=[1, 2, 3, 4, 5], max_new_tokens=3))
            await worker.reserve(ReserveCall("X", list(range(1, 30)), 3, Peer("p", "1")))
            with pytest.raises(ValueError, match="already"):
                async for _ in stream:
                    pass
            assert "X" in worker._reserved and worker.pool is not None and worker.pool.has("X")
            assert (await worker.abort(AbortCall("X", rows_safe=True)))["dropped"] == "reserved"
            assert worker._quarantined == [] and worker.lender is not None and worker.lender.open_leases == 0

            results = await asyncio.gather(*(prefill.prefill(PrefillCall("same", list(range(1, 30))))
                                             for _ in range(2)), return_exceptions=True)
            assert sum(isinstance(r, dict) for r in results) == 1, results
            assert any(isinstance(r, Refused) and "already held" in str(r) for r in results), results

            too_long = CFG.max_positions
            with pytest.raises(Refused, match="over max_positions"):
                await worker.generate(GenerateCall("Y", prompt=[1, 2, 3], max_new_tokens=too_long))
        finally:
            await worker.close()
            await prefill.close()

    asyncio.run(main())


def test_without_prefill_workers_a_lost_decode_worker_is_replaced_and_bad_input_blames_nobody() -> None:
    # No prefill worker: the decode worker prefills; its stream is cut after one token, and
    # another decode worker goes on from there (policy recompute). A token id outside the
    # vocabulary is the client's mistake: the request fails, and no worker counts a failure.
    async def main() -> None:
        async with cluster(0, 2) as c:
            # The worker is gone after its second token.
            server = HttpServer(_cutting(make_handler(c.workers[c.decode[0]]), lambda chunk: b'"index": 1' in chunk,
                                         True))
            port = await server.start()
            try:
                router = Router([], [f"http://127.0.0.1:{port}", c.decode[1]], on_failure="recompute")
                prompt = [9, 8, 7, 6, 5]
                done = await router.generate(prompt, 6)
                assert done.ok and list(done.tokens) == oracle(prompt, 6), done.error
                router = Router([], [c.decode[1]], on_failure="recompute")
                # Refused in this process, as over HTTP, before any worker sees it.
                with pytest.raises(InvalidRequest, match=r"token ids must lie in \[0, 128\) for the workers' model 'toy'"):
                    await router.generate([1, 2, CFG.vocab_size + 5], 3)
                assert "kvxfer_router_worker_failures_total{" not in router.metrics_text()
                assert "kvxfer_router_requests_total{" not in router.metrics_text()
            finally:
                await server.close()

    asyncio.run(main())


def test_rows_caught_wrong_by_the_recomputed_first_token_are_not_kept_for_prefix_reuse() -> None:
    # Part of the prompt arrives, the decode worker recomputes the rest, and its first token
    # differs from the prefill worker's: the rows that arrived are wrong (here, a prefill
    # worker with other weights stands for corrupt rows). The request fails, and those blocks
    # must not be named for reuse: a later request with the same prompt on that worker used
    # to reuse them and answer wrong tokens with no error.
    prompt = synthetic_prompts(1, 30, 30, CFG.vocab_size, seed=4)[0]

    async def scenario() -> tuple[Completion, Completion]:
        async with cluster() as c:
            pw, dw = c.workers[c.prefill[0]], c.workers[c.decode[0]]
            pw.model = LlamaModel(CFG.with_(seed=1))
            backend(pw).fail_after_rows = 2
            first = await Router(c.prefill, c.decode, on_failure="recompute").generate(prompt, 5)
            assert dw.pool is not None
            cached = sum(g.get("cached", 0) for g in dw.pool.stats().values())
            assert cached == 0, f"{cached} blocks of the failed request are kept for reuse"
            again = await Router([], c.decode, on_failure="recompute").generate(prompt, 5)
            return first, again

    first, again = asyncio.run(scenario())
    assert not first.ok and "differs from the prefill worker's" in (first.error or ""), first.error
    assert again.ok and list(again.tokens) == oracle(prompt, 5), (list(again.tokens), oracle(prompt, 5))
