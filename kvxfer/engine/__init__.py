"""kvxfer.engine: a small Llama-style decoder over the paged pool, for paired workers and tests.

    from kvxfer.engine import ModelConfig, LlamaModel, colocated_generate
    model = LlamaModel(ModelConfig())                 # deterministic seeded weights (seed 0)
    tokens = colocated_generate(model, [1, 2, 3], max_new_tokens=8)   # the oracle

Greedy decoding only. ``ModelConfig`` fixes the size (defaults run on a 2-core CPU in
seconds) and its ``scope()`` goes into the pool's layout identity, so workers with other
weights refuse each other's hints. ``load_checkpoint(path)`` loads a local Hugging Face
Llama safetensors file (with its ``config.json``); nothing is downloaded.
"""

from kvxfer.engine.config import GROUP, ModelConfig, config_from_hf
from kvxfer.engine.generate import colocated_generate, decode, synthetic_prompts, tokens_needed
from kvxfer.engine.model import LlamaModel
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
    "GROUP", "CheckpointError", "LlamaModel", "ModelConfig", "Weights", "colocated_generate", "config_from_hf",
    "decode", "load_checkpoint", "read_safetensors", "seeded_weights", "synthetic_prompts", "to_hf_tensors",
    "tokens_needed", "write_safetensors",
]
