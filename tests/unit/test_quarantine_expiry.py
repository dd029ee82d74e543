"""A decode reservation set aside after a bad request comes back once it is proven that no
peer can write it: hint D expired and the longest transfer begun with it could have ended
(``WorkerConfig.reclaim_grace_s``), or the publisher took hint D back (/abort rows_safe). A
refused fetch is treated like a dropped reservation. Before issue 36 each one shrank the
pool for the life of the process.

A real decode worker (loopback backend) driven in process, with hints that live 1 s."""

from __future__ import annotations

import asyncio
import base64
import re
import threading
import time
from typing import Any

import pytest
from test_router import CFG, MODEL  # noqa: I001 - pytest puts tests/unit on sys.path

from kvxfer import wire
from kvxfer.backends.loopback import LoopbackFabric
from kvxfer.contract import InvalidSubmission, Peer
from kvxfer.worker import serve
from kvxfer.worker.calls import AbortCall, GenerateCall, ReserveCall
from kvxfer.worker.config import CLOCK_SKEW_S, WorkerConfig, settle_bound
from kvxfer.worker.core import Worker

PUBLISHER = Peer("prefill-stand-in", "run-1")  # hint D is bound to it; it never publishes
BAD = 300


def _metric(text: str, name: str) -> float:
    found = re.search(rf"^{re.escape(name)} ([0-9.e+]+)$", text, re.M)
    return float(found.group(1)) if found else 0.0


async def _worker(hold_s: float, grace_s: float, blocks: int = 512) -> Worker:
    worker = Worker(WorkerConfig(role="decode", model=CFG, num_blocks=blocks, backend="loopback", name="decode-q",
                                 hold_s=hold_s, expiry_grace_s=grace_s, transfer_timeout_s=2.0,
                                 prefix_cache=False), model=MODEL, fabric=LoopbackFabric())
    await worker.start()
    return worker


def _pool_state(worker: Worker) -> tuple[int, int, int]:
    """Engine thread: (free blocks, rows set aside, open leases), after a reclaim pass."""
    state = worker._state
    state.reclaim()
    assert worker.pool is not None and worker.lender is not None
    return worker.pool.stats()["full"]["free"], state.quarantine.rows(worker.lender), worker.lender.open_leases


async def _refused_fetch(worker: Worker, rid: str, prompt: list[int]) -> int:
    """Reserve, then generate with hint D itself as hint P (a replay, refused by the decode
    backend: bound to the publisher). Returns the reservation's rows."""
    answer = await worker.reserve(ReserveCall(rid, prompt, 3, PUBLISHER))
    replayed = wire.decode_hints(base64.b64decode(answer["hint"]))
    with pytest.raises(InvalidSubmission):
        async for _ in await worker.generate(GenerateCall(rid, prefill_hint=replayed, first_token=1)):
            pass
    return int(answer["rows"])


async def _settled(worker: Worker, start_free: int, within_s: float) -> tuple[int, int, int]:
    """Wait until the pool's free count is back at ``start_free`` and nothing is set aside."""
    end = time.monotonic() + within_s
    while True:
        free, aside, open_leases = await worker._run(_pool_state, worker)
        if (free, aside, open_leases) == (start_free, 0, 0) or time.monotonic() > end:
            return free, aside, open_leases
        await asyncio.sleep(0.02)


def test_a_long_run_of_bad_requests_leaves_the_pool_as_it_found_it() -> None:
    async def main() -> None:
        worker = await _worker(hold_s=1.0, grace_s=0.2, blocks=2048)
        try:
            start_free, _, _ = await worker._run(_pool_state, worker)
            rows = 0
            for i in range(BAD):
                rid, prompt = f"bad-{i}", [(7 * i + j) % CFG.vocab_size for j in range(9)]
                if i % 3 == 0:
                    rows += await _refused_fetch(worker, rid, prompt)
                    continue
                answer = await worker.reserve(ReserveCall(rid, prompt, 3, PUBLISHER))
                rows += int(answer["rows"])
                if i % 3 == 1:  # the router gave up without proof that hint D is unused
                    assert (await worker.abort(AbortCall(rid)))["dropped"] == "reserved"
                # else: never generated; the sweeper drops it after hold_s
            text = await worker.metrics_text()
            assert _metric(text, "kvxfer_quarantined_slots") > 0  # set aside, not reused at once
            assert await _settled(worker, start_free, 15.0) == (start_free, 0, 0)
            text = worker.metrics.render()
            assert _metric(text, "kvxfer_quarantined_slots_total") == rows
            assert _metric(text, "kvxfer_reclaimed_slots_total") == rows
        finally:
            report = await worker.close()
        assert report == {"unquiesced_attempts": 0, "retained_blocks": 0}

    asyncio.run(main())


