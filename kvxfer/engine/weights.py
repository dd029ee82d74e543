"""Model weights: deterministic seeded tensors, or a local safetensors Llama checkpoint.

Seeded weights come from one ``torch.Generator`` drawn in a fixed order, so two processes
with the same config hold bit-identical weights: that is what lets a prefill worker, a
decode worker and the colocated oracle agree token for token.

A checkpoint is read from a local file with a minimal safetensors reader (the format is an
8-byte little-endian header length, a JSON header, then raw little-endian tensors), so no
extra dependency and no download. Names follow Hugging Face Llama:
``model.embed_tokens.weight``, ``model.layers.{i}.self_attn.{q,k,v,o}_proj.weight``,
``model.layers.{i}.mlp.{gate,up,down}_proj.weight``, ``model.layers.{i}.input_layernorm.weight``,
``model.layers.{i}.post_attention_layernorm.weight``, ``model.norm.weight`` and
``lm_head.weight`` (absent when embeddings are tied).
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from kvxfer.engine.config import ModelConfig, config_from_hf
from kvxfer.modelfiles.errors import CheckpointError

_ST_DTYPES: dict[str, tuple[np.dtype, torch.dtype | None]] = {
    "F64": (np.dtype("<f8"), None), "F32": (np.dtype("<f4"), None), "F16": (np.dtype("<f2"), None),
    "BF16": (np.dtype("<u2"), torch.bfloat16),
}
_MAX_HEADER = 100 << 20


@dataclass(frozen=True)
class LayerWeights:
    attn_norm: torch.Tensor
    wq: torch.Tensor  # [heads * head_dim, hidden], as nn.Linear stores it
    wk: torch.Tensor
    wv: torch.Tensor
    wo: torch.Tensor
    mlp_norm: torch.Tensor
    w_gate: torch.Tensor
    w_up: torch.Tensor
    w_down: torch.Tensor


@dataclass(frozen=True)
class Weights:
    embed: torch.Tensor  # [vocab, hidden]
    layers: tuple[LayerWeights, ...]
    norm: torch.Tensor
    lm_head: torch.Tensor  # [vocab, hidden]


def seeded_weights(config: ModelConfig) -> Weights:
    """Bit-identical weights for a given config on every process (CPU generator, fixed order)."""
    gen = torch.Generator().manual_seed(config.seed)
    dtype = config.torch_dtype

    def normal(*shape: int, std: float) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, dtype=torch.float32) * std).to(dtype)

    def norm_weight() -> torch.Tensor:
        return (1.0 + 0.1 * torch.randn(config.hidden, generator=gen, dtype=torch.float32)).to(dtype)

    h, q, kv = config.hidden, config.heads * config.head_dim, config.kv_heads * config.head_dim
    std = h ** -0.5
    embed = normal(config.vocab_size, h, std=1.0)
    layers = []
    for _ in range(config.layers):
        layers.append(LayerWeights(
            attn_norm=norm_weight(), wq=normal(q, h, std=std), wk=normal(kv, h, std=std), wv=normal(kv, h, std=std),
            wo=normal(h, q, std=q ** -0.5), mlp_norm=norm_weight(),
            w_gate=normal(config.intermediate, h, std=std), w_up=normal(config.intermediate, h, std=std),
            w_down=normal(h, config.intermediate, std=config.intermediate ** -0.5),
        ))
    # A larger output scale keeps the greedy choice well clear of float rounding ties.
    return Weights(embed, tuple(layers), norm_weight(), normal(config.vocab_size, h, std=2.0 * std))


# --- safetensors --------------------------------------------------------------------------

def read_safetensors(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a local ``.safetensors`` file (copied out of the file)."""
    path = Path(path)
    data = path.read_bytes()
    if len(data) < 8:
        raise CheckpointError(f"{path}: too short for a safetensors file")
    (header_len,) = struct.unpack("<Q", data[:8])
    if header_len > _MAX_HEADER or 8 + header_len > len(data):
        raise CheckpointError(f"{path}: header length {header_len} does not fit the file")
    try:
        header = json.loads(data[8: 8 + header_len])
    except ValueError as exc:
        raise CheckpointError(f"{path}: header is not JSON: {exc}") from None
    body = memoryview(data)[8 + header_len:]
    out: dict[str, torch.Tensor] = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        kind = meta.get("dtype")
        if kind not in _ST_DTYPES:
            raise CheckpointError(f"{path}: tensor {name!r} has unsupported dtype {kind!r}")
        np_dtype, view_as = _ST_DTYPES[kind]
        start, end = meta["data_offsets"]
        shape = tuple(int(s) for s in meta["shape"])
        count = int(np.prod(shape)) if shape else 1
        if not 0 <= start <= end <= len(body) or end - start != count * np_dtype.itemsize:
            raise CheckpointError(f"{path}: tensor {name!r} has offsets {start}..{end} that do not match {shape}")
        array = np.frombuffer(body[start:end], dtype=np_dtype).reshape(shape).copy()
        tensor = torch.from_numpy(array)
        out[name] = tensor.view(view_as) if view_as is not None else tensor
    return out


