"""A GGUF that transformers converted once, kept as the checkpoint it produced.

transformers' GGUF load parses the file, dequantizes and renames every tensor: 10-17 CPU-s for
SmolLM2-135M on the 2-core machine, paid by the prefill worker, the decode worker and the
oracle of each ``kvxfer pair --engine transformers`` alike, and again at each restart. The
weights it produces are the same every time, so the first load saves them as a checkpoint
(config, generation config, safetensors) in kvxfer's cache, and later loads read that (about
0.2 s). A converted checkpoint is keyed by the GGUF's path, size and modification time, the
dtype and the pinned transformers version: a changed file or another version converts again.

The cache is ``$KVXFER_CACHE_DIR``, else ``$XDG_CACHE_HOME/kvxfer``, else ``~/.cache/kvxfer``.
A cache that cannot be written costs the conversion each time and nothing else; processes
converting at once each write their own directory and the first rename wins.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from kvxfer.adapters.transformers import _internals as hf

log = logging.getLogger(__name__)
CACHE_ENV = "KVXFER_CACHE_DIR"


def cache_root() -> Path:
    if root := os.environ.get(CACHE_ENV):
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kvxfer"


def converted_dir(gguf: Path, dtype: torch.dtype, root: Path | None = None) -> Path:
    """Where the checkpoint converted from ``gguf`` at ``dtype`` is (or would be) kept."""
    real = gguf.resolve()
    stat = real.stat()
    key = hashlib.sha256(f"{real}\0{stat.st_size}\0{stat.st_mtime_ns}\0{dtype}\0{hf.PINNED}".encode()).hexdigest()
    return (cache_root() if root is None else root) / "transformers" / key[:32]


def load_converted(gguf: Path, dtype: torch.dtype = torch.float32, *, root: Path | None = None) -> Any:
    """The model transformers loads from ``gguf`` (eval mode): from its converted checkpoint
    when one is kept, else from the GGUF, keeping what it converted for the next load."""
    where = converted_dir(gguf, dtype, root)
    if (where / "model.safetensors").is_file():
        try:
            return hf.load_saved_model(where, dtype)
        except (OSError, ValueError) as exc:  # a damaged entry: convert again, replace it
            log.warning("the converted checkpoint %s could not be read (%s): converting %s again", where, exc, gguf)
            shutil.rmtree(where, ignore_errors=True)
    model = hf.load_gguf_model(gguf, dtype)
    try:
        where.parent.mkdir(parents=True, exist_ok=True)
        staged = Path(tempfile.mkdtemp(prefix=".converting-", dir=where.parent))
        try:
            hf.save_model(model, staged)
            os.rename(staged, where)  # atomic: a reader sees a whole checkpoint or none
        except OSError:
            shutil.rmtree(staged, ignore_errors=True)
            if not (where / "model.safetensors").is_file():
                raise
    except OSError as exc:
        log.warning("could not keep the converted checkpoint of %s in %s (%s): each load converts it", gguf,
                    where.parent, exc)
    return model
