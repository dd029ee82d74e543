"""Expected outputs: colocated generation with the workers' model, computed up front."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvxfer.engine import LlamaModel, ModelConfig, colocated_generate


def expected_outputs(config: ModelConfig, prompts: Sequence[list[int]], max_new: Sequence[int]) -> list[list[int]]:
    """Token ids per prompt. One torch thread, as each worker runs (``kvxfer serve --threads 1``):
    the oracle then sums in the workers' order; the caller's setting is restored after."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = LlamaModel(config)
        return [colocated_generate(model, p, n) for p, n in zip(prompts, max_new)]
    finally:
        torch.set_num_threads(threads)
