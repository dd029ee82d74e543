"""Text in and out for a model loaded from a GGUF file: a byte-level BPE tokenizer built
with the ``tokenizers`` package from the GGUF's own vocabulary, merges and chat template.

Only what the GGUF holds is used, so nothing is downloaded and the tokens are exactly the
ones the weights were trained on. The pre-tokenizer follows llama.cpp's for the file's
``tokenizer.ggml.pre``: "smollm" (SmolLM/SmolLM2) splits every digit on its own, then
applies GPT-2's byte-level split; that is also what SmolLM2's ``tokenizer.json`` says.

    tok = model.tokenizer                       # None for the seeded toy model
    ids = tok.encode("The capital of France is")   # no BOS: the GGUF says add_bos_token false
    text = tok.decode(ids)
    ids = tok.encode(tok.chat([{"role": "user", "content": "Hi"}]))   # the model's template
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvxfer.modelfiles.errors import CheckpointError

_CONTROL = 3
"""GGUF token type of control tokens (``<|im_start|>``...): special, never split or merged."""

_PRE_TOKENIZERS = ("smollm",)
"""``tokenizer.ggml.pre`` values whose split this module reproduces (see the module doc)."""


def _missing(package: str) -> CheckpointError:
    return CheckpointError(f"the {package!r} package is needed to load a GGUF model: "
                           "pip install 'kvxfer[model]'")


@dataclass(frozen=True)
class TokenizerInfo:
    """What a GGUF says about its tokenizer, beside the vocabulary itself."""

    bos_id: int | None
    eos_id: int
    add_bos: bool
    chat_template: str


class Tokenizer:
    """Encode and decode text, and render the model's chat template."""

    def __init__(self, backend: Any, info: TokenizerInfo) -> None:
        self._tok = backend
        self.info = info

    @property
    def vocab_size(self) -> int:
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    @property
    def stop_ids(self) -> frozenset[int]:
        """Ids that end a completion. SmolLM2's GGUF names one, ``<|im_end|>`` (2): its
        ``<|endoftext|>`` (0) does not stop generation in llama.cpp either."""
        return frozenset({self.info.eos_id})

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; special tokens written in it (``<|im_start|>``) are kept
        whole, as a chat template needs. A BOS goes first only where the GGUF asks for one."""
        ids = list(self._tok.encode(text, add_special_tokens=False).ids)
        if self.info.add_bos and self.info.bos_id is not None:
            ids.insert(0, self.info.bos_id)
        return ids

    def decode(self, ids: Sequence[int], *, skip_special: bool = False) -> str:
        return str(self._tok.decode(list(ids), skip_special_tokens=skip_special))

    def token_bytes(self, token: int) -> bytes:
        """The bytes one token stands for (a byte-level BPE piece may be part of a UTF-8
        character; a control token, its own text), as OpenAI's logprobs ``bytes`` give them."""
        piece = self._tok.id_to_token(int(token))
        if piece is None:
            return b""
        unbyte = _unicode_to_byte()
        if all(ch in unbyte for ch in piece):
            return bytes(unbyte[ch] for ch in piece)
        return str(piece).encode()

    def chat(self, messages: Sequence[dict[str, str]], *, add_generation_prompt: bool = True) -> str:
        """``messages`` rendered with the GGUF's chat template (SmolLM2's inserts its own
        system prompt when the first message is not one)."""
        if not self.info.chat_template:
            raise ValueError("this model's GGUF has no chat template")
        # Sandboxed, as transformers renders templates: a template is data from the file.
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        template = env.from_string(self.info.chat_template)
        return str(template.render(messages=list(messages), add_generation_prompt=add_generation_prompt))

    def cut_at_stop(self, ids: Sequence[int]) -> list[int]:
        """``ids`` up to, not including, the first stop id (a fixed-length completion runs past it)."""
        out = []
        for token in ids:
            if token in self.stop_ids:
                break
            out.append(token)
        return out


@functools.cache
def _unicode_to_byte() -> dict[str, int]:
    """Byte-level BPE's alphabet back to bytes: GPT-2's ``bytes_to_unicode``, inverted (the
    printable bytes stand for themselves, the others for chr(256 + n) in byte order)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
                 *range(ord("\xae"), ord("\xff") + 1)]
    out = {chr(b): b for b in printable}
    extra = 0
    for b in range(256):
        if b not in printable:
            out[chr(256 + extra)] = b
            extra += 1
    return out


def tokenizer_from_gguf(fields: dict[str, Any], where: str) -> Tokenizer:
    """A ``Tokenizer`` from a GGUF's ``tokenizer.*`` metadata (plain Python values).

    CheckpointError (naming ``where``) for a tokenizer this module cannot reproduce.
    """
    kind, pre = fields.get("tokenizer.ggml.model"), fields.get("tokenizer.ggml.pre")
    if kind != "gpt2" or pre not in _PRE_TOKENIZERS:
        raise CheckpointError(f"{where}: tokenizer {kind!r} with pre-tokenizer {pre!r} is not supported "
                              f"(byte-level BPE 'gpt2' with {', '.join(_PRE_TOKENIZERS)} is)")
    tokens: list[str] = list(fields.get("tokenizer.ggml.tokens") or [])
    merges: list[str] = list(fields.get("tokenizer.ggml.merges") or [])
    types: list[int] = list(fields.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    if not tokens or not merges or len(types) != len(tokens):
        raise CheckpointError(f"{where}: the tokenizer's tokens, types or merges are missing")
    eos = fields.get("tokenizer.ggml.eos_token_id")
    if not isinstance(eos, int) or not 0 <= eos < len(tokens):
        raise CheckpointError(f"{where}: no valid tokenizer.ggml.eos_token_id")
    bos = fields.get("tokenizer.ggml.bos_token_id")
    info = TokenizerInfo(bos_id=bos if isinstance(bos, int) else None, eos_id=eos,
                         add_bos=bool(fields.get("tokenizer.ggml.add_bos_token", False)),
                         chat_template=str(fields.get("tokenizer.chat_template") or ""))
    return Tokenizer(_build(tokens, merges, types, where), info)


def _build(tokens: list[str], merges: list[str], types: list[int], where: str) -> Any:
    try:
        from tokenizers import AddedToken, decoders, models, pre_tokenizers
        from tokenizers import Tokenizer as HfTokenizer
    except ImportError:
        raise _missing("tokenizers") from None
    pairs = []
    for merge in merges:
        left, sep, right = merge.partition(" ")
        if not sep:
            raise CheckpointError(f"{where}: merge {merge!r} is not two tokens")
        pairs.append((left, right))
    try:
        bpe = models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=pairs, fuse_unk=False, byte_fallback=False)
    except Exception as exc:  # the Rust side raises its own exception types
        raise CheckpointError(f"{where}: the tokenizer does not build: {exc}") from None
    tok = HfTokenizer(bpe)
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    # Control tokens are matched whole in the text before the BPE sees it, and their ids
    # are the GGUF's (they are in the vocabulary already, so nothing is appended).
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, kind in zip(tokens, types) if kind == _CONTROL])
    return tok
