"""A worker process killed (SIGKILL) mid-run, with real processes and NIXL over host memory.

With ``on_failure="recompute"`` every request still completes token for token as colocated
generation would; with ``"fail"`` the requests caught by the kill report an error naming
the dead worker, the others still match, and nothing hangs. After each test no worker
process or port is left, and the surviving workers hold no open lease.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import pytest
import torch

from kvxfer.engine import LlamaModel, ModelConfig, colocated_generate, synthetic_prompts
from kvxfer.router import Completion, Router
from kvxfer.serving.http import request_json, request_text
from kvxfer.worker.procs import Child, ProcessGroup, children_of, port_open

torch.set_num_threads(1)
MAX_NEW = 24
PROMPTS = synthetic_prompts(16, 4, 160, ModelConfig().vocab_size, seed=11)
MODEL = LlamaModel(ModelConfig())
CHUNK_PAUSE = 1.0  # seconds between paced chunks (mid-transfer kill)
KILL_AFTER = 2.5   # seconds from the decode stream's start to the kill


@pytest.fixture(scope="module")
def expected() -> list[list[int]]:
    return [colocated_generate(MODEL, p, MAX_NEW) for p in PROMPTS]


def start(group: ProcessGroup, roles: list[str]) -> list[Child]:
    children = [group.start(f"{role}{i}", ["serve", "--role", role, "--name", f"{role}{i}", "--transfer-timeout", "10"])
                for i, role in enumerate(roles)]
    group.wait_ready(children, 180)
    return children


async def workload(router: Router, victim: Child, kill_after: int) -> list[Completion]:
    """Send every prompt (4 at a time); SIGKILL ``victim`` when ``kill_after`` have completed."""
    sem = asyncio.Semaphore(4)
    finished = 0

    async def one(prompt: list[int]) -> Completion:
        nonlocal finished
        async with sem:
            done = await router.generate(prompt, MAX_NEW)
        finished += 1
        if finished == kill_after:
            victim.kill()
        return done

    return list(await asyncio.gather(*(one(p) for p in PROMPTS)))


def check_recompute(results: list[Completion], expected: list[list[int]]) -> None:
    for done, want in zip(results, expected):
        assert done.ok, done.error
        assert list(done.tokens) == want, done.request
    assert any(d.path != "disaggregated" for d in results), "the kill hit no request"


def check_fail(results: list[Completion], expected: list[list[int]], victim: Child) -> None:
    failed = [d for d in results if not d.ok]
    assert failed, "the kill hit no request"
    for d in failed:
        # The failure names the killed worker: by URL when the router saw it die, by its NIXL
        # agent name when the surviving worker's transfer saw the disconnect first.
        error = d.error or ""
        assert victim.url in error or f"-{victim.name}-" in error or "no " in error, error
    for done, want in zip(results, expected):
        if done.ok:
            assert list(done.tokens) == want, done.request
    assert any(d.ok for d in results)


async def no_open_leases(urls: list[str]) -> None:
    deadline = time.monotonic() + 15
    pending = list(urls)
    while pending and time.monotonic() < deadline:
        texts = [await request_text(u, "/metrics") for u in pending]
        pending = [u for u, t in zip(pending, texts) if "kvxfer_open_leases 0.0\n" not in t]
        await asyncio.sleep(0.2)
    assert pending == [], "surviving workers still hold leases"
    for url in urls:
        health = await request_json(url, "GET", "/health")
        assert health["held"] == 0 and health["reserved"] == 0, health


def assert_nothing_left(children: list[Child]) -> None:
    assert children_of(os.getpid()) == []
    assert [c.name for c in children if c.alive()] == []
    assert [c.name for c in children if port_open(c.port)] == []


def test_decode_worker_killed(tmp_path: Path, expected: list[list[int]]) -> None:
    group = ProcessGroup(tmp_path)
    with group:
        p, d0, d1, d2 = start(group, ["prefill", "decode", "decode", "decode"])
        # recompute: d0 dies; requests on it continue on d1 from prompt + streamed tokens.
        router = Router([p.url], [d0.url, d1.url], on_failure="recompute", timeout_s=20)
        check_recompute(asyncio.run(workload(router, d0, 3)), expected)
        # fail: d2 (alone) dies; the requests it held report it, none hangs.
        router = Router([p.url], [d2.url], on_failure="fail", timeout_s=20)
        check_fail(asyncio.run(workload(router, d2, 3)), expected, d2)
        asyncio.run(no_open_leases([p.url, d1.url]))
    assert_nothing_left(group.children)


def test_prefill_worker_killed(tmp_path: Path, expected: list[list[int]]) -> None:
    group = ProcessGroup(tmp_path)
    with group:
        p0, p1, d = start(group, ["prefill", "prefill", "decode"])
        # recompute: p0 dies; the decode worker resumes from what arrived or prefills itself.
        router = Router([p0.url], [d.url], on_failure="recompute", timeout_s=20)
        check_recompute(asyncio.run(workload(router, p0, 3)), expected)
        # fail: p1 dies; the requests it held report it.
        router = Router([p1.url], [d.url], on_failure="fail", timeout_s=20)
        check_fail(asyncio.run(workload(router, p1, 3)), expected, p1)
        asyncio.run(no_open_leases([d.url]))
    assert_nothing_left(group.children)


def test_prefill_worker_killed_mid_transfer_resumes_from_what_arrived(tmp_path: Path) -> None:
    """Pull mode, one 32 KiB row per NIXL chunk, paced: the prefill worker dies after a few
    chunks; the decode worker keeps exactly the rows that arrived (ResumeBounds) and
    recomputes only the rest, token-identical to colocated generation.

    A worker shows no per-chunk progress (its /metrics count rows at the outcome), so the kill
    cannot wait for a landed chunk; the pacing is wide instead: the first chunk is posted at
    submission and the tenth 9 s later, and the kill comes 2.5 s after the decode stream
    started, seconds away from either end even on a loaded machine."""
    prompt = synthetic_prompts(1, 160, 160, ModelConfig().vocab_size, seed=5)[0]
    want = colocated_generate(MODEL, prompt, 8)
    group = ProcessGroup(tmp_path)
    with group:
        p = group.start("prefill", ["serve", "--role", "prefill", "--mode", "pull"])
        d = group.start("decode", ["serve", "--role", "decode", "--mode", "pull", "--nixl-chunk-bytes", "32768",
                                   "--nixl-chunk-pause", str(CHUNK_PAUSE)])
        group.wait_ready([p, d], 180)

        async def main() -> Completion:
            router = Router([p.url], [d.url], on_failure="recompute", timeout_s=20)
            task = asyncio.create_task(router.generate(prompt, 8))
            deadline = time.monotonic() + 30
            while "kvxfer_worker_active_streams 1.0\n" not in await request_text(d.url, "/metrics"):
                assert time.monotonic() < deadline and not task.done()
                await asyncio.sleep(0.02)
            await asyncio.sleep(KILL_AFTER)  # not a wait for an event: see the docstring
            p.kill()
            done = await task
            await no_open_leases([d.url])
            return done

        done = asyncio.run(main())
    assert_nothing_left(group.children)
    assert done.ok, done.error
    assert list(done.tokens) == want
    assert done.transfer is not None and done.transfer.status == "failed"
    assert 0 < done.transfer.rows_delivered < 10 == done.transfer.rows
    assert done.path == "resumed" and done.recomputed_tokens == 160 - 16 * done.transfer.rows_delivered
