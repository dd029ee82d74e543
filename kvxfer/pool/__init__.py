"""The paged KV pool: a torch KV cache (CUDA or CPU) with block tables and prefix reuse.

Build one from frozen layer-group specs::

    from kvxfer.pool import PagedKVPool, LayerGroupSpec, Layout
    full = LayerGroupSpec("full", layers=4, block_tokens=16, kv_heads=2, head_dim=64, dtype=torch.float16)
    swa = LayerGroupSpec("swa", layers=2, block_tokens=16, kv_heads=2, head_dim=64, window=128, sink_blocks=1)
    pool = PagedKVPool([full, swa], num_blocks=1024, device="cuda", scope=b"model-x/weights-v3/fp16")

Requests (one call sequence, the owner's thread; nothing here is thread-safe):

- ``reused = pool.allocate(req, tokens, token_ids=None)``: room for ``tokens`` tokens in
  every group; with ``token_ids`` full blocks whose prefix is cached are shared
  (refcounted) and count as written. ``reused`` = prefix tokens valid in all groups.
- ``pool.grow(req, tokens)``, ``pool.shrink(req, tokens)``, ``pool.free(req)``. All or
  nothing; ``PoolExhausted`` when blocks run out (cached prefixes are evicted LRU first).
  Blocks a lease pins are never reused until the lease is released (free/shrink defer).
- ``pool.commit(req, end, token_ids=None)``: KV for ``[0, end)`` is written (after every
  layer). With ``token_ids`` its full blocks become shareable prefixes for later requests.

A model writes and reads K/V per layer:

- ``pool.write_kv(req, group, layer, start, k, v)`` with ``k``/``v`` ``[n, kv_heads, head_dim]``
  for tokens ``[start, start + n)``; ``pool.read_kv(req, group, layer, start, end) -> (k, v)``.
  ``write_kv`` refuses blocks shared with another request (no copy on write) and blocks a
  lease holds (release the lease first).
- Or directly: ``K, V = pool.layer_kv(group, layer)`` are ``[blocks, block_tokens, kv_heads,
  head_dim]`` views into the pool; ``pool.block_table(req, group)`` (numpy int64, by ordinal =
  block index in the request's sequence), ``pool.block_table_tensor(req, group)`` (torch int64 on
  the pool's device) and ``pool.slots_for(req, group, positions) ->
  (blocks, offsets)`` index them. ``pool.state(req, group)`` is a STATE group's slot.

For lenders and backends: ``pool.identity`` (layout identity bytes, see
``kvxfer.pool.identity``), ``pool.slot_regions()`` (DEVICE on CUDA, HOST on CPU),
``pool.row_regions()`` (the tensors behind them), ``pool.filled(req, group)``,
``pool.add_listener(lender)`` for the free / shrink / reuse-reset hooks, and
``pool.reset_reuse(scope)`` for a scope change.
"""

from kvxfer.pool.allocator import BlockAllocator, PoolExhausted
from kvxfer.pool.identity import IDENTITY_BYTES, LAYOUT_VERSION, NAME_BYTES, block_names, layout_identity
from kvxfer.pool.pool import PagedKVPool, PoolListener, RowRegion, UnknownRequest
from kvxfer.pool.spec import LayerGroupSpec, Layout

__all__ = [
    "BlockAllocator", "IDENTITY_BYTES", "LAYOUT_VERSION", "LayerGroupSpec", "Layout", "NAME_BYTES",
    "PagedKVPool", "PoolExhausted", "PoolListener", "RowRegion", "UnknownRequest", "block_names",
    "layout_identity",
]
