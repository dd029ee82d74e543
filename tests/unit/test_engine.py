"""The reference engine: seeded determinism, paged attention against a dense reference,
the disaggregation invariant (K/V moved to another pool decodes identically), checkpoints."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kvxfer.engine import (
    GROUP,
    CheckpointError,
    LlamaModel,
    ModelConfig,
    colocated_generate,
    decode,
    load_checkpoint,
    seeded_weights,
    synthetic_prompts,
    to_hf_tensors,
    write_safetensors,
)

torch.set_num_threads(1)
SMALL = ModelConfig(vocab_size=128, hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, intermediate=96,
                    block_tokens=4)


def dense_logits(model: LlamaModel, ids: list[int]) -> torch.Tensor:
    """The same network without a pool: plain causal attention over all tokens at once."""
    cfg, w = model.config, model.weights
    n = len(ids)
    cos, sin = model._rope(torch.arange(n))
    x = w.embed[torch.tensor(ids)]
    for lw in w.layers:
        h = model._norm(x, lw.attn_norm)
        q = model._rotate((h @ lw.wq.T).view(n, cfg.heads, cfg.head_dim), cos, sin).transpose(0, 1)
        k = model._rotate((h @ lw.wk.T).view(n, cfg.kv_heads, cfg.head_dim), cos, sin).transpose(0, 1)
        v = (h @ lw.wv.T).view(n, cfg.kv_heads, cfg.head_dim).transpose(0, 1)
        g = cfg.heads // cfg.kv_heads
        out = F.scaled_dot_product_attention(q, k.repeat_interleave(g, 0), v.repeat_interleave(g, 0), is_causal=True)
        x = x + out.transpose(0, 1).reshape(n, -1) @ lw.wo.T
        h = model._norm(x, lw.mlp_norm)
        x = x + (F.silu(h @ lw.w_gate.T) * (h @ lw.w_up.T)) @ lw.w_down.T
    return (model._norm(x[-1:], w.norm) @ w.lm_head.T)[0]


def test_seeded_weights_are_bit_identical_and_seed_dependent() -> None:
    a, b = seeded_weights(SMALL), seeded_weights(SMALL)
    assert torch.equal(a.embed, b.embed) and torch.equal(a.layers[1].w_down, b.layers[1].w_down)
    c = seeded_weights(SMALL.with_(seed=1))
    assert not torch.equal(a.embed, c.embed)
    assert SMALL.scope() != SMALL.with_(seed=1).scope()
    assert SMALL.make_pool(4).identity != SMALL.with_(seed=1).make_pool(4).identity


def test_paged_forward_matches_dense_attention_with_scattered_blocks() -> None:
    model = LlamaModel(SMALL)
    pool = SMALL.make_pool(64)
    # Free a request between two others so the new request's blocks are not contiguous.
    pool.allocate("a", 8)
    pool.allocate("b", 4)
    pool.free("a")
    ids = list(range(3, 40))
    pool.allocate("r", len(ids))
    table = pool.block_table("r", GROUP)
    assert not (table[1:] - table[:-1] == 1).all()
    paged = model.forward(pool, "r", ids, 0)
    torch.testing.assert_close(paged, dense_logits(model, ids), rtol=1e-4, atol=1e-4)
    # Extending token by token reads the earlier K/V back from the pool.
    pool.grow("r", len(ids) + 1)
    step = model.forward(pool, "r", [7], len(ids))
    torch.testing.assert_close(step, dense_logits(model, [*ids, 7]), rtol=1e-4, atol=1e-4)


def test_kv_moved_to_another_pool_decodes_identically() -> None:
    """What a transfer does: copy the prompt's block rows into other blocks of another pool."""
    model = LlamaModel(SMALL)
    prompt = synthetic_prompts(1, 30, 30, SMALL.vocab_size, seed=3)[0]
    want = colocated_generate(model, prompt, 12)
    src, dst = SMALL.make_pool(32), SMALL.make_pool(32)
    src.allocate("p", len(prompt))
    first = model.next_token(src, "p", prompt, 0)
    dst.allocate("filler", 13)
    dst.allocate("d", len(prompt) + 11)
    nblocks = -(-len(prompt) // SMALL.block_tokens)
    s_rows = torch.from_numpy(src.block_table("p", GROUP)[:nblocks].copy())
    d_rows = torch.from_numpy(dst.block_table("d", GROUP)[:nblocks].copy())
    assert not torch.equal(s_rows, d_rows)
    dst.storage(GROUP)[d_rows] = src.storage(GROUP)[s_rows]
    got = [first, *decode(model, dst, "d", first, len(prompt), 12)]
    assert got == want


def test_chunked_prefill_resumes_to_the_same_tokens() -> None:
    """Resume from a block boundary (what a partial transfer leaves) and recompute the rest."""
    model = LlamaModel(ModelConfig())
    for prompt in synthetic_prompts(4, 17, 90, 512, seed=5):
        want = colocated_generate(model, prompt, 10)
        pool = model.config.make_pool(16)
        pool.allocate("r", len(prompt) + 9)
        model.forward(pool, "r", prompt[:16], 0)
        first = model.next_token(pool, "r", prompt[16:], 16)
        assert [first, *decode(model, pool, "r", first, len(prompt), 10)] == want


def test_forward_refuses_bad_input_with_named_errors() -> None:
    model = LlamaModel(SMALL)
    pool = SMALL.make_pool(8)
    pool.allocate("r", 4)
    with pytest.raises(ValueError, match="room for 4"):
        model.forward(pool, "r", [1, 2, 3, 4, 5], 0)
    with pytest.raises(ValueError, match=r"\[0, 128\)"):
        model.forward(pool, "r", [1, 500], 0)
    with pytest.raises(ValueError, match="multiple of kv_heads"):
        ModelConfig(heads=3, kv_heads=2)


def test_synthetic_prompts_are_deterministic_and_mixed() -> None:
    a = synthetic_prompts(20, 5, 200, 512, seed=1)
    assert a == synthetic_prompts(20, 5, 200, 512, seed=1)
    lengths = sorted(len(p) for p in a)
    assert lengths[0] == 5 and lengths[-1] == 200 and len(set(lengths)) == 20


def write_checkpoint(tmp: Path, config: ModelConfig, tensors: dict[str, torch.Tensor]) -> Path:
    hf = {"model_type": "llama", "vocab_size": config.vocab_size, "hidden_size": config.hidden,
          "num_hidden_layers": config.layers, "num_attention_heads": config.heads,
          "num_key_value_heads": config.kv_heads, "intermediate_size": config.intermediate,
          "rope_theta": config.rope_theta, "rms_norm_eps": config.rms_eps}
    (tmp / "config.json").write_text(json.dumps(hf))
    write_safetensors(tmp / "model.safetensors", tensors)
    return tmp


def test_checkpoint_round_trip_generates_the_same_tokens(tmp_path: Path) -> None:
    model = LlamaModel(SMALL)
    path = write_checkpoint(tmp_path, SMALL, to_hf_tensors(model.weights))
    config, weights = load_checkpoint(path, block_tokens=SMALL.block_tokens)
    assert config.checkpoint and config.scope() != SMALL.scope()
    loaded = LlamaModel(config, weights)
    prompt = [5, 9, 2, 77, 31, 8, 100]
    assert colocated_generate(loaded, prompt, 8) == colocated_generate(model, prompt, 8)


def test_checkpoint_errors_name_the_tensor(tmp_path: Path) -> None:
    tensors = to_hf_tensors(seeded_weights(SMALL))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.mlp\.up_proj\.weight.*missing"):
        load_checkpoint(write_checkpoint(tmp_path, SMALL, tensors))
    tensors = to_hf_tensors(seeded_weights(SMALL))
    tensors["model.norm.weight"] = torch.ones(3)
    with pytest.raises(CheckpointError, match=r"model\.norm\.weight.*shape \(3,\)"):
        load_checkpoint(write_checkpoint(tmp_path, SMALL, tensors))
    with pytest.raises(CheckpointError, match="no safetensors file"):
        load_checkpoint(tmp_path / "missing" / "model.safetensors")
    (tmp_path / "config.json").unlink()
    with pytest.raises(CheckpointError, match="no config.json"):
        load_checkpoint(tmp_path)
