"""The reference model's shape, and the pool geometry that follows from it.

One frozen ``ModelConfig`` decides everything byte-affecting about the KV cache (layers,
KV heads, head size, dtype) and everything that decides which tokens come out (the weight
seed or checkpoint digest). ``scope()`` folds all of it into the pool's layout identity,
so a prefill and a decode worker built from different models refuse each other's hints.

Importing it imports neither torch nor the pool: a command line builds and checks a
ModelConfig from its flags, and refuses bad ones, before it pays for those.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from kvxfer.pool import LayerGroupSpec, Layout, PagedKVPool

GROUP = "full"
"""The single layer group of the reference model: every layer is full attention."""



def layer_groups(layers: int, groups: int) -> tuple[tuple[str, int, int], ...]:
    """The model's layers cut into ``groups`` contiguous groups, as (name, first layer,
    layer count), earlier groups one layer longer where the count does not divide. One
    group is the single group ``GROUP`` of every layer (a pool exactly as without layer-wise
    streaming); more are named ``layers{first}-{last}``. ValueError names ``layerwise`` for
    a count under 1 or over the layers."""
    if isinstance(groups, bool) or not isinstance(groups, int) or groups < 1:
        raise ValueError(f"layerwise must be a positive number of layer groups, got {groups!r}")
    if groups > layers:
        raise ValueError(f"layerwise {groups} is more layer groups than the model has layers ({layers})")
    if groups == 1:
        return ((GROUP, 0, layers),)
    size, extra = divmod(layers, groups)
    out, first = [], 0
    for i in range(groups):
        count = size + (1 if i < extra else 0)
        out.append((f"layers{first}-{first + count - 1}", first, count))
        first += count
    return tuple(out)


_DTYPES = ("float32", "float16", "bfloat16", "float64")
"""The dtypes the model's weights and KV may have, by torch's names."""


@dataclass(frozen=True)
class ModelConfig:
    """A Llama-style decoder. The defaults are small enough to decode on a 2-core CPU at
    hundreds of tokens a second, and large enough that greedy decoding does not collapse."""

    vocab_size: int = 512
    hidden: int = 128
    layers: int = 4
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 32
    intermediate: int = 352
    rope_theta: float = 10000.0
    rms_eps: float = 1e-5
    block_tokens: int = 16
    max_positions: int = 4096
    dtype: str = "float32"
    seed: int = 0
    checkpoint: str = ""
    """Digest of the loaded checkpoint ('' for seeded weights): part of the layout scope."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden", "layers", "heads", "kv_heads", "head_dim", "intermediate",
                     "block_tokens", "max_positions"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"ModelConfig.{name} must be a positive int, got {value!r}")
        if self.heads % self.kv_heads:
            raise ValueError(f"ModelConfig: heads ({self.heads}) must be a multiple of kv_heads ({self.kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"ModelConfig: head_dim ({self.head_dim}) must be even for rotary embeddings")
        if self.dtype not in _DTYPES:
            raise ValueError(f"ModelConfig.dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}")

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch

        dtype: torch.dtype = getattr(torch, self.dtype)
        return dtype

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ModelConfig:
        known = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        unknown = sorted(set(data) - set(known))
        if unknown:
            raise ValueError(f"ModelConfig: unknown fields {unknown}")
        return cls(**known)

    def with_(self, **changes: Any) -> ModelConfig:
        return replace(self, **changes)

    def scope(self) -> bytes:
        """Bytes that name these exact weights and KV dtype (the pool's layout scope)."""
        text = json.dumps(self.to_json(), sort_keys=True).encode()
        return b"kvxfer-engine/1/" + hashlib.sha256(text).digest()

    def group_spec(self, *, kv_heads: int | None = None, block_tokens: int | None = None) -> LayerGroupSpec:
        """The model's one layer group. ``kv_heads`` (a tensor-parallel rank's share) and
        ``block_tokens`` default to the config's; the ends of a transfer may page differently."""
        from kvxfer.pool import LayerGroupSpec

        tokens = self.block_tokens if block_tokens is None else block_tokens
        heads = self.kv_heads if kv_heads is None else kv_heads
        return LayerGroupSpec(GROUP, layers=self.layers, block_tokens=tokens, kv_heads=heads,
                              head_dim=self.head_dim, dtype=self.torch_dtype)

    def make_pool(self, num_blocks: int, *, device: str = "cpu", name: str = "kv", kv_heads: int | None = None,
                  block_tokens: int | None = None, layout: Layout | None = None,
                  tp: tuple[int, int] = (1, 0), groups: int = 1) -> PagedKVPool:
        """A pool for this model, block-major by default: one row = one block of all layers, K and V.

        A tensor-parallel rank passes its head count as ``kv_heads`` and ``tp=(tp, rank)``,
        which goes into the layout identity (see ``kvxfer.engine.tp.ShardedKVCache``).
        ``groups`` > 1 cuts the layers into that many groups (``layer_groups``), each a pool
        group of its own, so that a group's rows can move as soon as the forward wrote them
        (layer-wise streaming); the group names go into the layout identity, so two ends
        cut differently refuse each other's hints.
        """
        from kvxfer.pool import Layout, PagedKVPool

        spec = self.group_spec(kv_heads=kv_heads, block_tokens=block_tokens)
        specs = [replace(spec, name=group, layers=count) for group, _, count in layer_groups(self.layers, groups)]
        return PagedKVPool(specs, num_blocks, device=device, layout=Layout.BLOCK_MAJOR if layout is None else layout,
                           scope=self.scope(), tp=tp, name=name)


def config_from_hf(hf: dict[str, Any], **overrides: Any) -> ModelConfig:
    """A ModelConfig from a Hugging Face Llama ``config.json`` dict."""
    if hf.get("model_type", "llama") not in ("llama", "mistral"):
        raise ValueError(f"unsupported model_type {hf.get('model_type')!r}: only Llama-style decoders load")
    heads = int(hf["num_attention_heads"])
    hidden = int(hf["hidden_size"])
    fields: dict[str, Any] = {
        "vocab_size": int(hf["vocab_size"]),
        "hidden": hidden,
        "layers": int(hf["num_hidden_layers"]),
        "heads": heads,
        "kv_heads": int(hf.get("num_key_value_heads", heads)),
        "head_dim": int(hf.get("head_dim") or hidden // heads),
        "intermediate": int(hf["intermediate_size"]),
        "rope_theta": float(hf.get("rope_theta", 10000.0)),
        "rms_eps": float(hf.get("rms_norm_eps", 1e-5)),
        "max_positions": int(hf.get("max_position_embeddings", 4096)),
    }
    if hf.get("rope_scaling"):
        raise ValueError("rope_scaling is not supported by the reference engine")
    fields.update(overrides)
    return ModelConfig(**fields)
