"""`kvxfer pair --engine transformers --model smollm2` end to end: two `kvxfer serve --engine
transformers` workers (SmolLM2 loaded by transformers itself from the GGUF), the router, NIXL:
every completion token-identical to transformers' own colocated `generate_batch` (greedy) or,
sampled with seeds, to the transformers engine's colocated batch with kvxfer's sampler, every
process gone after; and `kvxfer serve` without the flag never imports transformers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvxfer import pair
from kvxfer.testing.processes import assert_nothing_left
from kvxfer.worker import serve


def test_pair_transformers_is_token_identical_to_generate_batch(tmp_path: Path) -> None:
    report_path = tmp_path / "report.json"
    proc = subprocess.run(
        [sys.executable, "-m", "kvxfer.cli", "pair", "--engine", "transformers", "--model", "smollm2",
         "--requests", "4", "--concurrency", "4", "--max-new-tokens", "4", "--warmup", "0", "--blocks", "64",
         "--json", str(report_path), "--log-dir", str(tmp_path / "logs"), "--quiet"],
        capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(report_path.read_text())
    assert report["config"]["engine"] == "transformers"
    assert report["requests"] == report["matched"] == 4 and report["failed"] == 0
    results = report["results"]
    assert len({r["prompt_tokens"] for r in results}) > 1  # mixed lengths
    assert all(r["transfer"]["status"] == "delivered" and r["path"] == "disaggregated" for r in results), results
    # What the moves cost each engine loop, from the workers' metrics: every request's move
    # added jobs on both engine threads, and the decode loop stepped the batch.
    loop = report["engine_loop"]
    assert loop["prefill"]["transfer_jobs"] >= 4 and loop["decode"]["transfer_jobs"] >= 4, loop
    assert loop["decode"]["steps"] > 0 and 0 < loop["decode"]["transfer_share_of_busy"] < 1, loop
    assert "decode loop" in proc.stdout and "prefill loop" in proc.stdout
    assert_nothing_left(report["config"]["processes"])


def test_pair_transformers_sampled_is_token_identical_to_its_colocated_batch(tmp_path: Path) -> None:
    """Seeded sampling: each completion (its first token from the prefill worker, the others
    from the decode worker) equals the transformers engine's colocated batch with kvxfer's
    sampler and the same seeds. On the toy model's shape with seeded weights (transformers'
    own Llama, no GGUF): what ``--engine transformers`` runs on a GPU, at a tenth of SmolLM2's cost."""
    report_path = tmp_path / "report.json"
    proc = subprocess.run(
        [sys.executable, "-m", "kvxfer.cli", "pair", "--engine", "transformers",
         "--temperature", "0.8", "--sampling-seed", "7", "--requests", "4", "--concurrency", "2",
         "--max-new-tokens", "6", "--warmup", "0", "--blocks", "64", "--colocated-baseline", "--json", str(report_path),
         "--log-dir", str(tmp_path / "logs"), "--quiet"],
        capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(report_path.read_text())
    assert report["config"]["sampling"] == {"greedy": False, "temperature": 0.8, "seed": 7}
    assert report["requests"] == report["matched"] == 4 and report["failed"] == 0
    assert report["config"]["model_config"]["layers"] == 4  # the toy model's shape
    colocated = report["colocated"]  # --colocated-baseline: generate_batch timed in waves of --concurrency
    assert colocated["ttft_s"]["p50"] > 0 and colocated["latency_s"]["p50"] >= colocated["ttft_s"]["p50"]
    assert colocated["tokens_per_s"] > 0 and "  colocated    TTFT" in proc.stdout
    results = report["results"]
    assert all(r["transfer"]["status"] == "delivered" and r["path"] == "disaggregated" for r in results), results
    assert_nothing_left(report["config"]["processes"])
    # That the oracle samples (is not greedy) is tests/unit/test_transformers_sampling.py's.


def test_pair_transformers_hybrid_is_token_identical_to_generate_batch(tmp_path: Path) -> None:
    """``--sliding-window 24``: the toy model's shape seeded as a hybrid model (even layers
    sliding, odd ones full attention), two cache groups at each worker, each moving by its own
    transfer over NIXL, the sliding group only its ring: every completion token-identical to
    generate_batch on the same hybrid model, prompts shorter and longer than the window."""
    report_path = tmp_path / "report.json"
    proc = subprocess.run(
        [sys.executable, "-m", "kvxfer.cli", "pair", "--engine", "transformers", "--sliding-window", "24",
         "--requests", "4", "--concurrency", "2", "--min-len", "8", "--max-len", "90", "--max-new-tokens", "6",
         "--warmup", "0", "--blocks", "64", "--json", str(report_path), "--log-dir", str(tmp_path / "logs"), "--quiet"],
        capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(report_path.read_text())
    assert report["requests"] == report["matched"] == 4 and report["failed"] == 0
    results = report["results"]
    lengths = [r["prompt_tokens"] for r in results]
    assert min(lengths) < 24 < max(lengths), lengths
    assert all(r["transfer"]["status"] == "delivered" and r["path"] == "disaggregated" for r in results), results
    # Every full-attention block of each prompt and the ring's blocks only: two groups moved.
    assert report["rows"] == sum(-(-n // 16) + -(-min(n, 24) // 16) for n in lengths), (report["rows"], lengths)
    assert_nothing_left(report["config"]["processes"])


def test_serving_without_the_engine_flag_never_imports_transformers() -> None:
    code = ("import sys, kvxfer.worker.serve, kvxfer.worker.core, kvxfer.worker.app, kvxfer.pair, kvxfer.router.serve; "
            "print('transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stdout + out.stderr


def test_what_the_transformers_engine_cannot_run_is_refused_by_name(capsys: pytest.CaptureFixture[str]) -> None:
    for argv, words in ((["--engine", "transformers", "--checkpoint", "w.safetensors"], "no --checkpoint"),
                        (["--engine", "transformers", "--model", "smollm2", "--device", "cuda"],
                         "runs a GGUF on the cpu for now, not --device cuda"),
                        (["--colocated-baseline"], "it needs --engine transformers"),
                        (["--engine", "transformers", "--model", "smollm2", "--backend", "ucx"],
                         "over nixl or ipc for now, not --backend ucx"),
                        (["--engine", "transformers", "--model", "smollm2", "--lender", "staging"],
                         "no engine-KV flags, --store or --lender staging"),
                        (["--sliding-window", "8"], "--sliding-window seeds a hybrid model for --engine transformers"),
                        (["--engine", "transformers", "--model", "smollm2", "--sliding-window", "8"],
                         "from the toy model's shape (--model toy, no --checkpoint)"),
                        (["--engine", "transformers", "--sliding-window", "8", "--head-dim", "16"],
                         "head_dim is --hidden / --heads (128 / 4), not --head-dim 16"),
                        (["--engine", "transformers", "--sliding-window", "-2"], "must be a positive number")):
        with pytest.raises(SystemExit) as exc:
            pair.main(argv)  # refused before any process starts
        err = capsys.readouterr().err
        assert exc.value.code == 2 and words in err and "Traceback" not in err, err
    for argv, words in ((["--role", "prefill", "--engine", "transformers", "--checkpoint", "w"], "no --checkpoint"),
                        (["--role", "decode", "--engine", "transformers", "--model", "smollm2", "--store", "memory"],
                         "does not use a KV store"),
                        (["--role", "prefill", "--sliding-window", "8"],
                         "--sliding-window seeds a hybrid model for --engine transformers")):
        with pytest.raises(SystemExit) as exc:
            serve.main(argv)
        err = capsys.readouterr().err
        assert exc.value.code == 2 and words in err, err


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_pair_transformers_layerwise_is_token_identical(tmp_path: Path, mode: str) -> None:
    """``--layerwise 4`` on the toy model's 4 layers: each layer group published by the prefill
    worker from the forward's hook on that group's last layer, moved over NIXL by a transfer of
    its own, every completion token-identical to generate_batch, nothing recomputed."""
    report_path = tmp_path / "report.json"
    proc = subprocess.run(
        [sys.executable, "-m", "kvxfer.cli", "pair", "--engine", "transformers", "--layerwise", "4", "--mode", mode,
         "--requests", "4", "--concurrency", "2", "--min-len", "8", "--max-len", "90", "--max-new-tokens", "6",
         "--warmup", "0", "--blocks", "64", "--json", str(report_path), "--log-dir", str(tmp_path / "logs"), "--quiet"],
        capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(report_path.read_text())
    assert report["config"]["layerwise"] == 4 and report["config"]["engine"] == "transformers"
    assert report["requests"] == report["matched"] == 4 and report["failed"] == 0
    results = report["results"]
    assert all(r["transfer"]["status"] == "delivered" and r["path"] == "disaggregated" for r in results), results
    # Every group moves every block of the prompt (16-token blocks), all of it delivered.
    assert all(r["transfer"]["rows"] == r["transfer"]["rows_delivered"] == 4 * -(-r["prompt_tokens"] // 16)
               for r in results), results
    assert_nothing_left(report["config"]["processes"])
