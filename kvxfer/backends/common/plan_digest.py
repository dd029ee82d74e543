"""Row digests between engine geometries: each destination row's digest, composed from the
segments of a transform plan (``kvxfer.backends.common.transform``) that land in it.

A destination row of a geometry transfer (one block of the destination's view) is not one span
of memory: its units (one token's head, ``unit_bytes``) lie across the layers' planes, and in a
TP rank's view only some heads of each token are its own. Its digest (``integrity``'s D, the
same sum) is taken over the row's *canonical bytes*: the units its view asks for, ordered by
plane (K then V of each layer), then token (those of the block the view asks for), then head
(those the destination holds). So a row of which the view asks for T tokens has
``2 * layers * T * heads * unit_bytes`` bytes, and a unit (plane p, the row's token i, head h)
lies at byte ``((p * T + i) * heads + h) * unit_bytes``. That is the destination's layout for
a block-major NHD destination holding whole blocks; for any other it is a fixed order that both
ends can name without the other's memory.

The digest is linear and each word's weight depends only on its place in the row, so a
segment's share of its row's digest depends only on its own units and where they land: the
publisher sums the shares of the segments it reads from its source and the fetcher those of
the segments where they landed, each with ``native.segment_digests`` (units read where they
lie; nothing assembled), and both get the digest of the same canonical bytes. Units not on
8-byte boundaries of the row (``unit_bytes`` not a multiple of 8) are summed byte by byte,
slower and to the same value. ``numpy_shares`` is the fallback without the compiled module.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvxfer import native
from kvxfer.backends.common.transform import TransformPlan
from kvxfer.contract import IndexArray, MemoryKind, SlotRegion, View

U64 = npt.NDArray[np.uint64]


@dataclass(frozen=True, eq=False)
class Placement:
    """Per segment of some of a plan's: its destination row, the canonical byte offset of its
    first unit in that row, and the row's canonical bytes."""

    row: IndexArray
    offset: IndexArray
    row_bytes: IndexArray


def placement(plan: TransformPlan, segments: IndexArray) -> Placement:
    """Where ``segments`` (indices into the plan's) land: O(len(segments)), so that a mover
    digesting chunk by chunk does not redo the whole plan each time."""
    planes, heads, unit = plan.planes, plan.heads, plan.dst.unit_bytes
    run, plane = np.divmod(np.asarray(segments, dtype=np.int64), planes)
    row = plan.run_dst_row[run]
    tokens = plan.dst_expected[row]
    return Placement(row, (plane * tokens + plan.run_dst_offset[run]) * heads * unit, planes * tokens * heads * unit)


def segment_shares(plan: TransformPlan, segments: IndexArray, *, at_source: bool, k: int,
                   where: Placement | None = None) -> U64:
    """The share of each of ``segments`` (indices into the plan's) in its destination row's
    digest, its units read at the source (``at_source``) or at the destination (host memory);
    ``where``: their ``placement``, when the caller has it."""
    where = placement(plan, segments) if where is None else where
    end = plan.src if at_source else plan.dst
    addr = (plan.src_addr if at_source else plan.dst_addr)[segments]
    args = (addr, plan.tokens[segments], where.offset, where.row_bytes)
    unit = plan.dst.unit_bytes
    kw = {"heads": plan.heads, "unit_bytes": unit, "strides": (end.token_stride, end.head_stride),
          "canon": (plan.heads * unit, unit), "k": k}
    if native.has_segment_digests():
        return native.segment_digests(*args, **kw)  # type: ignore[arg-type]
    return numpy_shares(*args, **kw)  # type: ignore[arg-type]


def row_digests(plan: TransformPlan, segments: IndexArray, *, at_source: bool, k: int) -> U64:
    """The digest of every destination row (zero where none of ``segments`` lands), as far as
    ``segments`` make it: a row's whole digest once they hold every segment of the row."""
    out = np.zeros(plan.dst_expected.size, dtype=np.uint64)
    if segments.size:
        where = placement(plan, segments)
        np.add.at(out, where.row, segment_shares(plan, segments, at_source=at_source, k=k, where=where))
    return out


def segments_of_rows(plan: TransformPlan, rows: npt.NDArray[np.bool_]) -> IndexArray:
    """The plan's segments that land in the destination rows ``rows`` marks."""
    return np.flatnonzero(np.repeat(np.asarray(rows, dtype=np.bool_)[plan.run_dst_row], plan.planes))


def numpy_shares(addr: IndexArray, tokens: IndexArray, offset: IndexArray, row_bytes: IndexArray, *, heads: int,
                 unit_bytes: int, strides: tuple[int, int], canon: tuple[int, int], k: int) -> U64:
    """``native.segment_digests`` in numpy, byte by byte (the fallback, and the tests'
    reference): byte b at canonical place q adds ``(1 + k (m - q // 8)) * (b << 8 (q % 8))``."""
    out = np.zeros(addr.size, dtype=np.uint64)
    moving = np.flatnonzero(tokens > 0)
    if moving.size == 0:
        return out
    counts = tokens[moving]
    seg = np.repeat(moving, counts)
    t = np.arange(seg.size, dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
    h = np.arange(heads, dtype=np.int64)
    b = np.arange(unit_bytes, dtype=np.int64)
    at = (addr[seg] + t * strides[0])[:, None, None] + (h * strides[1])[None, :, None] + b[None, None, :]
    place = (offset[seg] + t * canon[0])[:, None, None] + (h * canon[1])[None, :, None] + b[None, None, :]
    low = int(at.min())
    raw = np.ctypeslib.as_array(ctypes.cast(low, ctypes.POINTER(ctypes.c_uint8)), shape=(int(at.max()) - low + 1,))
    data = raw[at - low].astype(np.uint64)
    words = (row_bytes[seg] + 7) // 8
    weight = np.uint64(1) + np.uint64(k) * (words[:, None, None] - place // 8).astype(np.uint64)
    share = weight * (data << (np.uint64(8) * (place % 8).astype(np.uint64)))
    np.add.at(out, seg, share.reshape(seg.size, -1).sum(axis=1, dtype=np.uint64))
    return out


def corrupt_rows(corrupt: Callable[[SlotRegion, IndexArray], None], view: View, rows: IndexArray) -> None:
    """Call a ``CorruptFn`` test hook on landed destination rows ``rows`` (indices into the
    view's rows) of a geometry view: for each, a one-slot region over the row's first canonical
    unit (plane 0, its first token asked for, its first head), named and numbered as the view's
    row, so that whatever the hook changes is in the row's digest. Test hook only: a call per row."""
    geometry, group = view.geometry, view.groups[0]
    assert geometry is not None
    bt, unit = geometry.block_tokens, geometry.unit_bytes
    first = np.maximum(group.ordinals[rows] * bt, view.tokens.start) - group.ordinals[rows] * bt
    for slot, token in zip(group.slots[rows].tolist(), first.tolist()):
        at = geometry.plane_address(0) + slot * geometry.block_stride + token * geometry.token_stride
        region = SlotRegion(group.region.name, at - slot * unit, unit, slot + 1, MemoryKind.HOST)
        corrupt(region, np.array([slot], dtype=np.int64))
