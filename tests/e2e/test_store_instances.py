"""Two instances, one store, as separate processes: `kvxfer serve --store ...` workers behind a
router serve some prompts and stop; a second instance (fresh workers, empty caches, a new
router) serves the same prompts and takes their blocks from the store, token-identical to
colocated generation. Over the /dev/shm store (--store memory) and a real Mooncake Store
whose memory a store server holds (mooncake_master --segment-mib), so that blobs outlive the
workers that put them."""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvxfer.engine import LlamaModel, ModelConfig, colocated_generate, synthetic_prompts
from kvxfer.serving.http import request_json, request_text
from kvxfer.worker.procs import ProcessGroup

MODEL = LlamaModel(ModelConfig())
PROMPTS = synthetic_prompts(3, 40, 90, MODEL.config.vocab_size, seed=21)
NEW = 6


def _instance(tmp: Path, name: str, store: list[str]) -> Iterator[tuple[str, str, str]]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with ProcessGroup(tmp / name) as group:
        workers = [group.start(role, ["serve", "--role", role, "--port", "0", "--blocks", "256", *store], env)
                   for role in ("prefill", "decode")]
        group.wait_ready(workers, timeout=120)
        router = group.start("router", ["router", "--port", "0", "--prefill", workers[0].url, "--decode",
                                        workers[1].url], env)
        group.wait_ready([router], timeout=60)
        yield router.url, workers[0].url, workers[1].url
        codes = group.stop()
        assert set(codes.values()) == {0}, codes


async def _serve(url: str) -> None:
    for prompt in PROMPTS:
        body = {"prompt": prompt, "max_new_tokens": NEW}
        import aiohttp

        async with aiohttp.ClientSession() as http, http.post(f"{url}/generate", json=body) as answer:
            lines = [line async for line in answer.content]
        done = [e for e in map(__import__("json").loads, lines) if e.get("event") == "done"][0]["completion"]
        assert done["error"] is None and list(done["tokens"]) == colocated_generate(MODEL, prompt, NEW), done


def _hits(metrics: str, op: str) -> float:
    found = re.search(rf'kvxfer_store_rows_total\{{op="{op}",result="hit"\}} (\S+)', metrics)
    return float(found.group(1)) if found else 0.0


def _two_instances(tmp: Path, store: list[str]) -> None:
    import asyncio

    torch.set_num_threads(1)
    named = sum((len(p) - 1) // MODEL.config.block_tokens for p in PROMPTS)
    for name in ("first", "second"):
        for router, prefill, decode in _instance(tmp, name, store):
            asyncio.run(_serve(router))
            put = _hits(asyncio.run(request_text(prefill, "/metrics")), "put")
            got = _hits(asyncio.run(request_text(decode, "/metrics")), "get")
            health = asyncio.run(request_json(decode, "GET", "/health"))
            assert health["status"] == "ok"
            if name == "first":
                assert put == named and got <= named  # prompts share no prefix: little or nothing to take
            else:
                assert got == named, (got, named)  # every named block came from the store


def test_a_second_instance_takes_the_prompts_from_the_shm_store(tmp_path: Path) -> None:
    store = tmp_path / "store"
    _two_instances(tmp_path, ["--store", "memory", "--store-path", str(store)])
    # Each named block and, with row integrity on (the default), its digest under a key of its own.
    assert len(list(store.iterdir())) == 2 * sum((len(p) - 1) // MODEL.config.block_tokens for p in PROMPTS)


def test_a_second_instance_takes_the_prompts_from_a_mooncake_store(tmp_path: Path) -> None:
    pytest.importorskip("mooncake.store", reason="the store extra (Mooncake) is not installed")
    from kvxfer.backends.blob import MooncakeDriver, MooncakeMaster

    with MooncakeMaster() as master:
        holder = MooncakeDriver(master.address, segment_bytes=64 << 20)  # the store server's memory
        try:
            _two_instances(tmp_path, ["--store", "mooncake", "--store-master", master.address,
                                      "--store-segment-mib", "0"])
        finally:
            holder.close()