def write_safetensors(path: str | Path, tensors: dict[str, torch.Tensor]) -> None:
    """Write tensors in the safetensors format (used by tests and to export seeded weights)."""
    names = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}
    header: dict[str, object] = {}
    blobs: list[bytes] = []
    offset = 0
    for name, t in tensors.items():
        if t.dtype not in names:
            raise CheckpointError(f"tensor {name!r}: dtype {t.dtype} cannot be written")
        raw = t.detach().contiguous().cpu()
        blob = (raw.view(torch.int16) if raw.dtype == torch.bfloat16 else raw).numpy().tobytes()
        header[name] = {"dtype": names[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    Path(path).write_bytes(struct.pack("<Q", len(head)) + head + b"".join(blobs))


def to_hf_tensors(weights: Weights) -> dict[str, torch.Tensor]:
    """The weights under Hugging Face Llama names (the inverse of ``load_checkpoint``)."""
    out = {"model.embed_tokens.weight": weights.embed, "model.norm.weight": weights.norm,
           "lm_head.weight": weights.lm_head}
    for i, lw in enumerate(weights.layers):
        p = f"model.layers.{i}."
        out.update({
            p + "input_layernorm.weight": lw.attn_norm, p + "post_attention_layernorm.weight": lw.mlp_norm,
            p + "self_attn.q_proj.weight": lw.wq, p + "self_attn.k_proj.weight": lw.wk,
            p + "self_attn.v_proj.weight": lw.wv, p + "self_attn.o_proj.weight": lw.wo,
            p + "mlp.gate_proj.weight": lw.w_gate, p + "mlp.up_proj.weight": lw.w_up,
            p + "mlp.down_proj.weight": lw.w_down,
        })
    return out


def load_checkpoint(path: str | Path, *, dtype: str = "float32",
                    block_tokens: int = 16) -> tuple[ModelConfig, Weights]:
    """Load a Llama checkpoint: ``path`` is a ``.safetensors`` file with ``config.json`` beside
    it (Hugging Face format), or a directory holding ``model.safetensors`` and ``config.json``.

    The returned config's ``checkpoint`` field is the sha256 of the weights file, so the
    pool's layout identity names these weights and workers with other weights refuse each
    other. Sharded checkpoints (``model-0000x-of-0000y``) are not supported.
    """
    path = Path(path)
    file = path / "model.safetensors" if path.is_dir() else path
    cfg_file = file.parent / "config.json"
    if not file.is_file():
        raise CheckpointError(f"no safetensors file at {file}")
    if not cfg_file.is_file():
        raise CheckpointError(f"no config.json beside {file}: it gives the model's shape")
    digest = hashlib.sha256(file.read_bytes()).hexdigest()
    config = config_from_hf(json.loads(cfg_file.read_text()), dtype=dtype, block_tokens=block_tokens,
                            checkpoint=digest)
    tensors = read_safetensors(file)
    want = config.torch_dtype

    def take(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        t = tensors.get(name)
        if t is None:
            raise CheckpointError(f"{file}: tensor {name!r} is missing")
        if tuple(t.shape) != shape:
            raise CheckpointError(f"{file}: tensor {name!r} has shape {tuple(t.shape)}, the config needs {shape}")
        return t.to(want)

    h, q, kv = config.hidden, config.heads * config.head_dim, config.kv_heads * config.head_dim
    layers = []
    for i in range(config.layers):
        p = f"model.layers.{i}."
        layers.append(LayerWeights(
            attn_norm=take(p + "input_layernorm.weight", (h,)),
            wq=take(p + "self_attn.q_proj.weight", (q, h)), wk=take(p + "self_attn.k_proj.weight", (kv, h)),
            wv=take(p + "self_attn.v_proj.weight", (kv, h)), wo=take(p + "self_attn.o_proj.weight", (h, q)),
            mlp_norm=take(p + "post_attention_layernorm.weight", (h,)),
            w_gate=take(p + "mlp.gate_proj.weight", (config.intermediate, h)),
            w_up=take(p + "mlp.up_proj.weight", (config.intermediate, h)),
            w_down=take(p + "mlp.down_proj.weight", (h, config.intermediate)),
        ))
    embed = take("model.embed_tokens.weight", (config.vocab_size, h))
    head = take("lm_head.weight", (config.vocab_size, h)) if "lm_head.weight" in tensors else embed
    return config, Weights(embed, tuple(layers), take("model.norm.weight", (h,)), head)
