"""A load test of the router's OpenAI API with the official ``openai`` client (issue 40, item 6).
A script, not a test:

    .venv/bin/python bench/openai_load.py --out load.json                  # starts `kvxfer up --port 0` itself
    .venv/bin/python bench/openai_load.py --model smollm2 --requests 32    # the same with SmolLM2
    .venv/bin/python bench/openai_load.py --url http://127.0.0.1:8000      # against a running router

``--requests`` streamed completions (``AsyncOpenAI``), ``--concurrency`` at a time, over
token-id prompts of mixed lengths (``--min-prompt`` to ``--max-prompt``); every other one
sampled (temperature 0.8 with a seed of its own), the rest greedy; one in ten leaves after
its first chunk (closes the stream). Then the workers the router's /health names are read
until they hold nothing (``kvxfer_worker_active_streams``, ``kvxfer_open_leases``,
``kvxfer_worker_held_requests``, ``kvxfer_quarantined_slots``, ``kvxfer_pool_blocks{state="in_use"}``).

Prints and writes (``--out``) one JSON object: requests, completed, cancelled (the clients
that left, and how many the router's ``kvxfer_router_requests_total{result="cancelled"}``
counted meanwhile), errors by kind, completion tokens, throughput (tokens/s over the run's
wall time), TTFT p50/p99 (request sent to first chunk), the workers' leftovers. Exit status 1
when a request failed or a worker holds anything afterwards.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import re
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

LEFTOVERS = {"streams": ("kvxfer_worker_active_streams", {}), "leases": ("kvxfer_open_leases", {}),
             "held": ("kvxfer_worker_held_requests", {}), "quarantined": ("kvxfer_quarantined_slots", {}),
             "blocks_in_use": ("kvxfer_pool_blocks", {"state": "in_use"})}
"""What a worker still holds, by the /metrics series that count it: all 0 on an idle worker."""


@dataclass
class Outcome:
    kind: str  # "completed", "cancelled", or an error's kind
    ttft_s: float | None
    tokens: int


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--url", default="", help="a running router (default: start `kvxfer up --port 0` for the run)")
    p.add_argument("--model", default="", help="kvxfer up's --model (default: its own, the toy model)")
    p.add_argument("--concurrency", type=int, default=32, help="requests in flight at once")
    p.add_argument("--requests", type=int, default=0, help="requests in all (default: 4 x concurrency)")
    p.add_argument("--max-tokens", type=int, default=32, help="each request's max_tokens")
    p.add_argument("--min-prompt", type=int, default=8, help="the shortest prompt, in tokens")
    p.add_argument("--max-prompt", type=int, default=256, help="the longest prompt, in tokens")
    p.add_argument("--leave-every", type=int, default=10, help="one request in this many leaves after its first chunk")
    p.add_argument("--out", default="", help="also write the JSON here")
    p.add_argument("--settle-s", type=float, default=30.0, help="how long the workers may take to hold nothing")
    args = p.parse_args(argv)
    args.requests = args.requests or 4 * args.concurrency
    for flag in ("concurrency", "requests", "max_tokens", "min_prompt", "leave_every"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be at least 1")
    if args.max_prompt < args.min_prompt:
        p.error("--max-prompt must be at least --min-prompt")
    return args


def start_up(model: str) -> tuple[subprocess.Popen[str], str]:
    """``kvxfer up --port 0`` and the router's URL from its ready line."""
    argv = [sys.executable, "-m", "kvxfer.cli", "up", "--port", "0", *(["--model", model] if model else [])]
    up = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert up.stdout is not None
    line = up.stdout.readline()
    found = re.search(r" at (http://\S+)/v1 ", line)
    if found is None:
        up.terminate()
        up.wait(60)
        raise SystemExit(f"openai_load: kvxfer up did not start: {line.strip() or 'no ready line'}")
    return up, found.group(1)


