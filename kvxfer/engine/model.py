"""The reference decoder: RMSNorm, rotary embeddings, grouped-query attention over the
paged pool, SwiGLU; one request per forward. ``next_token`` picks greedily, or samples
(``kvxfer.engine.sampling``) from the last logits.

Attention never keeps K/V of its own: each layer writes the new tokens' K/V into the
request's blocks (``pool.write_kv``) and reads the whole prefix back through the block
table (``pool.layer_kv`` indexed by ``pool.block_table_tensor``). So whatever bytes sit in
the pool, computed here or delivered by a transfer, are exactly what the next token sees.

One request per forward on purpose: batching requests of different lengths changes the
shapes of the matrix products, and with them the float rounding, so a disaggregated run
could drift from the colocated oracle. Per-request forwards make prefill-then-decode on
two workers compute the very same operations as prefill-then-decode in one process.

For the same reason attention runs one KV head at a time (``_attention``), and the cache
may be a tensor-parallel group (``kvxfer.engine.tp.ShardedKVCache``) whose ranks each hold
some KV heads in a pool of their own: a head's output then does not depend on which heads
sit beside it, and a TP run is token- and byte-identical to the colocated one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from kvxfer.engine.config import ModelConfig
from kvxfer.engine.sampling import GREEDY, Pick, SamplingParams, pick_token, with_logprobs
from kvxfer.engine.tp import ShardedKVCache
from kvxfer.engine.weights import LayerWeights, Weights, seeded_weights
from kvxfer.modelfiles.tokenizer import Tokenizer
from kvxfer.pool import PagedKVPool

GroupReady = Callable[[str], None]
"""Told a layer group's name once the forward has written and committed its K/V."""


