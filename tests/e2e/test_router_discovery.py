"""Discovery end to end, as separate processes and a real etcd: `kvxfer serve --etcd` workers
register themselves, and `kvxfer router --etcd` (no static URL) follows them. Its output is
token-identical to colocated generation; a worker stopped with SIGSTOP (its keepalive stops)
is dropped once its lease lapses and the others keep serving, and it rejoins when it
continues; a worker started later joins; a clean SIGTERM deregisters a worker at once; a
worker that cannot reach etcd exits 2 with one line and never announces itself ready."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from kvxfer.engine import LlamaModel, ModelConfig, colocated_generate, synthetic_prompts
from kvxfer.etcd import EtcdClient
from kvxfer.serving.discovery import WorkerRecord, workers_prefix
from kvxfer.testing.etcd_server import EtcdServer
from kvxfer.worker.procs import Child, ProcessFailed, ProcessGroup, children_of

MODEL = LlamaModel(ModelConfig())
PROMPTS = synthetic_prompts(4, 20, 70, MODEL.config.vocab_size, seed=27)
NEW = 5
TTL = 3
MARGIN_S = 15.0  # a loaded 2-core machine: etcd's expiry, the watch, the router's loop


@pytest.fixture(autouse=True)
def no_child_left_behind(etcd_server: EtcdServer) -> Iterator[None]:
    """This module's etcd is a child of the test run for the whole module (tests/conftest.py
    checks it ends with the module); every other child must end with its test."""
    yield
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and set(children_of(os.getpid())) - {etcd_server.process.pid}:
        time.sleep(0.1)
    assert set(children_of(os.getpid())) - {etcd_server.process.pid} == set(), "a test left a child process running"


def _health(url: str) -> dict[str, Any]:
    """GET /health, whatever its status (a router without a usable pair answers 503)."""
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=30) as answer:
            return dict(json.loads(answer.read()))
    except urllib.error.HTTPError as exc:
        return dict(json.loads(exc.read()))


def _members(router: Child) -> set[str]:
    return set(_health(router.url)["discovery"]["members"].values())


def _wait(condition: Callable[[], bool], timeout: float, what: str) -> float:
    start = time.monotonic()
    while not condition():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"not within {timeout:.0f} s: {what}")
        time.sleep(0.1)
    return time.monotonic() - start


async def _generate(url: str, prompts: list[list[int]]) -> list[dict[str, Any]]:
    import aiohttp

    done = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as http:
        for prompt in prompts:
            async with http.post(f"{url}/generate", json={"prompt": prompt, "max_new_tokens": NEW}) as answer:
                lines = [json.loads(line) async for line in answer.content if line.strip()]
            done.append([e for e in lines if e.get("event") == "done"][0]["completion"])
    return done


def _serve_checked(router: Child, prompts: list[list[int]] = PROMPTS) -> set[str]:
    """Every prompt through the router, token-identical to colocated generation; the prefill
    workers that served them."""
    completions = asyncio.run(_generate(router.url, prompts))
    for prompt, c in zip(prompts, completions):
        assert c["error"] is None and list(c["tokens"]) == colocated_generate(MODEL, prompt, NEW), c
        assert c["path"] == "disaggregated", c
    return {c["prefill"] for c in completions}


def test_a_router_follows_the_workers_registered_in_etcd(etcd_server: EtcdServer, tmp_path: Path) -> None:
    torch.set_num_threads(1)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("NIXL_ETCD_ENDPOINTS", None)  # NIXL's metadata travels in the hints; discovery is --etcd
    etcd = ["--etcd", etcd_server.endpoint, "--etcd-namespace", "e2e"]
    client = EtcdClient(etcd_server.endpoint)

    def worker(group: ProcessGroup, name: str, role: str, ttl: int = TTL) -> Child:
        return group.start(name, ["serve", "--role", role, "--name", name, "--port", "0", "--blocks", "256",
                                  *etcd, "--etcd-ttl", str(ttl)], env)

    def keys() -> dict[str, str]:
        found, _ = client.get_prefix(workers_prefix("e2e"))
        return {WorkerRecord.decode(value).name: key for key, value in found.items()}

    with ProcessGroup(tmp_path) as group:
        workers = {name: worker(group, name, role) for name, role in
                   (("prefill-a", "prefill"), ("prefill-b", "prefill"), ("decode", "decode"))}
        group.wait_ready(list(workers.values()), timeout=180)
        assert set(keys()) == set(workers)  # registered before they said they were ready
        assert _health(workers["decode"].url)["discovery"]["registered"] is True
        router = group.start("router", ["router", "--port", "0", *etcd, "--log-level", "INFO"], env)
        group.wait_ready([router], timeout=60)
        urls = {w.url for w in workers.values()}
        _wait(lambda: _members(router) == urls, 30, "the router lists the three workers")
        assert _serve_checked(router) == {workers["prefill-a"].url, workers["prefill-b"].url}

        # SIGSTOP: the keepalive stops, the lease lapses, the router drops the worker.
        stopped = workers["prefill-a"]
        os.kill(stopped.pid, signal.SIGSTOP)
        try:
            start = time.monotonic()
            key_gone = _wait(lambda: "prefill-a" not in keys(), TTL + MARGIN_S, "the stopped worker's key lapses")
            dropped = _wait(lambda: stopped.url not in _members(router), TTL + MARGIN_S - key_gone,
                            "the router drops the stopped worker") + key_gone
            print(f"SIGSTOP -> key gone {key_gone:.2f} s, router dropped it {dropped:.2f} s (TTL {TTL} s)")
            assert dropped <= TTL + MARGIN_S
            assert _serve_checked(router) == {workers["prefill-b"].url}  # the others serve every request
        finally:
            os.kill(stopped.pid, signal.SIGCONT)
        rejoined = _wait(lambda: stopped.url in _members(router), 30, "the continued worker registers again")
        print(f"SIGCONT -> back in the router after {rejoined:.2f} s")

        # A worker started later joins, and serves; a long TTL, so that only its revocation can
        # drop it quickly when it stops.
        late = worker(group, "prefill-c", "prefill", ttl=60)
        group.wait_ready([late], timeout=180)
        _wait(lambda: late.url in _members(router), 30, "the late worker joins")
        served = _serve_checked(router, PROMPTS * 2)
        assert late.url in served and stopped.url in served, served

        late.proc.send_signal(signal.SIGTERM)
        start = time.monotonic()
        assert late.proc.wait(30) == 0
        exited = time.monotonic() - start
        assert "prefill-c" not in keys()  # revoked before it exited
        dropped = _wait(lambda: late.url not in _members(router), 10, "the router drops the stopped worker")
        print(f"SIGTERM -> exited in {exited:.2f} s, key gone before that, router dropped it {dropped:.2f} s later "
              "(TTL 60 s)")
        assert _serve_checked(router, PROMPTS[:2]) <= {workers["prefill-a"].url, workers["prefill-b"].url}
        assert "discovery: prefill worker" in (tmp_path / "router.log").read_text()
        codes = group.stop()
    assert codes == {"router": 0, "decode": 0, "prefill-a": 0, "prefill-b": 0, "prefill-c": 0}, codes
    assert keys() == {}  # every worker took its key back


def test_a_worker_that_cannot_reach_etcd_exits_2_without_announcing_ready(tmp_path: Path) -> None:
    import socket

    with socket.socket() as held:  # a port nothing answers on
        held.bind(("127.0.0.1", 0))
        port = held.getsockname()[1]
    with ProcessGroup(tmp_path) as group:
        child = group.start("prefill", ["serve", "--role", "prefill", "--port", "0",
                                        "--etcd", f"http://127.0.0.1:{port}"])
        with pytest.raises(ProcessFailed, match="exited with 2 before it was ready"):
            child.wait_ready(120)
    log = (tmp_path / "prefill.log").read_text()
    errors = [line for line in log.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and errors[0].startswith("kvxfer serve: error: --etcd http://127.0.0.1:"), log
    assert f"127.0.0.1:{port}" in errors[0] and "Traceback" not in log, log