def metrics(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    from prometheus_client.parser import text_string_to_metric_families  # noqa: PLC0415

    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as answer:
        text = answer.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def total(m: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, labels: dict[str, str]) -> float:
    return sum(v for (n, ls), v in m.items() if n == name and set(labels.items()) <= set(ls))


def workers(url: str) -> list[str]:
    with urllib.request.urlopen(f"{url}/health", timeout=10) as answer:
        return sorted(json.loads(answer.read())["workers"])


def leftovers(url: str) -> dict[str, float]:
    m = metrics(url)
    return {what: total(m, name, labels) for what, (name, labels) in LEFTOVERS.items()}


def settled_leftovers(urls: list[str], timeout_s: float) -> dict[str, dict[str, float]]:
    """Each worker's leftovers once all are 0, or as they are when ``timeout_s`` has passed."""
    deadline = time.monotonic() + timeout_s
    while True:
        out = {u: leftovers(u) for u in urls}
        if all(v == 0 for w in out.values() for v in w.values()) or time.monotonic() > deadline:
            return out
        time.sleep(0.1)


async def one(client: Any, model: str, i: int, prompt: list[int], args: argparse.Namespace) -> Outcome:
    import openai  # noqa: PLC0415

    sampled = i % 2 == 0
    leaves = i % args.leave_every == args.leave_every - 1
    extra: dict[str, Any] = {"temperature": 0.8, "seed": i} if sampled else {"temperature": 0}
    start = time.perf_counter()
    ttft, tokens = None, 0
    try:
        stream = await client.completions.create(model=model, prompt=prompt, max_tokens=args.max_tokens, stream=True,
                                                 stream_options={"include_usage": True}, **extra)
        async with stream:
            async for chunk in stream:
                if chunk.choices and ttft is None:
                    ttft = time.perf_counter() - start
                if chunk.choices:
                    tokens += len((chunk.choices[0].model_extra or {}).get("token_ids") or [])
                if leaves and ttft is not None:
                    return Outcome("cancelled", ttft, tokens)  # leaving the block closes the stream
                if chunk.usage is not None:
                    tokens = chunk.usage.completion_tokens
    except openai.APIStatusError as exc:
        return Outcome(f"http_{exc.status_code}", ttft, tokens)
    except (openai.APIError, OSError) as exc:
        return Outcome(type(exc).__name__, ttft, tokens)
    return Outcome("completed", ttft, tokens)


async def run(url: str, args: argparse.Namespace) -> dict[str, Any]:
    import openai  # noqa: PLC0415

    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=os.environ.get("KVXFER_API_KEY", "unused"),
                                max_retries=0, timeout=600)
    try:
        model = (await client.models.list()).data[0].id
        rng = random.Random(0)
        lengths = [round(args.min_prompt + (args.max_prompt - args.min_prompt) * k / max(args.requests - 1, 1))
                   for k in range(args.requests)]
        rng.shuffle(lengths)
        prompts = [[rng.randrange(3, 100) for _ in range(n)] for n in lengths]
        gate = asyncio.Semaphore(args.concurrency)

        async def gated(i: int) -> Outcome:
            async with gate:
                return await one(client, model, i, prompts[i], args)

        # Blocking reads in a thread: the router may be served by this very event loop (a test's).
        cancelled_before = total(await asyncio.to_thread(metrics, url), "kvxfer_router_requests_total",
                                 {"result": "cancelled"})
        start = time.perf_counter()
        outcomes = await asyncio.gather(*(gated(i) for i in range(args.requests)))
        seconds = time.perf_counter() - start
    finally:
        await client.close()
    counted = total(await asyncio.to_thread(metrics, url), "kvxfer_router_requests_total",
                    {"result": "cancelled"}) - cancelled_before
    ttfts = sorted(o.ttft_s for o in outcomes if o.ttft_s is not None)
    errors: dict[str, int] = {}
    for o in outcomes:
        if o.kind not in ("completed", "cancelled"):
            errors[o.kind] = errors.get(o.kind, 0) + 1
    tokens = sum(o.tokens for o in outcomes)
    left = await asyncio.to_thread(settled_leftovers, await asyncio.to_thread(workers, url), args.settle_s)
    return {
        "schema": "kvxfer-openai-load", "version": 1, "model": model,
        "machine": {"host": platform.node(), "cpus": os.cpu_count(), "platform": platform.platform(),
                    "python": platform.python_version(), "openai": openai.__version__},
        "config": {k: getattr(args, k) for k in ("concurrency", "requests", "max_tokens", "min_prompt", "max_prompt",
                                                 "leave_every")},
        "requests": len(outcomes), "completed": sum(o.kind == "completed" for o in outcomes),
        "cancelled": sum(o.kind == "cancelled" for o in outcomes), "router_counted_cancelled": counted,
        "errors": errors, "completion_tokens": tokens, "seconds": round(seconds, 3),
        "throughput_tokens_per_s": round(tokens / seconds, 2) if seconds else 0.0,
        "ttft_s": {"p50": _quantile(ttfts, 0.50), "p99": _quantile(ttfts, 0.99)},
        "leftovers": left, "leftovers_zero": all(v == 0 for w in left.values() for v in w.values()),
    }


def _quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    return round(values[min(len(values) - 1, int(q * len(values)))], 4)


def _interrupted(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt  # SIGTERM as Ctrl-C: the kvxfer up this run started is stopped on the way out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    up = None
    url = args.url.rstrip("/")
    if not url:
        signal.signal(signal.SIGTERM, _interrupted)
        up, url = start_up(args.model)
    try:
        report = asyncio.run(run(url, args))
    finally:
        if up is not None:
            up.send_signal(signal.SIGTERM)
            up.wait(60)
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    return 0 if not report["errors"] and report["leftovers_zero"] else 1


if __name__ == "__main__":
    sys.exit(main())
