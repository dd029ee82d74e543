"""Is transformers' own generate_batch batch-invariant? The same 16 prompts (512-2048 tokens),
greedy, 16 new tokens, on the 1B-like seeded Llama that ``kvxfer pair --engine transformers``
builds on a GPU: all in one batch against one at a time, and the one batch twice. Writes
``variance.json`` under ``$OUT`` (or here): completions that differ, per dtype.

    python3 bench/transformers_batch_variance.py   # needs a CUDA GPU and kvxfer[transformers]
"""

import argparse
import json
import os
import sys
from typing import Any


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.environ.get("OUT", "."), help="where variance.json goes (default: $OUT or .)")
    args = parser.parse_args(argv)
    import torch  # after the flags: --help runs nothing

    if not torch.cuda.is_available():
        print("transformers_batch_variance: needs a CUDA GPU", file=sys.stderr)
        return 2
    from kvxfer.adapters.transformers import _internals as hf
    from kvxfer.engine import ModelConfig, synthetic_prompts
    from kvxfer.worker.hf_engine import GPU_MAX_BATCH_TOKENS, PAGE_SIZE, seeded_model

    out: dict[str, Any] = {}
    for dtype in ("bfloat16", "float32"):
        shape = ModelConfig(layers=16, hidden=2048, heads=32, kv_heads=8, head_dim=64, intermediate=8192,
                            vocab_size=32000, dtype=dtype)
        model = seeded_model(shape, "cuda")
        prompts = synthetic_prompts(16, 512, 2048, shape.vocab_size, 0)
        cfg = hf.batching_config(PAGE_SIZE, 4096, GPU_MAX_BATCH_TOKENS)
        together = hf.colocated(model, prompts, 16, cfg)
        alone = [hf.colocated(model, [p], 16, cfg)[0] for p in prompts]
        again = hf.colocated(model, prompts, 16, cfg)
        diff = sum(a != b for a, b in zip(together, alone))
        out[dtype] = {"prompts": len(prompts), "together_vs_alone_differ": diff,
                      "together_vs_together_again_differ": sum(a != b for a, b in zip(together, again))}
        print(dtype, out[dtype], flush=True)
        del model
        torch.cuda.empty_cache()
    with open(os.path.join(args.out, "variance.json"), "w") as f:
        json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
