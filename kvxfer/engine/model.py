"""The reference decoder: RMSNorm, rotary embeddings, grouped-query attention over the
paged pool, SwiGLU. Greedy only; one request per forward.

Attention never keeps K/V of its own: each layer writes the new tokens' K/V into the
request's blocks (``pool.write_kv``) and reads the whole prefix back through the block
table (``pool.layer_kv`` indexed by ``pool.block_table_tensor``). So whatever bytes sit in
the pool, computed here or delivered by a transfer, are exactly what the next token sees.

One request per forward on purpose: batching requests of different lengths changes the
shapes of the matrix products, and with them the float rounding, so a disaggregated run
could drift from the colocated oracle. Per-request forwards make prefill-then-decode on
two workers compute the very same operations as prefill-then-decode in one process.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from kvxfer.engine.config import GROUP, ModelConfig
from kvxfer.engine.weights import LayerWeights, Weights, seeded_weights
from kvxfer.pool import PagedKVPool


class LlamaModel:
    """Weights plus the forward pass. Stateless between calls: the KV lives in the pool."""

    def __init__(self, config: ModelConfig, weights: Weights | None = None, device: str | torch.device = "cpu") -> None:
        self.config = config
        self.device = torch.device(device)
        weights = weights if weights is not None else seeded_weights(config)  # drawn on the CPU: same everywhere
        self.weights = _to_device(weights, self.device) if self.device.type != "cpu" else weights
        d = config.head_dim
        self._inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # Angles in float64 on the CPU, then cast and moved: the same position gets the same
        # cos/sin on every call and every device.
        freqs = positions.to(torch.float64)[:, None] * self._inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
        dtype = self.config.torch_dtype
        return emb.cos().to(self.device, dtype), emb.sin().to(self.device, dtype)

    @staticmethod
    def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2  # Hugging Face's rotate_half convention, so checkpoints load as is
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        var = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * torch.rsqrt(var + self.config.rms_eps)).to(x.dtype) * weight

    @torch.inference_mode()
    def forward(self, pool: PagedKVPool, request: str, tokens: Sequence[int] | torch.Tensor, start: int) -> torch.Tensor:
        """Run tokens ``[start, start + n)`` of ``request``; K/V for ``[0, start)`` must already
        be in the pool. Writes their K/V, commits ``[0, start + n)``, returns the last logits."""
        cfg = self.config
        ids = torch.as_tensor(tokens, dtype=torch.int64)  # checked on the CPU, then moved
        n = int(ids.numel())
        if n == 0:
            raise ValueError(f"request {request!r}: forward needs at least one token")
        end = start + n
        if end > cfg.max_positions:
            raise ValueError(f"request {request!r}: position {end} is past max_positions {cfg.max_positions}")
        if end > pool.length(request):
            raise ValueError(f"request {request!r}: tokens up to {end} but the pool holds room for {pool.length(request)}")
        if int(ids.min()) < 0 or int(ids.max()) >= cfg.vocab_size:
            raise ValueError(f"request {request!r}: token ids must lie in [0, {cfg.vocab_size})")
        if pool.device.type != self.device.type:
            raise ValueError(f"request {request!r}: the pool is on {pool.device}, the model on {self.device}")
        cos, sin = self._rope(torch.arange(start, end))
        table = pool.block_table_tensor(request, GROUP)[: -(-end // cfg.block_tokens)]
        group_size = cfg.heads // cfg.kv_heads
        # Query i (position start + i) sees keys at positions <= start + i.
        causal = (torch.arange(end)[None, :] <= torch.arange(start, end)[:, None]).to(self.device)
        scale = cfg.head_dim ** -0.5
        x = self.weights.embed[ids.to(self.device)]
        for layer, w in enumerate(self.weights.layers):
            h = self._norm(x, w.attn_norm)
            q = (h @ w.wq.T).view(n, cfg.heads, cfg.head_dim)
            k = (h @ w.wk.T).view(n, cfg.kv_heads, cfg.head_dim)
            v = (h @ w.wv.T).view(n, cfg.kv_heads, cfg.head_dim)
            q, k = self._rotate(q, cos, sin), self._rotate(k, cos, sin)
            pool.write_kv(request, GROUP, layer, start, k, v)
            kt, vt = pool.layer_kv(GROUP, layer)
            keys = kt[table].reshape(-1, cfg.kv_heads, cfg.head_dim)[:end].to(q.dtype)
            values = vt[table].reshape(-1, cfg.kv_heads, cfg.head_dim)[:end].to(q.dtype)
            keys = keys.repeat_interleave(group_size, dim=1)
            values = values.repeat_interleave(group_size, dim=1)
            scores = torch.einsum("nhd,thd->hnt", q, keys).float() * scale
            scores = scores.masked_fill(~causal[None], float("-inf"))
            probs = torch.softmax(scores, dim=-1).to(q.dtype)
            attn = torch.einsum("hnt,thd->nhd", probs, values).reshape(n, cfg.heads * cfg.head_dim)
            x = x + attn @ w.wo.T
            h = self._norm(x, w.mlp_norm)
            x = x + (F.silu(h @ w.w_gate.T) * (h @ w.w_up.T)) @ w.w_down.T
        pool.commit(request, end)
        last = self._norm(x[-1:], self.weights.norm)
        return (last @ self.weights.lm_head.T)[0].float()

    def next_token(self, pool: PagedKVPool, request: str, tokens: Sequence[int] | torch.Tensor, start: int) -> int:
        """Greedy: the argmax of the last logits (ties go to the lowest id, as torch.argmax does)."""
        return int(torch.argmax(self.forward(pool, request, tokens, start)))


def _to_device(weights: Weights, device: torch.device) -> Weights:
    layers = tuple(LayerWeights(**{k: getattr(lw, k).to(device) for k in LayerWeights.__dataclass_fields__})
                   for lw in weights.layers)
    return Weights(weights.embed.to(device), layers, weights.norm.to(device), weights.lm_head.to(device))
