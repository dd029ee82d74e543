"""What ``kvxfer pair`` checks its completions against, per engine (``--engine``).

- reference: kvxfer's ``LlamaModel`` in this process, colocated generation (one pool), sampled
  as each request is;
- transformers: transformers' own colocated continuous batching on the same weights (the GGUF
  loaded by transformers itself), every prompt in one batch: greedy, its ``generate_batch``;
  sampled, the transformers engine's colocated batch with kvxfer's sampler (each request's
  seed), since ``generate_batch`` samples with a sampler of its own. Its prompts are the text
  prompts joined one to four at a time: mixed lengths that cross block boundaries (16 tokens
  a block).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from kvxfer.engine import model_shape
from kvxfer.modelfiles import load_tokenizer, model_path
from kvxfer.pair.layouts import engine_kv_wanted
from kvxfer.progress import Count, Line

if TYPE_CHECKING:
    from kvxfer.engine import ModelConfig, SamplingParams

ENGINES = ("reference", "transformers")


def add_engine_arg(p: argparse.ArgumentParser) -> None:
    from kvxfer.worker.serve import add_sliding_window_arg

    p.add_argument("--engine", default="reference", choices=list(ENGINES),
                   help="what the workers run: reference (kvxfer's own engine; the oracle is colocated generation "
                        "here) or transformers (Hugging Face transformers' continuous batching, its cache lent in "
                        "place; a GGUF --model such as smollm2 on the cpu, or the toy model's shape with seeded "
                        "weights on --device; nixl or ipc; the oracle is transformers' own generate_batch on the same "
                        "weights, or, sampled, the engine's colocated batch with the same sampler)")
    p.add_argument("--colocated-baseline", action="store_true",
                   help="--engine transformers: after the workers stop, time transformers' colocated generate_batch "
                        "on the same prompts in waves of --concurrency, on the oracle's device, and report its TTFT, "
                        "latency and tokens/s beside the pair's")
    add_sliding_window_arg(p)


def check_engine_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``--engine transformers``: what it cannot run yet, named before anything starts."""
    from kvxfer.worker.serve import check_sliding_window

    check_sliding_window(parser, args)
    if args.engine != "transformers":
        if args.colocated_baseline:
            parser.error("--colocated-baseline times transformers' generate_batch: it needs --engine transformers")
        return
    if args.checkpoint:
        parser.error("--engine transformers loads a GGUF with transformers itself (--model smollm2 or a .gguf "
                     "path) or seeds the toy model's shape: no --checkpoint")
    if engine_kv_wanted(args) or args.store or args.lender != "inplace":
        parser.error("--engine transformers lends transformers' own cache in place: no engine-KV flags, --store or "
                     "--lender staging")
    if args.model != "toy" and args.device not in ("auto", "cpu"):
        parser.error(f"--engine transformers runs a GGUF on the cpu for now, not --device {args.device} (the toy "
                     "model's seeded shape runs on cuda)")
    if importlib.util.find_spec("transformers") is None:
        parser.error("--engine transformers needs transformers (pip install 'kvxfer[transformers]')")
    if args.backend not in ("nixl", "ipc"):
        parser.error(f"--engine transformers moves KV over nixl or ipc for now, not --backend {args.backend}")
    if args.prefill_device or args.decode_device:
        parser.error("--engine transformers runs both workers on --device: no --prefill-device or --decode-device")


