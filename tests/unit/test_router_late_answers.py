"""A worker that answers /reserve or /prefill after the router's timeout: a worker's handler
runs on after its client gave up, so the reservation or prefill is still made there. The
router aborts it, and the worker drops it, as soon as it is made: nothing stays held until
``hold_s``, and a reservation whose hint D never reached a prefill worker is released, not
quarantined (the sweeper used to quarantine such rows for good)."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest
from test_router import cluster, oracle  # noqa: I001 - pytest puts tests/unit on sys.path

from kvxfer.contract import Peer
from kvxfer.router import Router
from kvxfer.serving.http import HttpServer, Request, Response, request_text
from kvxfer.worker.app import make_handler
from kvxfer.worker.calls import AbortCall, PrefillCall, ReserveCall
from kvxfer.worker.core import Worker

TIMEOUT_S = 0.5
PUB = Peer("p", "1")  # a prefill worker's identity; no publish comes in these tests


def _answers_late(inner: Any, path: str) -> Any:
    """A worker's HTTP handler that does ``path``'s work at once but answers after the router's timeout."""
    async def handler(request: Request) -> Response:
        response = await inner(request)
        if request.path.strip("/") == path:
            await asyncio.sleep(TIMEOUT_S * 3)
        return response
    return handler


async def _settled(worker: Worker) -> None:
    """Until the worker's /prefill and /reserve calls have ended (their answers may go nowhere)
    and what they left to the engine thread has run."""
    for _ in range(500):
        if not worker._starting:
            break
        await asyncio.sleep(0.01)
    else:
        raise AssertionError(f"calls still starting: {worker._starting}")
    # An aborted call frees its blocks on the engine thread after it stops starting: a job
    # queued behind that one has run once the free has (one thread, first in, first out).
    await asyncio.wrap_future(worker._exec.submit(lambda: None))


async def _nothing_held(workers: dict[str, Worker]) -> None:
    """Every worker holds no prefill, reservation, abort mark, pool request, lease or
    quarantined row (each worker's own metrics, as an operator would read them)."""
    for url, worker in workers.items():
        assert worker._held == {} and worker._reserved == {} and worker._aborted == set(), url
        assert worker.pool is not None and worker.pool.requests == (), (url, worker.pool.requests)
        text = await request_text(url, "/metrics")
        assert "kvxfer_open_leases 0.0\n" in text and "kvxfer_quarantined_slots 0.0\n" in text, (url, text)


@pytest.mark.parametrize("policy", ["fail", "recompute"])
@pytest.mark.parametrize("late", ["queued", "answer"])
@pytest.mark.parametrize("role", ["decode", "prefill"])
def test_a_call_answered_after_the_routers_timeout_leaves_nothing_held(role: str, late: str, policy: str) -> None:
    # queued: the worker's engine thread is busy, so the call waits there past the timeout
    # and the abort comes while it is being made; answer: it is made at once and its answer
    # is late, so the abort finds it made.
    path = "reserve" if role == "decode" else "prefill"
    prompt = list(range(1, 15))  # 14 tokens: 4 blocks of 4

    async def main() -> None:
        async with cluster(1, 2) as c:
            urls = {"prefill": list(c.prefill), "decode": list(c.decode)}
            slow = c.workers[urls[role][0]]
            gate = threading.Event()
            front = None
            try:
                if late == "queued":
                    slow._exec.submit(gate.wait, 30)  # the engine thread: one job at a time
                else:
                    front = HttpServer(_answers_late(make_handler(slow), path))
                    urls[role][0] = f"http://127.0.0.1:{await front.start()}"
                router = Router(urls["prefill"], urls["decode"][:1] if policy == "fail" else urls["decode"],
                                on_failure=policy, timeout_s=TIMEOUT_S)
                done = await router.generate(prompt, 3)
                await router.close()  # the aborts it sent in the background have landed
                gate.set()
                await _settled(slow)
            finally:
                gate.set()
                if front is not None:
                    await front.close()
            what = f"{path} on {urls[role][0]} failed"
            assert any(what in e for e in done.events) or (done.error is not None and what in done.error), done
            assert f"no response within {TIMEOUT_S}s" in (done.error or "".join(done.events))
            if policy == "recompute":
                assert done.ok and list(done.tokens) == oracle(prompt, 3), (done.error, done.events)
            else:
                assert not done.ok
            await _nothing_held(c.workers)  # the slow worker and every other

    asyncio.run(main())


def test_an_abort_of_a_call_in_progress_is_forgotten_when_the_call_fails() -> None:
    # The abort marks the call; a call that then fails on its own must not leave the mark
    # behind (the set would grow, and a later call of that id would be dropped).
    async def main() -> None:
        async with cluster(0, 1) as c:
            worker = c.workers[c.decode[0]]
            gate = threading.Event()
            worker._exec.submit(gate.wait, 30)
            try:
                too_long = worker.reserve(ReserveCall("x", [1, 2, 3], 10_000, PUB))
                call = asyncio.ensure_future(too_long)
                await asyncio.sleep(0.05)
                assert (await worker.abort(AbortCall("x")))["dropped"] == "starting"
            finally:
                gate.set()
            with pytest.raises(Exception, match="over max_positions"):
                await call
            assert worker._aborted == set() and worker._starting == {}
            await worker.reserve(ReserveCall("x", [1, 2, 3], 2, PUB))  # the id is free
            assert (await worker.abort(AbortCall("x", rows_safe=True)))["dropped"] == "reserved"

    asyncio.run(main())


