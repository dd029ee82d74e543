"""kvxfer.engine: a small Llama-style decoder over the paged pool, for paired workers and tests.

    from kvxfer.engine import ModelConfig, LlamaModel, colocated_generate
    model = LlamaModel(ModelConfig())                 # deterministic seeded weights (seed 0)
    tokens = colocated_generate(model, [1, 2, 3], max_new_tokens=8)   # the oracle

Greedy decoding only. ``ModelConfig`` fixes the size (defaults run on a 2-core CPU in
seconds) and its ``scope()`` goes into the pool's layout identity, so workers with other
weights refuse each other's hints. ``load_checkpoint(path)`` loads a local Hugging Face
Llama safetensors file (with its ``config.json``); nothing is downloaded.

Tensor parallelism by KV heads (``kvxfer.engine.tp``): ``ShardedKVCache.create(config, tp,
num_blocks, block_tokens=..., layout=...)`` gives each rank a pool of its heads
(``kv_head_range``, ``KVShard``); ``model.forward`` / ``next_token`` take it in place of a
pool, and ``tp_generate`` is ``colocated_generate`` on such a group, token for token.
"""

from kvxfer.engine.config import GROUP, ModelConfig, config_from_hf
from kvxfer.engine.generate import colocated_generate, decode, synthetic_prompts, tokens_needed, tp_generate
from kvxfer.engine.model import LlamaModel
from kvxfer.engine.tp import HeadReader, KVShard, ShardedKVCache, kv_head_range, kv_shards
from kvxfer.engine.weights import (
    CheckpointError,
    Weights,
    load_checkpoint,
    read_safetensors,
    seeded_weights,
    to_hf_tensors,
    write_safetensors,
)

__all__ = [
    "GROUP", "CheckpointError", "HeadReader", "KVShard", "LlamaModel", "ModelConfig", "ShardedKVCache", "Weights",
    "colocated_generate", "config_from_hf", "decode", "kv_head_range", "kv_shards", "load_checkpoint",
    "read_safetensors", "seeded_weights", "synthetic_prompts", "to_hf_tensors", "tokens_needed", "tp_generate",
    "write_safetensors",
]
