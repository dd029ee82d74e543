"""The API tour of the README, as a program: two paged pools, in-place lenders, a transfer
with a fault part-way, exact masks, resume bounds, and the leases released.

Run: .venv/bin/python examples/lender_tour.py
"""

from __future__ import annotations

import torch

from kvxfer.backends.loopback import LoopbackBackend, LoopbackFabric
from kvxfer.contract import TransferMode
from kvxfer.lender import InPlaceLender
from kvxfer.pool import LayerGroupSpec, PagedKVPool

# One layer group, block-major: one block of all 4 layers, K and V, is one row.
spec = LayerGroupSpec("full", layers=4, block_tokens=16, kv_heads=2, head_dim=32, dtype=torch.float16)
prefill_pool = PagedKVPool([spec], num_blocks=64, scope=b"tour-model/v1")
decode_pool = PagedKVPool([spec], num_blocks=64, scope=b"tour-model/v1")
assert prefill_pool.identity == decode_pool.identity  # equal layouts, equal identities

# Prefill writes 100 tokens of K/V (a model would; random values stand in here).
prefill_pool.allocate("req-1", 100)
for layer in range(spec.layers):
    k, v = torch.randn(100, 2, 32, dtype=torch.float16), torch.randn(100, 2, 32, dtype=torch.float16)
    prefill_pool.write_kv("req-1", "full", layer, 0, k, v)
prefill_pool.commit("req-1", 100)

prefill_lender, decode_lender = InPlaceLender(prefill_pool), InPlaceLender(decode_pool)
fabric = LoopbackFabric()
# fail_after_rows=5 makes the copy stop part-way, to show what the masks and bounds say.
prefill = LoopbackBackend(fabric, "prefill", TransferMode.PUSH, fail_after_rows=5)
decode = LoopbackBackend(fabric, "decode", TransferMode.PUSH)
prefill.register(prefill_lender.regions)
decode.register(decode_lender.regions)

decode_pool.allocate("req-1", 0)                  # the decode side knows the request
read = prefill_lender.lend_read("req-1", (0, 100))      # pins prefill's blocks
write = decode_lender.lend_write("req-1", (0, 100))    # grows decode's request, pins its blocks
prefill_view, decode_view = read.view(), write.view()
assert prefill_view is not None and decode_view is not None  # in place: ready at once

prefill_hint = prefill.describe(prefill_view, decode.peer)  # each bound to the one peer that may use it;
decode_hint = decode.describe(decode_view, prefill.peer)   # a router carries them
fetch = decode.fetch(decode_view, prefill_hint)
publish = prefill.publish(prefill_view, decode_hint)
read.track(publish)                                # release() waits for quiescence
write.track(fetch)
fetch.wait(10)
outcome = fetch.poll()
print(f"decode outcome: {type(outcome).__name__}, rows {outcome.rows_delivered}/{decode_view.rows}, "
      f"masks {[m.astype(int).tolist() for m in outcome.masks]}")

write.mark_arrived(outcome.masks)                  # what arrived, exactly
bounds = decode_lender.readiness("req-1")
print(f"resume bounds: usable until token {bounds.usable_until}, restart floor {bounds.restart_floor}")
k_p, _ = prefill_pool.read_kv("req-1", "full", 0, 0, bounds.usable_until)
k_d, _ = decode_pool.read_kv("req-1", "full", 0, 0, bounds.usable_until)
print(f"arrived K/V byte-exact up to the bound: {torch.equal(k_p, k_d)}")

read.release()
write.release()
print("unquiesced attempts at shutdown:", len(prefill.shutdown() | decode.shutdown()))