class LlamaModel:
    """Weights plus the forward pass. Stateless between calls: the KV lives in the pool.

    ``tokenizer`` is the model's text side where it has one (a GGUF model); the seeded toy
    model takes token ids only and has None."""

    def __init__(self, config: ModelConfig, weights: Weights | None = None, device: str | torch.device = "cpu",
                 tokenizer: Tokenizer | None = None) -> None:
        self.config = config
        self.tokenizer = tokenizer
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

    def _check(self, cache: ShardedKVCache, request: str, ids: torch.Tensor, start: int) -> int:
        """Refuse input the forward cannot run; returns the end position."""
        cfg = self.config
        n = int(ids.numel())
        if n == 0:
            raise ValueError(f"request {request!r}: forward needs at least one token")
        end = start + n
        if end > cfg.max_positions:
            raise ValueError(f"request {request!r}: position {end} is past max_positions {cfg.max_positions}")
        if end > cache.length(request):
            raise ValueError(f"request {request!r}: tokens up to {end} but the pool holds room for {cache.length(request)}")
        if int(ids.min()) < 0 or int(ids.max()) >= cfg.vocab_size:
            raise ValueError(f"request {request!r}: token ids must lie in [0, {cfg.vocab_size})")
        if cache.device.type != self.device.type:
            raise ValueError(f"request {request!r}: the pool is on {cache.device}, the model on {self.device}")
        return end

    def _attention(self, q: torch.Tensor, heads: list[tuple[torch.Tensor, torch.Tensor]],
                   causal: torch.Tensor) -> torch.Tensor:
        """Grouped-query attention, one KV head at a time: ``[n, heads * head_dim]``.

        Every mode, colocated or TP, runs this per KV head g: its q heads, its keys and
        values, as contiguous tensors of the same shapes. The reduction order (which
        products are summed in which matrix multiply) is thus chosen so a head's output
        cannot depend on which other heads are computed alongside or which pool its K/V
        came from: a TP group and the colocated run match bit for bit. One batched product
        over all heads would let the kernel block the work differently for another head count.
        """
        cfg = self.config
        group = cfg.heads // cfg.kv_heads
        n = q.shape[0]
        scale = cfg.head_dim ** -0.5
        outs = []
        for g, (keys, values) in enumerate(heads):
            qg = q[:, g * group:(g + 1) * group].transpose(0, 1).contiguous()  # [group, n, head_dim]
            scores = (qg @ keys.to(q.dtype).T).float() * scale  # [group, n, end]
            scores = scores.masked_fill(~causal[None], float("-inf"))
            probs = torch.softmax(scores, dim=-1).to(q.dtype)
            outs.append(probs @ values.to(q.dtype))  # [group, n, head_dim]
        # Heads in order, so o_proj below multiplies exactly the colocated concatenation.
        return torch.cat(outs).transpose(0, 1).reshape(n, cfg.heads * cfg.head_dim)

    @torch.inference_mode()
    def forward(self, kv: PagedKVPool | ShardedKVCache, request: str, tokens: Sequence[int] | torch.Tensor,
                start: int, ready: GroupReady | None = None) -> torch.Tensor:
        """Run tokens ``[start, start + n)`` of ``request``; K/V for ``[0, start)`` must already
        be in the cache. Writes their K/V, commits ``[0, start + n)``, returns the last logits.

        ``ready(group)``: called, on this thread, as soon as a layer group's last layer has
        written its K/V, that group committed to ``start + n`` (layer-wise streaming: its rows
        may move while later layers compute; nothing of this forward writes them again).

        ``kv`` is one pool holding every KV head (TP 1) or a TP group (``ShardedKVCache``):
        each rank's heads are written to its pool and read back from it. Projections, o_proj
        and the MLP are computed once, in full, so the result is the colocated one exactly.
        """
        cfg = self.config
        cache = ShardedKVCache.of(kv, cfg.kv_heads)
        ids = torch.as_tensor(tokens, dtype=torch.int64)  # checked on the CPU, then moved
        end = self._check(cache, request, ids, start)
        n = end - start
        cos, sin = self._rope(torch.arange(start, end))
        reader = cache.reader(request, end)
        # Query i (position start + i) sees keys at positions <= start + i.
        causal = (torch.arange(end)[None, :] <= torch.arange(start, end)[:, None]).to(self.device)
        x = self.weights.embed[ids.to(self.device)]
        for layer, w in enumerate(self.weights.layers):
            h = self._norm(x, w.attn_norm)
            q = (h @ w.wq.T).view(n, cfg.heads, cfg.head_dim)
            k = (h @ w.wk.T).view(n, cfg.kv_heads, cfg.head_dim)
            v = (h @ w.wv.T).view(n, cfg.kv_heads, cfg.head_dim)
            q, k = self._rotate(q, cos, sin), self._rotate(k, cos, sin)
            cache.write_kv(request, layer, start, k, v)
            if ready is not None:
                group, local = cache.group_of(layer)
                if local == 0 and layer > 0:
                    # The layer before was its group's last: that group is complete.
                    done, _ = cache.group_of(layer - 1)
                    cache.commit_group(request, done, end)
                    ready(done)
            x = x + self._attention(q, reader.heads(layer), causal) @ w.wo.T
            h = self._norm(x, w.mlp_norm)
            x = x + (F.silu(h @ w.w_gate.T) * (h @ w.w_up.T)) @ w.w_down.T
        cache.commit(request, end)
        if ready is not None:
            ready(cache.group_of(cfg.layers - 1)[0])
        last = self._norm(x[-1:], self.weights.norm)
        return (last @ self.weights.lm_head.T)[0].float()

    def next_token(self, kv: PagedKVPool | ShardedKVCache, request: str, tokens: Sequence[int] | torch.Tensor,
                   start: int, sampling: SamplingParams = GREEDY, prompt: Sequence[int] = (),
                   generated: Sequence[int] = ()) -> int:
        """The token after the forward: greedy, the argmax of the last logits (ties go to the
        lowest id, as torch.argmax does), or as ``sampling`` says, given the request's
        ``prompt`` and the completion ``generated`` so far (its length is the new token's index)."""
        return self.next_pick(kv, request, tokens, start, sampling, prompt, generated).token

    def next_pick(self, kv: PagedKVPool | ShardedKVCache, request: str, tokens: Sequence[int] | torch.Tensor,
                  start: int, sampling: SamplingParams = GREEDY, prompt: Sequence[int] = (),
                  generated: Sequence[int] = (), logprobs: int | None = None,
                  ready: GroupReady | None = None) -> Pick:
        """``next_token``'s token; with ``logprobs`` (0 to 20), its logprob and that many
        likeliest tokens' too, from the same logits (``kvxfer.engine.sampling.with_logprobs``).
        ``ready``: as ``forward``'s."""
        logits = self.forward(kv, request, tokens, start, ready)
        token = int(torch.argmax(logits)) if sampling.plain else pick_token(logits, sampling, prompt, generated)
        return Pick(token) if logprobs is None else with_logprobs(logits, token, logprobs)


def _to_device(weights: Weights, device: torch.device) -> Weights:
    layers = tuple(LayerWeights(**{k: getattr(lw, k).to(device) for k in LayerWeights.__dataclass_fields__})
                   for lw in weights.layers)
    return Weights(weights.embed.to(device), layers, weights.norm.to(device), weights.lm_head.to(device))