class ReferenceOracle:
    """kvxfer's own model, colocated."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.shape: ModelConfig = model.config
        self.device = str(model.device)
        self.tokenizer = model.tokenizer

    def prompts(self, count: int, min_len: int, max_len: int, seed: int) -> list[list[int]]:
        from kvxfer.engine import workload_prompts

        return workload_prompts(self.model, count, min_len, max_len, seed)

    def expected(self, prompts: list[list[int]], max_new: int, line: Line, workers: int,
                 sampling: Sequence[SamplingParams]) -> list[list[int]]:
        """Colocated generation of every prompt (sampled as its request is): what each
        completion must equal, token for token."""
        from kvxfer.engine import colocated_generate

        count = Count(line, "computing reference outputs", len(prompts),
                      detail=f"colocated generation, while {workers} workers start")
        expected = []
        for prompt, params in zip(prompts, sampling):
            expected.append(colocated_generate(self.model, prompt, max_new, sampling=params))
            count.advance()
        return expected


class TransformersOracle:
    """transformers' own colocated continuous batching on the weights ``--model`` names: a
    GGUF (on the cpu), or the toy model's shape with seeded weights (on ``device``)."""

    def __init__(self, args: argparse.Namespace, blocks: int, device: str) -> None:
        from kvxfer.worker.serve import flags_config

        path = model_path(args.model)
        shape = model_shape(args.model, dtype=args.dtype, block_tokens=args.block_tokens) if path is not None \
            else flags_config(args)
        assert shape is not None
        self.path = path  # loaded in ``expected``, while the workers start
        self.shape = shape
        self.device = "cpu" if path is not None else device
        self.tokenizer = load_tokenizer(args.model) if path is not None else None
        self.window = args.sliding_window  # a hybrid model's (seeded): the workers' too
        self.blocks = blocks
        self._model: Any = None

    def convert_once(self, quiet: bool) -> None:
        """Convert the GGUF here, before the workers start, when no conversion is kept yet
        (``adapters.transformers.converted``): else the oracle and both workers convert it at
        once, 10-17 CPU-s each on the 2-core machine, and the workers then read what was kept."""
        if self.path is None:  # seeded weights: nothing to convert
            return
        import torch

        from kvxfer.adapters.transformers.converted import cache_root, converted_dir
        from kvxfer.worker.hf_engine import load_model

        if not (converted_dir(self.path, torch.float32) / "model.safetensors").is_file():
            if not quiet:
                print(f"kvxfer pair: converting {self.path.name} with transformers once (kept in {cache_root()} "
                      "for the workers and later runs)", file=sys.stderr, flush=True)
            self._model = load_model(self.path)

    def prompts(self, count: int, min_len: int, max_len: int, seed: int) -> list[list[int]]:
        """``count`` prompts of mixed lengths: with a tokenizer, one to four of TEXT_PROMPTS
        joined; else random token ids of ``min_len``..``max_len`` tokens from ``seed``."""
        from kvxfer.engine import TEXT_PROMPTS, synthetic_prompts  # imports torch: once every flag is checked

        if self.tokenizer is None:
            return synthetic_prompts(count, min_len, max_len, self.shape.vocab_size, seed)
        texts = list(TEXT_PROMPTS)
        out = []
        for i in range(count):
            parts = 1 + (i * 3) % 4
            out.append(list(self.tokenizer.encode(" ".join(texts[(i + j) % len(texts)] for j in range(parts)))))
        return out

    def expected(self, prompts: list[list[int]], max_new: int, line: Line, workers: int,
                 sampling: Sequence[SamplingParams]) -> list[list[int]]:
        """Every prompt at once, colocated: greedy, ``generate_batch``; sampled, the transformers
        engine's batch picking each request's tokens with kvxfer's sampler and its parameters
        (the workers' sampler, the same seeds). Either ends a completion at the model's
        end-of-sequence token, as the workers' batches do."""
        from kvxfer.adapters.transformers import RequestSampling, colocated_sampled
        from kvxfer.adapters.transformers import _internals as hf
        from kvxfer.worker.hf_engine import PAGE_SIZE, load_on, max_batch_tokens

        greedy = all(s.plain for s in sampling)
        oracle = "transformers' generate_batch" if greedy else "the transformers engine's colocated batch (sampled)"
        line.say(f"computing reference outputs: {oracle} over {len(prompts)} prompts, while {workers} workers start")
        model = self._model if self._model is not None else load_on(self.path, self.shape, self.device, self.window)
        self._model = model
        tokens = max_batch_tokens(self.device)
        if greedy:
            return hf.colocated(model, prompts, max_new, hf.batching_config(PAGE_SIZE, self.blocks, tokens))
        return colocated_sampled(model, prompts, max_new, [RequestSampling(s) for s in sampling], page_size=PAGE_SIZE,
                                 num_blocks=self.blocks, max_batch_tokens=tokens)

    def baseline(self, prompts: list[list[int]], max_new: int, concurrency: int) -> dict[str, Any]:
        """transformers' colocated ``generate_batch`` over ``prompts`` in waves of
        ``concurrency``, timed (the workers have stopped: nothing else runs on the device):
        TTFT and latency from each request's creation in the batch, and tokens/s over the
        waves' busy time (each wave's creation to its last token). What a disaggregated run at that concurrency compares with."""
        import time

        from kvxfer.adapters.transformers import _internals as hf
        from kvxfer.pair.report import percentile
        from kvxfer.worker.hf_engine import PAGE_SIZE, load_on, max_batch_tokens

        model = self._model if self._model is not None else load_on(self.path, self.shape, self.device, self.window)
        self._model = model
        config = hf.batching_config(PAGE_SIZE, self.blocks, max_batch_tokens(self.device))
        hf.colocated(model, prompts[:1], 2, config)  # warm-up, as the pair's warm-up request
        runs: list[tuple[list[int], float, float]] = []
        busy = 0.0  # each wave from its requests' creation to its last token: not generate_batch's set-up
        start = time.perf_counter()
        for i in range(0, len(prompts), concurrency):
            wave = hf.colocated_timed(model, prompts[i:i + concurrency], max_new, config)
            busy += max(t for _, _, t in wave)
            runs += wave
        wall = time.perf_counter() - start
        ttft, total = [t for _, t, _ in runs], [t for _, _, t in runs]
        return {"what": f"transformers generate_batch, colocated, waves of {concurrency}", "wall_s": wall,
                "busy_s": busy, "tokens_per_s": sum(len(t) for t, _, _ in runs) / busy if busy > 0 else None,
                "ttft_s": {"p50": percentile(ttft, 50), "p99": percentile(ttft, 99)},
                "latency_s": {"p50": percentile(total, 50), "p99": percentile(total, 99)}}
