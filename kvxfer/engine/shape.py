"""A model's shape from its GGUF header alone, without torch or the weights: what a command
line checks its flags against, in milliseconds, before anything heavy is imported or loaded."""

from __future__ import annotations

from typing import Any

from kvxfer.engine.config import ModelConfig
from kvxfer.modelfiles.errors import CheckpointError
from kvxfer.modelfiles.gguf_file import gguf_metadata, model_path


def model_shape(name: str, **overrides: Any) -> ModelConfig | None:
    """The ModelConfig a ``--model`` value names, from the GGUF's header alone (no weights,
    no tokenizer; a few tens of ms), or None for the toy model: a command line checks its
    other flags (a TP group's heads) against the real shape before anything loads."""
    path = model_path(name)
    if path is None:
        return None
    return config_from_gguf(gguf_metadata(path), str(path), **overrides)


def config_from_gguf(fields: dict[str, Any], where: str = "GGUF", **overrides: Any) -> ModelConfig:
    """A ModelConfig from a GGUF's metadata (``general.architecture`` must be llama)."""
    arch = fields.get("general.architecture")
    if arch != "llama":
        raise CheckpointError(f"{where}: architecture {arch!r} is not supported: only Llama-style decoders load")

    def get(key: str, default: Any = None) -> Any:
        value = fields.get(f"llama.{key}", default)
        if value is None:
            raise CheckpointError(f"{where}: metadata llama.{key} is missing")
        return value

    hidden, heads = int(get("embedding_length")), int(get("attention.head_count"))
    head_dim = int(get("attention.key_length", hidden // heads))
    if int(get("rope.dimension_count", head_dim)) != head_dim:
        raise CheckpointError(f"{where}: partial rotary embeddings are not supported")
    if fields.get("llama.rope.scaling.type", "none") != "none":
        raise CheckpointError(f"{where}: rope scaling is not supported by the reference engine")
    vocab = fields.get("llama.vocab_size") or len(fields.get("tokenizer.ggml.tokens") or [])
    try:
        return ModelConfig(
            vocab_size=int(vocab), hidden=hidden, layers=int(get("block_count")), heads=heads,
            kv_heads=int(get("attention.head_count_kv", heads)), head_dim=head_dim,
            intermediate=int(get("feed_forward_length")), rope_theta=float(get("rope.freq_base", 10000.0)),
            rms_eps=float(get("attention.layer_norm_rms_epsilon")), max_positions=int(get("context_length")),
            **overrides)
    except ValueError as exc:
        raise CheckpointError(f"{where}: {exc}") from None
