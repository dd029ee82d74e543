"""An engine's own KV moved between two TP layouts, with no pool and no copy of the cache.

Prefill keeps vLLM-style tensors, one per layer, ``[2, blocks, 16, 8, 64]`` (NHD, all 8 KV
heads, TP 1). Decode runs TP 2 with 32-token blocks, heads before tokens (HND): rank 1 holds
heads 4..7 in ``[2, blocks, 4, 32, 64]`` per layer. The engines hand over their tensors and
block tables; kvxfer lends the rows, plans the transform and moves each head of each token
into its place (one kernel per submission on a GPU). Run: ``python examples/engine_kv_tour.py``.
"""

from __future__ import annotations

import numpy as np
import torch

from kvxfer.backends.loopback import LoopbackBackend, LoopbackFabric
from kvxfer.contract import HeadOrder, LayoutMismatch, TransferMode
from kvxfer.lender.engine_kv import EngineKV
from kvxfer.lender.external import ExternalLender

LAYERS, BLOCKS, TOKENS = 4, 64, 300
prefill_layers = [torch.randn(2, BLOCKS, 16, 8, 64).half() for _ in range(LAYERS)]
decode_layers = [torch.zeros(2, BLOCKS, 4, 32, 64, dtype=torch.half) for _ in range(LAYERS)]

prefill_kv = EngineKV.per_layer(prefill_layers, kv_heads=8, scope=b"my-model/v1", name="prefill")
decode_kv = EngineKV.per_layer(decode_layers, kv_heads=8, heads=(4, 8), head_order=HeadOrder.HND,
                               scope=b"my-model/v1", name="decode-rank1")
print("prefill:", prefill_kv.geometry.describe())
print("decode rank 1:", decode_kv.geometry.describe())

fabric = LoopbackFabric()  # NixlBackend / IpcBackend across processes
prefill = LoopbackBackend(fabric, "prefill", TransferMode.PUSH)
decode = LoopbackBackend(fabric, "decode", TransferMode.PUSH)
prefill.register(prefill_kv.regions)
decode.register(decode_kv.regions)

rng = np.random.default_rng(0)
prefill_table = rng.permutation(BLOCKS)[: -(-TOKENS // 16)]  # the engines' own block tables
decode_table = rng.permutation(BLOCKS)[: -(-TOKENS // 32)]
prefill_lender, decode_lender = ExternalLender(prefill_kv), ExternalLender(decode_kv)  # one per engine KV
read = prefill_lender.lend_read("req-1", prefill_table, (0, TOKENS))
write = decode_lender.lend_write("req-1", decode_table, (0, TOKENS))

decode_hint = decode.describe(write.view(), prefill.peer)
prefill_hint = prefill.describe(read.view(), decode.peer)
publish = prefill.publish(read.view(), decode_hint)
fetch = decode.fetch(write.view(), prefill_hint)
read.track(publish)
write.track(fetch)
fetch.wait(10)
outcome = fetch.poll()
write.mark_arrived(outcome.masks)
print(f"{type(outcome).__name__}: {outcome.rows_delivered} of {len(decode_table)} decode blocks, "
      f"KV in place up to token {write.usable_until}")

# Token 100, head 5, layer 2, V: where each end keeps it.
p_block, p_tok = prefill_table[100 // 16], 100 % 16
d_block, d_tok = decode_table[100 // 32], 100 % 32
assert torch.equal(decode_layers[2][1, d_block, 5 - 4, d_tok], prefill_layers[2][1, p_block, p_tok, 5])
print("token 100, head 5 of layer 2 is byte-identical at both ends")
read.release()
write.release()  # the fetch has quiesced (wait), so its blocks are free to lend again


# A view that wants heads its publisher does not hold is refused before anything moves.
narrow_prefill = EngineKV.per_layer([t[:, :, :, :4].contiguous() for t in prefill_layers], kv_heads=8,
                                    heads=(0, 4), scope=b"my-model/v1", name="prefill-rank0")
prefill.register(narrow_prefill.regions)
narrow_lender = ExternalLender(narrow_prefill)  # other tensors: a lender of their own
other = narrow_lender.lend_read("req-2", prefill_table, (0, TOKENS))
write2 = decode_lender.lend_write("req-2", decode_table, (0, TOKENS))
try:
    prefill.publish(other.view(), decode.describe(write2.view(), prefill.peer))
except LayoutMismatch as exc:
    print("refused:", exc)
other.release()
write2.release()
# The engine frees its blocks through the lender: any a transfer may still touch would be refused
# (BlocksBusy) or, with defer=True, held back until reclaim() hands them over.
assert decode_lender.free(decode_table).size == decode_table.size
assert not (prefill.shutdown() | decode.shutdown())
for lender in (prefill_lender, decode_lender, narrow_lender):
    assert not lender.shutdown().retained_anything