def test_a_request_cancelled_while_its_reserve_and_prefill_run_leaves_nothing_held() -> None:
    # An embedder cancels the request (a wait_for, a server closing its streams) while both
    # calls are still being made at their workers: they complete there regardless, and the
    # router's aborts drop them as soon as they are made.
    prompt = list(range(1, 15))

    async def main() -> None:
        async with cluster(1, 1) as c:
            workers = list(c.workers.values())
            gates = [threading.Event() for _ in workers]
            for worker, gate in zip(workers, gates):
                worker._exec.submit(gate.wait, 30)  # both engine threads busy: the calls queue
            router = Router(list(c.prefill), list(c.decode), timeout_s=5.0)
            try:
                task = asyncio.ensure_future(router.generate(prompt, 3))
                for _ in range(500):  # until both calls wait at their workers
                    if all(w._starting for w in workers):
                        break
                    await asyncio.sleep(0.01)
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
                await router.close()  # the aborts it sent in the background have landed
            finally:
                for gate in gates:
                    gate.set()
            for worker in c.workers.values():
                await _settled(worker)
            await _nothing_held(c.workers)

    asyncio.run(main())


def test_an_abort_that_arrives_before_its_call_refuses_the_call() -> None:
    # The router's timer fired while its /reserve still waited to be read: the abort reaches
    # the worker first. The call, when it arrives, is refused (409) and makes nothing, where
    # it used to hold a reservation nobody would use until hold_s, then quarantine its rows.
    from kvxfer.worker.core import Aborted

    async def main() -> None:
        async with cluster(1, 1) as c:
            decode, prefill = c.workers[c.decode[0]], c.workers[c.prefill[0]]
            assert (await decode.abort(AbortCall("early", rows_safe=True)))["dropped"] is None
            assert (await prefill.abort(AbortCall("early")))["dropped"] is None
            with pytest.raises(Aborted, match="aborted before this call arrived"):
                await decode.reserve(ReserveCall("early", [1, 2, 3], 2, PUB))
            with pytest.raises(Aborted, match="aborted before this call arrived"):
                await prefill.prefill(PrefillCall("early", [1, 2, 3]))
            for worker in (decode, prefill):
                assert worker._reserved == {} and worker._held == {} and worker._aborted_early == {}
                assert worker.pool is not None and worker.pool.requests == ()
            # The refusal used the abort up: the id can be used again.
            await decode.reserve(ReserveCall("early", [1, 2, 3], 2, PUB))
            assert (await decode.abort(AbortCall("early", rows_safe=True)))["dropped"] == "reserved"

    asyncio.run(main())


def test_a_client_that_leaves_while_the_router_waits_for_publish_costs_no_rows() -> None:
    # The router's stream sends keepalives while /publish is slow (the prefill engine busy),
    # and the client leaves at one. The request is closed at the router's next item, where
    # its worker calls settle: no reservation is left to expire and be quarantined (hint D
    # had reached the prefill worker, so an abort could only have quarantined the rows).
    from kvxfer.router.app import make_handler as router_handler
    from kvxfer.serving.http import stream_json

    def slow_publish(inner: Any) -> Any:
        async def handler(request: Request) -> Response:
            if request.path.strip("/") == "publish":
                await asyncio.sleep(1.0)
            return await inner(request)
        return handler

    async def main() -> None:
        async with cluster(1, 1, hold_s=3.0) as c:  # longer than the slow publish, short for a test
            front = HttpServer(slow_publish(make_handler(c.workers[c.prefill[0]])))
            router = Router([f"http://127.0.0.1:{await front.start()}"], c.decode, timeout_s=5.0)
            server = HttpServer(router_handler(router, keepalive_s=0.2))
            url = f"http://127.0.0.1:{await server.start()}"
            try:
                seen = []
                events = stream_json(url, "/generate", {"prompt": list(range(1, 15)), "max_new_tokens": 3}, 5, 5)
                async for event in events:
                    seen.append(event["event"])
                    if event["event"] == "waiting":
                        break
                await events.aclose()
                assert seen == ["token", "waiting"], seen
                for worker in c.workers.values():  # settled, and past hold_s for the sweeper
                    for _ in range(400):
                        if not (worker._held or worker._reserved or worker._active):
                            break
                        await asyncio.sleep(0.01)
                await asyncio.sleep(3.5)  # past hold_s: an unclaimed reservation would be quarantined by now
            finally:
                await server.close()
                await router.close()
                await front.close()
            await _nothing_held(c.workers)

    asyncio.run(main())
