"""Fixtures two or more unit test modules share."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from kvxfer.backends.loopback import LoopbackBackend, LoopbackFabric
from kvxfer.contract import TransferMode
from kvxfer.engine import ModelConfig

TINY_HF_SHAPE = ModelConfig(vocab_size=128, hidden=64, layers=3, heads=4, kv_heads=2, head_dim=16, intermediate=128,
                            max_positions=256)


@pytest.fixture(scope="module")
def tiny_hf_llama() -> Any:
    """A 3-layer Llama of transformers' own with seeded random weights, as ``kvxfer serve
    --engine transformers`` builds the toy model's shape (the transformers adapter's tests
    drive it; the adapter's reach into transformers stays in its _internals)."""
    from kvxfer.worker.hf_engine import seeded_model

    return seeded_model(TINY_HF_SHAPE, "cpu")


@pytest.fixture
def wire() -> Iterator[Any]:
    """A factory of loopback pairs (prefill end, decode end), shut down after the test."""
    made: list[LoopbackBackend] = []

    def make(mode: TransferMode = TransferMode.PUSH, **options: Any) -> tuple[LoopbackBackend, LoopbackBackend]:
        fabric = LoopbackFabric()
        pair = LoopbackBackend(fabric, "prefill", mode, **options), LoopbackBackend(fabric, "decode", mode)
        made.extend(pair)
        return pair

    yield make
    assert not set().union(*(b.shutdown() for b in made))
