"""Shared helpers for the lender tests (no tests here): fill a pool, move rows over loopback."""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass

import numpy as np
import torch

from kvxfer.backends.loopback import LoopbackBackend, LoopbackFabric
from kvxfer.contract import CacheKind, Outcome, TransferMode
from kvxfer.lender import Lease, Lender
from kvxfer.pool import LayerGroupSpec, PagedKVPool

FULL = LayerGroupSpec("full", layers=2, block_tokens=4, kv_heads=2, head_dim=8)
SWA = LayerGroupSpec("swa", layers=1, block_tokens=8, kv_heads=1, head_dim=8, window=16, sink_blocks=1)
STATE = LayerGroupSpec("ssm", layers=1, block_tokens=1, kv_heads=2, head_dim=16, kind=CacheKind.STATE)
MLA = LayerGroupSpec("mla", layers=3, block_tokens=16, kv_heads=1, head_dim=32, dtype=torch.bfloat16)

_names = itertools.count()


def fill(pool: PagedKVPool, request: str, tokens: int, seed: int = 0, token_ids: object = None,
         of: int | None = None) -> None:
    """Allocate ``request`` and write random K/V for every layer (and state), then commit.

    The values are those of a ``of``-token fill (default ``tokens``) cut to ``tokens``, so a
    shorter fill with the same seed and ``of`` holds the same prefix."""
    gen = torch.Generator().manual_seed(seed)
    if not pool.has(request):
        pool.allocate(request, tokens)
    for spec in pool.groups:
        if spec.kind is CacheKind.STATE:
            slot = pool.state(request, spec.name)
            slot.copy_(torch.randn(slot.shape, generator=gen).to(slot.dtype))
            continue
        for layer in range(spec.layers):
            k = torch.randn(of or tokens, spec.kv_heads, spec.head_dim, generator=gen)[:tokens]
            v = torch.randn(of or tokens, spec.kv_heads, spec.head_dim, generator=gen)[:tokens]
            pool.write_kv(request, spec.name, layer, 0, k, v)
    pool.commit(request, tokens, token_ids)


def block_bytes(pool: PagedKVPool, request: str, group: str, ordinals: np.ndarray) -> list[bytes]:
    """The raw bytes of each of the request's blocks ``ordinals`` (all layers, K and V)."""
    table = pool.block_table(request, group)
    out = []
    for o in ordinals.tolist():
        b = int(table[o])
        regions = [r for r in pool.row_regions() if r.group == group]
        out.append(b"".join(r.rows[b].contiguous().view(torch.uint8).numpy().tobytes() for r in regions))
    return out


@dataclass
class Link:
    fabric: LoopbackFabric
    prefill: LoopbackBackend
    decode: LoopbackBackend

    def close(self) -> None:
        assert not self.prefill.shutdown()
        assert not self.decode.shutdown()
        names = {f"kvxfer-loopback-{self.prefill.name}", f"kvxfer-loopback-{self.decode.name}"}
        assert not [t for t in threading.enumerate() if t.name in names], "a backend thread outlived shutdown"


def link(lp: Lender, ld: Lender, mode: TransferMode = TransferMode.PUSH, fail_after_rows: int | None = None,
         delay_s: float = 0.0) -> Link:
    """Two loopback backends on one fabric; the active end (push: prefill, pull: decode) may fault."""
    fabric = LoopbackFabric()
    n = next(_names)
    push = mode is TransferMode.PUSH
    p = LoopbackBackend(fabric, f"P{n}", mode, fail_after_rows=fail_after_rows if push else None,
                        delay_s=delay_s if push else 0.0)
    d = LoopbackBackend(fabric, f"D{n}", mode, fail_after_rows=None if push else fail_after_rows,
                        delay_s=0.0 if push else delay_s)
    p.register(lp.regions)
    d.register(ld.regions)
    return Link(fabric, p, d)


def move(lnk: Link, read: Lease, write: Lease, *, mark: bool = True, timeout: float = 10.0) -> tuple[Outcome, Outcome]:
    """publish(view_P, hint_D) and fetch(view_D, hint_P); wait; mark arrival on the write lease."""
    view_p, view_d = read.view(), write.view()
    assert view_p is not None and view_d is not None
    hint_p = lnk.prefill.describe(view_p)
    hint_d = lnk.decode.describe(view_d)
    pub = lnk.prefill.publish(view_p, hint_d)
    fet = lnk.decode.fetch(view_d, hint_p)
    read.track(pub)
    write.track(fet)
    assert pub.wait(timeout) and fet.wait(timeout)
    out_p, out_d = pub.poll(), fet.poll()
    assert out_p is not None and out_d is not None
    if mark:
        write.mark_arrived(out_d.masks)
    return out_p, out_d
