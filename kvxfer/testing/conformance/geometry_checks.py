"""Checks of engine geometries a backend must refuse: two ends whose KV cannot meet.

The geometries are laid over the regions both ends registered already (a slot of S bytes
seen as one block of ``layers`` layers, K and V, of ``heads`` heads), so that any pair, in
one process or two, can run them. Each refusal must keep what every refusal keeps (see
``refusal._expect_refusal``): nothing written, nothing left behind. The peer cannot wait with
an attempt of its own here (its view does not meet the local one either), so that it was
told nothing is left to the pool-view refusals, which share the submission path.
"""

from __future__ import annotations

import dataclasses

from kvxfer.contract import (
    BlockOrder,
    HeadOrder,
    InvalidSubmission,
    KVGeometry,
    LayerGroupRows,
    SlotRegion,
    TokenRange,
    TransferMode,
    View,
)
from kvxfer.testing.conformance.pair import Pair, PairFactory
from kvxfer.testing.conformance.refusal import _expect_refusal
from kvxfer.testing.conformance.transfers import _fill, _plan, _roles

KV_LAYOUT = b"conformance-kv"
UNSUPPORTED = "pool rows only"  # how a backend that moves no geometry refuses every one


def _moves_no_geometry(pair: Pair, view: View) -> bool:
    """True (after checking that describe() refuses ``view`` by saying so) for a backend that
    moves no engine geometry: the checks below then do not apply to it."""
    if getattr(pair.local, "GEOMETRY", False):
        return False
    try:
        hint = pair.local.describe(view)
    except InvalidSubmission as exc:
        assert UNSUPPORTED in str(exc), f"describe() of an engine view was refused for another reason: {exc}"
        return True
    raise AssertionError(f"a backend without GEOMETRY described an engine view (transfer {hint.transfer_id})")


def over_slots(region: SlotRegion, *, layers: int = 1, heads: tuple[int, int] = (0, 1), kv_heads: int = 1,
               dtype: str = "uint8", element_bytes: int = 1, head_dim: int | None = None) -> KVGeometry:
    """A one-token-block geometry whose block b is slot b of ``region`` (its heads fill the
    slot unless ``head_dim`` says less)."""
    held = heads[1] - heads[0]
    unit = region.slot_bytes // (2 * layers * held) if head_dim is None else head_dim * element_bytes
    if unit % element_bytes or unit == 0 or 2 * layers * held * unit > region.slot_bytes:
        raise ValueError(f"a slot of {region.slot_bytes} bytes does not hold {layers} layers of {held} heads")
    return KVGeometry(order=BlockOrder.BLOCK_MAJOR, head_order=HeadOrder.NHD, layers=layers, kv_heads=kv_heads,
                      heads=heads, head_dim=unit // element_bytes, dtype=dtype, element_bytes=element_bytes,
                      block_tokens=1, blocks=region.slots, regions=(region,),
                      planes=tuple((0, p * held * unit) for p in range(2 * layers)),
                      block_stride=region.slot_bytes, token_stride=held * unit, head_stride=unit)


def geometry_view(view: View, geometry: KVGeometry, slots_shift: int = 0) -> View:
    """``view``'s first group as the rows of ``geometry`` (one token per block)."""
    g = view.groups[0]
    rows = LayerGroupRows("kv", g.kind, g.region, g.slots + slots_shift, g.ordinals)
    return View(view.request, TokenRange(0, len(g)), (rows,), KV_LAYOUT, geometry)


_MISMATCHES = {  # what differs: (local geometry's arguments, peer's)
    "dtype": ({"dtype": "float16", "element_bytes": 2}, {}),
    "head_dim": ({"heads": (0, 2), "kv_heads": 2}, {"kv_heads": 2}),
    "layers": ({"layers": 2}, {"heads": (0, 2), "kv_heads": 2}),
}


def check_geometry_mismatch_refused(make_pair: PairFactory, mode: TransferMode) -> None:
    """Two engine geometries that differ in dtype, head_dim or layers: LayoutMismatch by name."""
    for what, (mine, theirs) in _MISMATCHES.items():
        for local_op, local_is_source in _roles():
            pair = make_pair(mode)
            try:
                plan = _plan(pair, f"geo-{what}-{local_op}", rows=4, seed=31)
                _fill(pair, plan, local_is_source)
                local = geometry_view(plan.local_view, over_slots(plan.local_view.groups[0].region, **mine))
                peer = geometry_view(plan.peer_view, over_slots(plan.peer_view.groups[0].region, **theirs))
                if _moves_no_geometry(pair, local):
                    return
                _expect_refusal(pair, plan, local_op, local_is_source, local, pair.peer.describe(peer),
                                what=f"geometries that differ in {what}", peer_waits=False, match=what)
            finally:
                pair.close()


def check_geometry_block_outside_refused(make_pair: PairFactory, mode: TransferMode) -> None:
    """A block table naming a block past the geometry's tensors: refused, nothing touched."""
    for local_op, local_is_source in _roles():
        pair = make_pair(mode)
        try:
            plan = _plan(pair, f"geo-oob-{local_op}", rows=4, seed=32)
            _fill(pair, plan, local_is_source)
            region = plan.local_view.groups[0].region
            short = dataclasses.replace(over_slots(region), blocks=int(plan.local_view.groups[0].slots.max()))
            local = geometry_view(plan.local_view, short)
            peer = geometry_view(plan.peer_view, over_slots(plan.peer_view.groups[0].region))
            if _moves_no_geometry(pair, local):
                return
            _expect_refusal(pair, plan, local_op, local_is_source, local, pair.peer.describe(peer),
                            what="a block outside the geometry", peer_waits=False, match="outside")
        finally:
            pair.close()


def check_geometry_heads_refused(make_pair: PairFactory, mode: TransferMode) -> None:
    """A fetching end that holds a head its publisher lacks, and an engine view against a pool
    view: refused, nothing touched (the fetcher must narrow its view to the publisher's heads)."""
    for local_op, local_is_source in _roles():
        for case in ("heads", "kind"):
            pair = make_pair(mode)
            try:
                plan = _plan(pair, f"geo-{case}-{local_op}", rows=4, seed=33)
                _fill(pair, plan, local_is_source)
                unit = plan.local_view.groups[0].region.slot_bytes // 4
                publisher = {"heads": (0, 1), "kv_heads": 2, "head_dim": unit}
                fetcher = {"heads": (0, 2), "kv_heads": 2, "head_dim": unit}
                mine, theirs = (publisher, fetcher) if local_is_source else (fetcher, publisher)
                local = geometry_view(plan.local_view, over_slots(plan.local_view.groups[0].region, **mine))
                peer = geometry_view(plan.peer_view, over_slots(plan.peer_view.groups[0].region, **theirs))
                if case == "kind":
                    peer = plan.peer_view
                if _moves_no_geometry(pair, local):
                    return
                _expect_refusal(pair, plan, local_op, local_is_source, local, pair.peer.describe(peer),
                                what="a fetcher holding heads the publisher lacks" if case == "heads"
                                else "an engine view against a pool view", peer_waits=False,
                                match="narrow" if case == "heads" else "both ends must be one kind")
            finally:
                pair.close()
