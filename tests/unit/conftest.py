"""Fixtures two or more unit test modules share."""

from __future__ import annotations

from typing import Any

import pytest


@pytest.fixture(scope="module")
def tiny_hf_llama() -> Any:
    """A seeded random 3-layer Llama of transformers' own (the transformers adapter's tests
    drive it; the adapter's reach into transformers stays in its _internals)."""
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(num_hidden_layers=3, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                      intermediate_size=128, vocab_size=128, max_position_embeddings=256)
    return transformers.LlamaForCausalLM(config).eval()
