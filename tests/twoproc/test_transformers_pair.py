"""transformers' continuous batching disaggregated across two real processes over NIXL (host
memory): SmolLM2-135M-Instruct loaded by transformers itself from the packaged GGUF at both
ends, ten text prompts of mixed lengths prefilled together in the parent's batch, each
prompt's blocks lent straight out of transformers' cache tensor and pushed into blocks the
child reserved in its own cache, every request adopted at its position with prefill's first
token and decoded in the child's batch beside the others: every completion token-identical
to transformers' own colocated ``generate_batch`` (greedy, same weights).

The parent loads the GGUF (transformers' GGUF loading, 13-30 s of CPU here) and saves what it
loaded with ``save_pretrained``; the child loads that: the same weights, parsed once."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from kvxfer.adapters.transformers import _internals as hf
from kvxfer.adapters.transformers.converted import converted_dir, load_converted
from kvxfer.backends.nixl import NixlBackend
from kvxfer.contract import TransferMode
from kvxfer.modelfiles import smollm2_path
from kvxfer.testing.transformers_pair import (
    DecodePeer,
    disaggregate,
    engine_for,
    mixed_prompts,
    transfer_p50_ms,
)

OPTIONS = {"page_size": 16, "num_blocks": 96, "max_batch_tokens": 256}
REQUESTS = 10
NEW = 8


@pytest.mark.slow  # 21-54 s: transformers loads the GGUF once (10-17 s), its generate_batch is the oracle
def test_disaggregated_over_nixl_is_token_identical_to_generate_batch(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Also: the GGUF transformers converted is kept (``converted``), the child loads what was
    kept, and a second load in this process reads it back, the same weights, converting nothing."""
    t0 = time.perf_counter()
    torch.set_num_threads(1)
    model = load_converted(smollm2_path(), root=tmp_path / "cache")
    kept = converted_dir(smollm2_path(), torch.float32, tmp_path / "cache")
    loaded = time.perf_counter() - t0
    peer = DecodePeer({**OPTIONS, "weights": str(kept)})  # loads while the oracle runs
    with monkeypatch.context() as patch:
        patch.setattr(hf, "load_gguf_model", lambda *_, **__: pytest.fail("the kept conversion was not read"))
        again = load_converted(smollm2_path(), root=tmp_path / "cache").state_dict()
    assert again.keys() == model.state_dict().keys()
    assert all(torch.equal(tensor, again[name]) for name, tensor in model.state_dict().items())
    backend = None
    try:
        prompts = mixed_prompts(REQUESTS)
        lengths = sorted(len(p) for p in prompts)
        assert lengths[0] < 16 < lengths[-1], lengths  # within one block and across several
        want = hf.colocated(model, prompts, NEW, hf.batching_config(16, 96, 256))
        engine = engine_for(model, OPTIONS, "prefill-kv")
        backend = NixlBackend(mode=TransferMode.PUSH, deadline_s=30.0)
        backend.register(engine.regions)
        run = disaggregate(engine, backend, peer, prompts, NEW)
        got = [run.completions[f"req-{i}"] for i in range(REQUESTS)]
        print(f"\nGGUF load and save {loaded:.1f} s; {REQUESTS} requests, prompts {lengths[0]}-{lengths[-1]} tokens, {NEW} new: {run.wall_s:.2f} s, "
              f"transfer p50 {transfer_p50_ms(run):.1f} ms, held prefix tokens {sum(run.held.values())}")
        assert set(run.outcomes.values()) == {"delivered"}, run.outcomes
        assert got == want
        assert engine.idle() and backend.shutdown() == frozenset()
        backend = None
        engine.shutdown()
    finally:
        if backend is not None:
            backend.shutdown()
        assert peer.close() == 0
