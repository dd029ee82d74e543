"""transformers' continuous batching, colocated (``generate_batch``) against disaggregated by
kvxfer across two processes over NIXL (``kvxfer.testing.transformers_pair``), on the CPU with
SmolLM2-135M-Instruct from the packaged GGUF.

    .venv/bin/python bench/transformers_pair.py --requests 16 --max-new-tokens 16 --out DIR

Colocated: all prompts given to one ``generate_batch`` at once; TTFT from each request's
creation to its first token. Disaggregated: all prompts queued at once in the prefill engine's
batch; TTFT from the run's start to prefill's first token (the first token does not wait for
the transfer: the decode end's next one does); transfer: a publish submitted to its attempt
concluded (NIXL push, host memory). Both: tokens/s = completion tokens / wall time.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import tempfile
import time
from pathlib import Path

import numpy as np

from kvxfer.adapters.transformers import _internals as hf
from kvxfer.backends.nixl import NixlBackend
from kvxfer.contract import TransferMode
from kvxfer.testing.transformers_pair import DecodePeer, disaggregate, engine_for, load_smollm2, mixed_prompts

OPTIONS = {"page_size": 16, "num_blocks": 256, "max_batch_tokens": 512}


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else math.nan


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    n, new = args.requests, args.max_new_tokens
    model = load_smollm2()
    prompts = mixed_prompts(n)
    with tempfile.TemporaryDirectory() as tmp:
        hf.save_model(model, Path(tmp) / "w")
        peer = DecodePeer({**OPTIONS, "weights": str(Path(tmp) / "w")})
        start = time.perf_counter()
        colo = hf.colocated_timed(model, prompts, new, hf.batching_config(16, 256, 512))
        colo_wall = time.perf_counter() - start
        engine = engine_for(model, OPTIONS, "prefill-kv")
        backend = NixlBackend(mode=TransferMode.PUSH, deadline_s=30.0)
        backend.register(engine.regions)
        try:
            run = disaggregate(engine, backend, peer, prompts, new)
        finally:
            left = len(backend.shutdown())
            engine.shutdown()
            left += max(peer.close(), 0)
    got = [run.completions[f"req-{i}"] for i in range(n)]
    block = engine.kv.geometry.block_bytes
    moved = sum(-(-len(p) // 16) for p in prompts) * block
    colo_ttft = [t for _, t, _ in colo]
    disagg_ttft = list(run.first_token_s.values())
    transfer = list(run.transfer_s.values())
    report = {
        "machine": os.uname().nodename, "cpus": os.cpu_count(), "load_average": os.getloadavg(),
        "requests": n, "max_new_tokens": new, "prompt_tokens": [len(p) for p in prompts],
        "identical": sum(g == c for g, (c, _, _) in zip(got, colo)),
        "colocated": {"wall_s": colo_wall, "tokens_per_s": sum(len(c) for c, _, _ in colo) / colo_wall,
                      "ttft_p50_ms": pct(colo_ttft, 50) * 1e3, "ttft_p99_ms": pct(colo_ttft, 99) * 1e3},
        "disaggregated": {"wall_s": run.wall_s, "tokens_per_s": sum(len(g) for g in got) / run.wall_s,
                          "ttft_p50_ms": pct(disagg_ttft, 50) * 1e3, "ttft_p99_ms": pct(disagg_ttft, 99) * 1e3,
                          "transfer_p50_ms": pct(transfer, 50) * 1e3, "transfer_p99_ms": pct(transfer, 99) * 1e3,
                          "bytes_moved": moved, "block_bytes": block, "unquiesced_at_shutdown": left},
    }
    text = json.dumps(report, indent=2)
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "transformers-pair.json").write_text(text + "\n")


if __name__ == "__main__":
    main()
