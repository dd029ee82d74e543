"""`kvxfer pair --temperature`: sampled requests through real worker and router processes,
each token-identical to the colocated oracle sampling with the same parameters (the prefill
worker draws the first token, the decode worker the rest, from one seeded stream), and not
the greedy completion."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from kvxfer.engine import LlamaModel, ModelConfig, colocated_generate, workload_prompts

# A one-layer model and short completions: the test is about the draws, not the model.
SMALL = ["--layers", "1", "--hidden", "32", "--heads", "2", "--kv-heads", "1", "--head-dim", "16",
         "--intermediate", "64", "--vocab", "64", "--requests", "3", "--min-len", "4", "--max-len", "40",
         "--max-new-tokens", "8", "--warmup", "0", "--quiet"]


def _pair(tmp_path: Path, name: str, *extra: str) -> dict[str, Any]:
    report = tmp_path / f"{name}.json"
    done = subprocess.run([sys.executable, "-m", "kvxfer.cli", "pair", *SMALL, *extra, "--json", str(report),
                           "--log-dir", str(tmp_path / name)], capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    return {"stdout": done.stdout, **json.loads(report.read_text())}


def test_pair_sampled_is_token_identical_to_the_sampling_oracle_and_not_greedy(tmp_path: Path) -> None:
    sampled = _pair(tmp_path, "sampled", "--temperature", "0.8", "--sampling-seed", "7")
    assert sampled["requests"] == sampled["matched"] == 3 and sampled["failed"] == 0
    assert all(r["tokens"] == r["expected"] and len(r["tokens"]) == 8 for r in sampled["results"])
    assert sampled["config"]["sampling"] == {"greedy": False, "temperature": 0.8, "seed": 7}
    assert "sampling     temperature 0.8, seeds 7 + request index" in sampled["stdout"]
    assert all(r["transfer"]["status"] == "delivered" for r in sampled["results"])  # disaggregated, not recomputed
    # The oracle's greedy completions of the same prompts: the sampled ones differ.

    torch.set_num_threads(1)
    model = LlamaModel(ModelConfig.from_json(sampled["config"]["model_config"]))
    prompts = workload_prompts(model, 3, 4, 40, 0)  # the pair's own (--prompt-seed 0)
    assert [len(p) for p in prompts] == [r["prompt_tokens"] for r in sampled["results"]]
    greedy = [colocated_generate(model, p, 8) for p in prompts]
    assert [r["tokens"] for r in sampled["results"]] != greedy
