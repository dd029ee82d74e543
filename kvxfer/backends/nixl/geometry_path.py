"""The NIXL backend's path for engine geometries: KV moves between two different layouts.

A submission whose view and hint carry geometries (``kvxfer.contract.geometry``) is planned
with ``plan_between`` (``kvxfer.backends.common.transform``): segments, each a run of tokens
inside one block at both ends times one layer's K or V plane, ordered by run then plane. The
fetching end is the plan's destination. Both ends can make the same plan, each from its own
view and the other's hint. This module turns the plan into the backend's jobs:

- **Descriptors** (push WRITE, pull READ): a segment whose units are contiguous at both ends
  (in one order, token-major or head-major) is one descriptor; otherwise one per token when
  the heads of a token are contiguous at both ends, one per head when the tokens of a head
  are, else one per unit (head_dim bytes); then descriptors adjacent at both ends, inside one
  registered region at each end, are coalesced. Local addresses come from this end's
  geometry, remote ones from the peer's geometry in the hint: its regions are what the peer
  registered (describe() refuses a geometry view whose regions are not), so every remote
  descriptor lies in memory NIXL knows at the peer.
- **Packed** (push only, ``geometry_packed``): the sender gathers a chunk's segments into an
  arena slot in a canonical order (segment after segment, each token-major then head), WRITEs
  the slot, and the receiver scatters it into its own layout.

Chunks are ranges of segments cut at run boundaries within the chunk byte budget (a run
larger than a packed slot is cut between its planes), so a chunk's completion proves its
segments, and a run counts once all its segments are proven. Masks are
``Oriented.landed_masks`` (the proof rule, in ``TransformPlan.masks``): a destination block
that got only some of its runs is False.
``fail_after_rows`` counts runs here (as in the loopback backend).
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvxfer.backends.common.transform import Oriented, TransformPlan
from kvxfer.backends.nixl.jobs import ActiveJob
from kvxfer.backends.nixl.plan import DescArray
from kvxfer.contract import BoolArray, IndexArray, KVGeometry, MemoryKind

WHOLE, PER_TOKEN, PER_HEAD, PER_UNIT = 0, 1, 2, 3  # how a segment's units become descriptors


def segments(plan: TransformPlan) -> int:
    return plan.runs * plan.planes


def unit_row(plan: TransformPlan) -> int:
    """Bytes of one token's heads: a token's share of a packed segment."""
    return plan.heads * plan.dst.unit_bytes


def memory_of(geometry: KVGeometry) -> tuple[MemoryKind, int]:
    region = geometry.regions[0]  # one memory for all of a geometry's regions
    return region.memory_kind, region.device_id


def fingerprint(plan: TransformPlan) -> bytes:
    """8 bytes that two ends' plans share only when they move the same units to the same
    places: the strides, every plane's address at both ends, and each run's tokens and
    first addresses (a segment's address is its run's plus its plane's offset)."""
    s, d, p = plan.src, plan.dst, plan.planes
    h = hashlib.blake2b(digest_size=8)
    h.update(struct.pack("<6q", plan.heads, d.unit_bytes, s.token_stride, s.head_stride, d.token_stride,
                         d.head_stride))
    h.update(np.array([s.plane_address(i) for i in range(p)] + [d.plane_address(i) for i in range(p)],
                      dtype=np.int64).tobytes())
    for array in (plan.run_tokens, plan.src_addr[::p], plan.dst_addr[::p]):
        h.update(np.ascontiguousarray(array, dtype=np.int64).tobytes())
    return h.digest()


# --- descriptors --------------------------------------------------------------------------
@dataclass(frozen=True, eq=False)
class Shape:
    """Per segment of a plan's first ``end``: how its units become descriptors, and what
    coalescing will merge (inside it, and with the next segment)."""

    mode: IndexArray
    count: IndexArray      # descriptors before coalescing
    length: IndexArray     # bytes of each of them
    inner: IndexArray      # merges inside the segment
    joins: BoolArray       # per segment but the last: its last descriptor meets the next one's first
    src_region: IndexArray
    dst_region: IndexArray


def _contiguous(tokens: IndexArray, heads: int, unit: int, ts: int, hs: int, token_major: bool) -> BoolArray:
    """Per segment: its units form one span at this end, in the given order."""
    if token_major:
        heads_ok = heads == 1 or hs == unit
        return heads_ok & ((tokens == 1) | (ts == heads * unit))
    return ((tokens == 1) | (ts == unit)) & ((heads == 1) | (hs == tokens * unit))


def shape_of(plan: TransformPlan, end: int) -> Shape:
    """The descriptor shape of segments [0, end) (``end``: a multiple of the planes)."""
    s, d, heads, unit = plan.src, plan.dst, plan.heads, plan.dst.unit_bytes
    tok = plan.tokens[:end]
    whole = np.zeros(tok.size, dtype=np.bool_)
    for major in (True, False):
        whole |= (_contiguous(tok, heads, unit, s.token_stride, s.head_stride, major)
                  & _contiguous(tok, heads, unit, d.token_stride, d.head_stride, major))
    heads_ok = heads == 1 or (s.head_stride == unit and d.head_stride == unit)
    tokens_ok = s.token_stride == unit and d.token_stride == unit
    other = PER_TOKEN if heads_ok else PER_HEAD if tokens_ok else PER_UNIT
    mode = np.where(whole, WHOLE, other).astype(np.int64)
    count = np.select([mode == WHOLE, mode == PER_TOKEN, mode == PER_HEAD], [1, tok, heads], tok * heads)
    length = np.select([mode == WHOLE, mode == PER_TOKEN, mode == PER_HEAD],
                       [tok * heads * unit, heads * unit, tok * unit], unit).astype(np.int64)
    # Per unit, a token's last head can meet the next token's first head at both ends.
    wraps = all(g.token_stride == (heads - 1) * g.head_stride + unit for g in (s, d))
    inner = np.where((mode == PER_UNIT) & wraps, tok - 1, 0).astype(np.int64)
    src_region = np.tile(np.array([r for r, _ in s.planes], dtype=np.int64), end // plan.planes)
    dst_region = np.tile(np.array([r for r, _ in d.planes], dtype=np.int64), end // plan.planes)
    joins = (_last_end(plan, mode, tok, s, plan.src_addr[:end])[:-1] == plan.src_addr[1:end]) \
        & (_last_end(plan, mode, tok, d, plan.dst_addr[:end])[:-1] == plan.dst_addr[1:end]) \
        & (src_region[:-1] == src_region[1:]) & (dst_region[:-1] == dst_region[1:])
    return Shape(mode, count.astype(np.int64), length, inner, joins, src_region, dst_region)


def _last_end(plan: TransformPlan, mode: IndexArray, tok: IndexArray, g: KVGeometry, addr: IndexArray) -> IndexArray:
    """Per segment: where its last descriptor ends at the end ``g``."""
    heads, unit = plan.heads, plan.dst.unit_bytes
    last_t, last_h = (tok - 1) * g.token_stride, (heads - 1) * g.head_stride
    return addr + np.select([mode == WHOLE, mode == PER_TOKEN, mode == PER_HEAD],
                            [tok * heads * unit, last_t + heads * unit, last_h + tok * unit], last_t + last_h + unit)


def count_descriptors(shape: Shape, chunks: list[tuple[int, int]], *, coalesce: bool) -> int:
    """Descriptors that ``chunk_descriptors`` would make for these chunks, without making them."""
    if not chunks:
        return 0
    first, end = (np.array(x, dtype=np.int64) for x in zip(*chunks))
    counts = np.concatenate(([0], np.cumsum(shape.count if not coalesce else shape.count - shape.inner)))
    total = int((counts[end] - counts[first]).sum())
    if coalesce:
        joins = np.concatenate(([0], np.cumsum(shape.joins)))
        total -= int((joins[end - 1] - joins[first]).sum())
    return total


def chunk_descriptors(plan: TransformPlan, shape: Shape, first: int, end: int, *,
                      coalesce: bool) -> tuple[IndexArray, IndexArray, IndexArray]:
    """(source addresses, destination addresses, bytes) of segments [first, end)."""
    heads, s, d = plan.heads, plan.src, plan.dst
    n = shape.count[first:end]
    seg = np.repeat(np.arange(first, end, dtype=np.int64), n)
    k = np.arange(seg.size, dtype=np.int64) - np.repeat(np.cumsum(n) - n, n)
    mode = shape.mode[seg]
    t = np.where(mode == PER_TOKEN, k, np.where(mode == PER_UNIT, k // heads, 0))
    h = np.where(mode == PER_HEAD, k, np.where(mode == PER_UNIT, k % heads, 0))
    src = plan.src_addr[seg] + t * s.token_stride + h * s.head_stride
    dst = plan.dst_addr[seg] + t * d.token_stride + h * d.head_stride
    length = shape.length[seg]
    if coalesce and seg.size > 1:
        sreg, dreg = shape.src_region[seg], shape.dst_region[seg]
        join = ((src[:-1] + length[:-1] == src[1:]) & (dst[:-1] + length[:-1] == dst[1:])
                & (sreg[:-1] == sreg[1:]) & (dreg[:-1] == dreg[1:]))
        starts = np.flatnonzero(np.concatenate(([True], ~join)))
        src, dst, length = src[starts], dst[starts], np.add.reduceat(length, starts)
    return src, dst, length


def cut_chunks(plan: TransformPlan, end: int, budget: int, *, hard: bool) -> list[tuple[int, int]]:
    """Segment ranges of [0, end) at run boundaries, each within ``budget`` bytes where it can
    be: a run over it is a chunk alone (``hard``: cut between its planes instead)."""
    planes, row = plan.planes, unit_row(plan)
    runs = end // planes
    cum = np.concatenate(([0], np.cumsum(plan.run_tokens[:runs] * (planes * row))))
    out: list[tuple[int, int]] = []
    r = 0
    while r < runs:
        e = int(np.searchsorted(cum, cum[r] + budget, side="right")) - 1
        if e > r:
            out.append((r * planes, e * planes))
            r = e
            continue
        step = max(1, budget // (int(plan.run_tokens[r]) * row)) if hard else planes
        out.extend((r * planes + p, r * planes + min(planes, p + step)) for p in range(0, planes, step))
        r += 1
    return out


def _descs(addr: IndexArray, length: IndexArray, device: int) -> DescArray:
    out = np.empty((addr.size, 3), dtype=np.uint64)
    out[:, 0] = addr.astype(np.uint64)
    out[:, 1] = length.astype(np.uint64)
    out[:, 2] = device
    return out


# --- the unpacked job ---------------------------------------------------------------------
@dataclass(frozen=True, eq=False)
class SegmentChunk:
    """One transfer request: segments [first, end) of the plan as NIXL descriptors."""

    first: int
    end: int
    local_descs: DescArray
    remote_descs: DescArray
    local_kind: MemoryKind
    remote_kind: MemoryKind

    @property
    def rows(self) -> int:
        return self.end - self.first

    @property
    def nbytes(self) -> int:
        return int(self.local_descs[:, 1].sum())


def segment_chunks(transform: Oriented, end: int, budget: int, *, coalesce: bool) -> list[SegmentChunk]:
    plan = transform.plan
    local, remote = (plan.src, plan.dst) if transform.local_is_src else (plan.dst, plan.src)
    (lkind, ldev), (rkind, rdev) = memory_of(local), memory_of(remote)
    shape = shape_of(plan, end)
    chunks = []
    for first, stop in cut_chunks(plan, end, budget, hard=False):
        src, dst, length = chunk_descriptors(plan, shape, first, stop, coalesce=coalesce)
        mine, theirs = (src, dst) if transform.local_is_src else (dst, src)
        chunks.append(SegmentChunk(first, stop, _descs(mine, length, ldev), _descs(theirs, length, rdev),
                                   lkind, rkind))
    return chunks


@dataclass(eq=False)
class GeometryJob(ActiveJob):
    """An unpacked job between two geometries: its chunks are segment ranges."""

    transform: Oriented | None = None

    def masks(self) -> tuple[list[BoolArray], list[BoolArray]]:
        return proven_masks(self.transform, self.chunks, self.done)


def proven_masks(transform: Oriented | None, chunks: list[Any], done: list[int]) -> tuple[list[BoolArray],
                                                                                           list[BoolArray]]:
    """(local, peer) masks of the runs whose every segment is in a proven chunk."""
    assert transform is not None
    landed = np.zeros(segments(transform.plan), dtype=np.bool_)
    for index in set(done):
        landed[chunks[index].first:chunks[index].end] = True
    return transform.landed_masks(landed)