def test_rows_come_back_at_hint_expiry_plus_the_grace_and_not_before() -> None:
    async def main() -> None:
        worker = await _worker(hold_s=30.0, grace_s=4.0)  # the sweeper cannot get there first
        try:
            rows = await _refused_fetch(worker, "replayed", [3, 1, 4, 1, 5, 9, 2, 6, 5])
            quarantine = worker._state.quarantine
            entry = quarantine.exposed["replayed"]
            # Hint D lives hold_s (30 s) from its reservation; the rows 4 s longer.
            assert entry.rows == rows and 33.0 < entry.safe_at - time.monotonic() <= 34.0
            assert await worker._run(quarantine.release_expired, entry.safe_at - 0.01) == 0
            assert await worker._run(quarantine.release_expired, entry.safe_at) == 1
            assert "replayed" not in quarantine.exposed
            free, aside, open_leases = await worker._run(_pool_state, worker)
            assert (free, aside, open_leases) == (512, 0, 0)
        finally:
            await worker.close()

    asyncio.run(main())


def test_a_refused_fetch_comes_back_on_the_publishers_word() -> None:
    async def main() -> None:
        worker = await _worker(hold_s=30.0, grace_s=4.0)
        try:
            await _refused_fetch(worker, "replayed", [2, 7, 1, 8, 2, 8, 1, 8, 2])
            assert (await worker._run(_pool_state, worker))[1] > 0
            # The router's /abort with rows_safe, once the publisher withdrew hint D.
            assert (await worker.abort(AbortCall("replayed", rows_safe=True)))["dropped"] == "quarantined"
            assert await worker._run(_pool_state, worker) == (512, 0, 0)
        finally:
            await worker.close()

    asyncio.run(main())


def test_the_grace_defaults_to_the_transfer_settle_bound_plus_clock_skew() -> None:
    assert WorkerConfig(role="decode").reclaim_grace_s == settle_bound(30.0) + CLOCK_SKEW_S == 65.0
    assert WorkerConfig(role="decode", transfer_timeout_s=4.0).reclaim_grace_s == 12.0 + CLOCK_SKEW_S
    assert WorkerConfig(role="decode", expiry_grace_s=0.5).reclaim_grace_s == 0.5
    for bad in (-1.0, float("nan"), float("inf"), True, "5"):
        with pytest.raises(ValueError, match="expiry_grace_s"):
            WorkerConfig(role="decode", expiry_grace_s=bad)  # type: ignore[arg-type]


def test_a_refused_fetch_sets_its_rows_aside_on_the_engine_thread() -> None:
    """The quarantine belongs to the engine thread: its reclaim pass there replaces the lists
    that an append from the event loop's thread would go into, losing that reservation."""
    async def main() -> None:
        worker = await _worker(hold_s=30.0, grace_s=4.0)
        try:
            quarantine = worker._state.quarantine
            original, threads = quarantine.reservation, []

            def recording(*args: Any, **kwargs: Any) -> None:
                threads.append(threading.current_thread().name)
                original(*args, **kwargs)
            quarantine.reservation = recording  # type: ignore[method-assign]
            await _refused_fetch(worker, "replayed", [1, 6, 1, 8, 0, 3, 3, 9, 8])
            assert len(threads) == 1 and threads[0].startswith("kvxfer-decode-q-engine"), threads
            assert "replayed" in quarantine.exposed and (await worker._run(_pool_state, worker))[1] > 0
        finally:
            await worker.close()

    asyncio.run(main())


def test_kvxfer_serve_takes_the_grace_as_expiry_grace_and_refuses_a_bad_one_in_one_line(
        capsys: pytest.CaptureFixture[str]) -> None:
    parser = serve.build_parser()
    for argv, grace in (([], 65.0), (["--transfer-timeout", "4"], 12.0 + CLOCK_SKEW_S),
                        (["--expiry-grace", "90"], 90.0), (["--expiry-grace", "0", "--transfer-timeout", "4"], 0.0)):
        args = parser.parse_args(["--role", "decode", *argv])
        assert WorkerConfig(role="decode", **serve.timing_fields(args)).reclaim_grace_s == grace, argv
    for bad in ("-1", "nan", "inf", "soon"):
        with pytest.raises(SystemExit) as stopped:
            serve.main(["--role", "decode", "--expiry-grace", bad])
        assert stopped.value.code == 2
        lines = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
        assert len(lines) == 1 and "--expiry-grace" in lines[0], lines
