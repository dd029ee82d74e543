"""A GGUF's header as ``read_gguf`` reads it (metadata and tensor index) and its tensors as
the engine slices and dequantizes them, each checked against the gguf package's own reader
(``GGUFReader``, the reference here only) and ``gguf.dequantize``; and the truncated or
corrupt headers it refuses, each with the problem named.

Most files here are written with gguf's ``GGUFWriter``: small, so gguf's reader takes
milliseconds on them. On SmolLM2's GGUF it takes seconds (its 49152 tokens and 48900
merges), so those checks are marked slow.
"""

from __future__ import annotations

import re
import struct
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch

from kvxfer.engine import gguf_model
from kvxfer.engine.gguf_model import _unpermute, dequantize, load_gguf, tensor_data
from kvxfer.modelfiles import (
    TOKENIZER_ARRAYS,
    CheckpointError,
    GgufTensor,
    gguf_metadata,
    read_gguf,
    smollm2_path,
)

T = gguf.GGMLQuantizationType


def _write(path: Path, alignment: int | None = None) -> Path:
    """A small GGUF of every kind of tensor the engine meets: plain (F32, F16, I32; 1 to 3
    dimensions) and quantized, gguf-quantized (Q4_1, Q8_0) and raw blocks (Q6_K)."""
    rng = np.random.default_rng(7)
    w = gguf.GGUFWriter(path, "llama")
    if alignment is not None:
        w.add_custom_alignment(alignment)
    w.add_token_list(["<s>", "a", "b", "ab"])
    w.add_token_merges(["a b"])
    w.add_token_types([3, 1, 1, 1])
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    w.add_array("synthetic.scores", [0.5, -1.25, 2.0])
    w.add_tensor("tensor.f32", rng.standard_normal((3, 5), dtype=np.float32))
    w.add_tensor("tensor.f16", rng.standard_normal((4, 7)).astype(np.float16))
    w.add_tensor("tensor.i32", np.arange(6, dtype=np.int32))
    w.add_tensor("tensor.q4_1", gguf.quantize(rng.standard_normal((8, 64), dtype=np.float32), T.Q4_1),
                 raw_dtype=T.Q4_1)
    w.add_tensor("tensor.q8_0", gguf.quantize(rng.standard_normal((5, 96), dtype=np.float32), T.Q8_0),
                 raw_dtype=T.Q8_0)
    w.add_tensor("tensor.q6_k", rng.integers(0, 256, (2, 210), dtype=np.uint8), raw_dtype=T.Q6_K)
    w.add_tensor("tensor.3d", rng.standard_normal((2, 3, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _mapped(path: Path) -> np.ndarray:
    return np.memmap(path, mode="r").view(np.ndarray)


def _plain(value: Any) -> Any:
    return value.tolist() if isinstance(value, np.ndarray) else value


def _same_index(ours: dict[str, GgufTensor], reader: gguf.GGUFReader) -> None:
    assert [(t.name, t.dims, t.ggml_type, t.offset, t.nbytes) for t in ours.values()] == [
        (t.name, tuple(int(d) for d in t.shape), t.tensor_type, t.data_offset, t.n_bytes) for t in reader.tensors]


@pytest.mark.parametrize("alignment", [None, 64])
def test_the_header_equals_gguf_readers_and_each_tensors_bytes_its_data(tmp_path: Path,
                                                                        alignment: int | None) -> None:
    path = _write(tmp_path / "small.gguf", alignment)
    header = read_gguf(path, TOKENIZER_ARRAYS)
    reader = gguf.GGUFReader(path)
    _same_index(header.tensors, reader)
    assert header.data_offset == reader.data_offset and header.data_offset % (alignment or 32) == 0
    assert header.size == path.stat().st_size
    fields = {k: _plain(f.contents()) for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    assert header.metadata.keys() == fields.keys()
    assert header.metadata["tokenizer.ggml.tokens"] == ["<s>", "a", "b", "ab"]
    assert header.metadata["synthetic.scores"] == range(3)  # not asked for: its length only
    assert {k: v for k, v in header.metadata.items() if k != "synthetic.scores"} == {
        k: v for k, v in fields.items() if k != "synthetic.scores"}
    file_bytes = _mapped(path)
    for ours, ref in zip(header.tensors.values(), reader.tensors, strict=True):
        data = tensor_data(file_bytes, ours)
        assert (data.dtype, data.shape) == (ref.data.dtype, ref.data.shape), ours.name
        assert data.tobytes() == ref.data.tobytes(), ours.name


def test_the_metadata_alone_is_the_headers_metadata(tmp_path: Path) -> None:
    path = _write(tmp_path / "small.gguf")
    assert gguf_metadata(path, TOKENIZER_ARRAYS) == read_gguf(path, TOKENIZER_ARRAYS).metadata


@pytest.mark.parametrize("ggml_type", list(T), ids=lambda t: t.name)
def test_dequantize_equals_gguf_dequantize_bit_for_bit(ggml_type: T, monkeypatch: pytest.MonkeyPatch) -> None:
    """Random blocks of every ggml type, in groups of 2 rows (5 groups): the grouping changes
    no value, and a type gguf cannot dequantize is refused as gguf refuses it."""
    block, type_size = gguf.GGML_QUANT_SIZES[ggml_type]
    rows, blocks = 10, 3
    monkeypatch.setattr(gguf_model, "_CHUNK_ELEMENTS", 2 * blocks * block)
    raw = np.random.default_rng(int(ggml_type)).integers(0, 256, rows * blocks * type_size, dtype=np.uint8)
    data = tensor_data(raw, GgufTensor("t", (blocks * block, rows), ggml_type, 0, raw.size))
    with np.errstate(all="ignore"):  # random scales overflow, as they would in gguf's hands
        try:
            ref = gguf.dequantize(data, ggml_type)
        except NotImplementedError:
            with pytest.raises(NotImplementedError):
                dequantize(data, ggml_type)
            return
        ours = dequantize(data, ggml_type)
    assert ours.dtype == np.float32 and ours.shape == (rows, blocks * block) and ours.flags.writeable
    assert ours.flags.c_contiguous and not np.shares_memory(ours, raw)
    # Random bytes make NaNs (their payloads are the CPU's business): the same places, and
    # every other value the same bits.
    nan = np.isnan(ref)
    assert np.array_equal(np.isnan(ours), nan)
    assert np.array_equal(ours.view(np.uint32)[~nan], np.asarray(ref, np.float32).view(np.uint32)[~nan])


def _tensor_info_at(raw: bytes, name: str) -> tuple[int, int]:
    """Where a tensor's ggml type and offset lie in its tensor-index entry."""
    at = raw.index(struct.pack("<Q", len(name)) + name.encode()) + 8 + len(name)
    (n_dims,) = struct.unpack_from("<I", raw, at)
    kind_at = at + 4 + 8 * n_dims
    return kind_at, kind_at + 4


def _patched(raw: bytes, at: int, fmt: str, value: int) -> bytes:
    data = bytearray(raw)
    struct.pack_into(fmt, data, at, value)
    return bytes(data)


def test_truncated_and_corrupt_headers_are_checkpoint_errors_naming_the_problem(tmp_path: Path) -> None:
    raw = _write(tmp_path / "small.gguf", alignment=64).read_bytes()
    header = read_gguf(tmp_path / "small.gguf")
    last = list(header.tensors.values())[-1]
    kind_at, offset_at = _tensor_info_at(raw, "tensor.q8_0")
    alignment_at = raw.index(b"general.alignment") + len(b"general.alignment") + 4
    cases = {
        "cut inside the tensor index": (
            raw[: raw.index(b"tensor.q8_0") + 3],
            r"the GGUF tensor index is cut short or corrupt \(a string of 11 bytes at byte \d+: the file ends"),
        "data cut short": (
            raw[: last.offset + 1],
            rf"tensor 'tensor.3d' runs past the end of the file \(bytes {last.offset} to {last.offset + last.nbytes}, "
            rf"the file has {last.offset + 1}\)"),
        "a name twice": (raw.replace(b"tensor.f16", b"tensor.f32"),
                         "tensor 'tensor.f32' appears twice in the tensor index"),
        "unknown type": (_patched(raw, kind_at, "<I", 250), "tensor 'tensor.q8_0' has an unknown ggml type 250"),
        "misaligned": (_patched(raw, offset_at, "<Q", header.tensors["tensor.q8_0"].offset - header.data_offset + 4),
                       r"tensor 'tensor.q8_0' starts at data offset \d+, not aligned to 64 bytes"),
        "alignment": (_patched(raw, alignment_at, "<I", 48), "general.alignment 48 is not a power of two"),
        "data past the end": (_patched(raw, offset_at, "<Q", 1 << 40), "tensor 'tensor.q8_0' runs past the end"),
    }
    for case, (content, message) in cases.items():
        path = tmp_path / f"{case.replace(' ', '-')}.gguf"
        path.write_bytes(content)
        with pytest.raises(CheckpointError, match=f"^{re.escape(str(path))}: {message}"):
            read_gguf(path)
    # A router reads the metadata alone, which a broken tensor index leaves readable.
    assert gguf_metadata(tmp_path / "cut-inside-the-tensor-index.gguf")["general.alignment"] == 64


@pytest.fixture(scope="module")
def smollm2_reader() -> gguf.GGUFReader:
    return gguf.GGUFReader(smollm2_path())


@pytest.mark.slow  # gguf's reader takes 7-10 s of CPU on SmolLM2's header
def test_smollm2s_tensor_index_equals_gguf_readers(smollm2_reader: gguf.GGUFReader) -> None:
    header = read_gguf(smollm2_path(), TOKENIZER_ARRAYS)
    _same_index(header.tensors, smollm2_reader)
    assert header.data_offset == smollm2_reader.data_offset and len(header.tensors) == 272


@pytest.mark.slow  # the reader above, and the model (about 1 s)
def test_smollm2s_weights_equal_gguf_readers_dequantized(smollm2_reader: gguf.GGUFReader) -> None:
    config, weights, _ = load_gguf(smollm2_path())
    reference = {t.name: t for t in smollm2_reader.tensors}
    checked = {  # a few of each type in the file: Q8_0 (the tied embedding), Q4_1, F32
        "token_embd.weight": (weights.embed, 0), "blk.0.ffn_down.weight": (weights.layers[0].w_down, 0),
        "blk.17.attn_v.weight": (weights.layers[17].wv, 0), "blk.29.ffn_gate.weight": (weights.layers[29].w_gate, 0),
        "blk.3.attn_q.weight": (weights.layers[3].wq, config.heads),
        "blk.29.attn_k.weight": (weights.layers[29].wk, config.kv_heads),
        "blk.0.attn_norm.weight": (weights.layers[0].attn_norm, 0), "output_norm.weight": (weights.norm, 0),
    }
    assert {reference[name].tensor_type for name in checked} == {t.tensor_type for t in smollm2_reader.tensors}
    for name, (ours, heads) in checked.items():
        t = reference[name]
        ref = np.asarray(gguf.dequantize(t.data, t.tensor_type), dtype=np.float32)
        if heads:
            ref = _unpermute(ref, heads)
        assert ours.dtype == torch.float32 and ours.shape == ref.shape, name
        assert np.array_equal(ours.numpy().view(np.uint32), ref.view(np.uint32)), name
