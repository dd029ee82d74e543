"""The prompts a workload sends, and completions shown as text.

A model with a tokenizer gets real text (``TEXT_PROMPTS``, tokenized): random ids would make
it produce noise, and a check that noise matches noise says less than text a reader can
judge. The seeded toy model has no text side and gets ``synthetic_prompts``.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvxfer.engine.generate import synthetic_prompts
from kvxfer.engine.model import LlamaModel
from kvxfer.modelfiles.tokenizer import Tokenizer

TEXT_PROMPTS = (
    "The capital of France is",
    "Water boils at a temperature of",
    "In 1969, the first humans landed on",
    "def fibonacci(n):",
    "The three primary colors are",
    "Once upon a time, in a small village by the sea,",
    "The largest planet in our solar system is",
    "To make a good cup of tea, you should first",
    "Photosynthesis is the process by which plants",
    "The quick brown fox",
    "A haiku about autumn leaves:\n",
    "The main difference between a virus and a bacterium is that",
)
"""Plain completion prompts (no chat template, so no BOS and no system prompt): short, of
mixed lengths, with digits, code and a newline, so the tokenizer's every path is used."""


def workload_prompts(model: LlamaModel, count: int, min_len: int, max_len: int, seed: int = 0) -> list[list[int]]:
    """``count`` prompts as token ids: ``TEXT_PROMPTS`` in turn (repeated past the end: a
    repeat finds its prompt blocks cached at the decode worker) when the model has a
    tokenizer, else ``synthetic_prompts`` (``min_len``..``max_len`` tokens, from ``seed``)."""
    if model.tokenizer is None:
        return synthetic_prompts(count, min_len, max_len, model.config.vocab_size, seed)
    if count < 0:
        raise ValueError(f"count must be non-negative, got {count}")
    encoded = [model.tokenizer.encode(text) for text in TEXT_PROMPTS]
    return [list(encoded[i % len(encoded)]) for i in range(count)]


def text_samples(tokenizer: Tokenizer, prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]],
                 count: int = 3) -> list[dict[str, str]]:
    """The first ``count`` distinct prompts with their completions, as text. A completion is
    cut at its first stop id: the workload decodes a fixed number of tokens past it."""
    out: list[dict[str, str]] = []
    seen: set[tuple[int, ...]] = set()
    for prompt, completion in zip(prompts, completions):
        if len(out) == count:
            break
        if tuple(prompt) in seen:
            continue
        seen.add(tuple(prompt))
        out.append({"prompt": tokenizer.decode(prompt),
                    "completion": tokenizer.decode(tokenizer.cut_at_stop(completion))})
    return out
