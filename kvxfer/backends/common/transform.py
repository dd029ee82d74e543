"""The plan that moves KV between two geometries: which bytes go where, and which rows it proves.

Two ends with geometries (``kvxfer.contract.geometry``) may differ in block size, block
order, head order and the heads they hold. The common coordinate is the token: the tokens
both views cover are cut at both ends' block boundaries into *runs*, each inside one source
block and one destination block; a run times a layer's K or V plane is a *segment*, the unit
the movers take (``kvxfer.native.transform_copy``: one kernel per submission on the GPU).
Segments are ordered by run, then plane, so the segments of a destination block are
consecutive and a mover that stops part-way proves a prefix of blocks.

A destination row counts only when every token of it that its view asks for arrived, in
every layer, K and V, for all the heads its geometry holds; the destination must hold no
head the source lacks (a TP rank fetching from several sources narrows its view per source
with ``KVGeometry.narrowed``). A source row counts when every token of it that the transfer needed
was copied.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvxfer import native
from kvxfer.contract import (
    BoolArray,
    Hint,
    HintGroup,
    IndexArray,
    KVGeometry,
    LayoutMismatch,
    MemoryKind,
    View,
    check_compatible,
)


@dataclass(frozen=True, eq=False)
class Rows:
    """One end's rows: ``slots[i]`` (a block id) holds logical block ``ordinals[i]``, and the
    view asks for tokens [start, end)."""

    slots: IndexArray
    ordinals: IndexArray
    start: int
    end: int

    @staticmethod
    def of_view(view: View) -> Rows:
        group = view.groups[0]
        return Rows(group.slots, group.ordinals, view.tokens.start, view.tokens.end)

    @staticmethod
    def of_hint(group: HintGroup, tokens: tuple[int, int]) -> Rows:
        return Rows(group.slots, group.ordinals, tokens[0], tokens[1])


@dataclass(frozen=True, eq=False)
class TransformPlan:
    """Segments from ``src`` to ``dst`` (addresses are the geometries' own: rebase a peer's
    geometry onto its mapped regions first), and the rows each segment belongs to."""

    src: KVGeometry
    dst: KVGeometry
    src_addr: IndexArray     # per segment, the address of its first unit
    dst_addr: IndexArray
    tokens: IndexArray       # tokens per segment
    run_src_row: IndexArray  # per run: the source row (index into the source rows)
    run_dst_row: IndexArray
    run_tokens: IndexArray
    run_dst_offset: IndexArray  # per run: its first token's place among the tokens its destination row asks for
    src_expected: IndexArray  # per source row: tokens the transfer must copy from it
    dst_expected: IndexArray  # per destination row: tokens its view asks for

    @property
    def planes(self) -> int:
        return 2 * self.src.layers

    @property
    def runs(self) -> int:
        return int(self.run_tokens.size)

    @property
    def heads(self) -> int:
        return self.dst.head_count

    @property
    def nbytes(self) -> int:
        return int(self.run_tokens.sum()) * self.planes * self.heads * self.dst.unit_bytes

    def runs_landed(self, segments: BoolArray) -> BoolArray:
        """Runs whose every segment ``segments`` marks (one flag per segment, run-major): a run
        split across chunks counts only once all its planes are in."""
        return np.asarray(segments.reshape(self.runs, self.planes).all(axis=1), dtype=np.bool_)

    def segment_range(self, first_run: int, end_run: int) -> slice:
        return slice(first_run * self.planes, end_run * self.planes)

    def masks(self, runs_done: int | BoolArray) -> tuple[BoolArray, BoolArray]:
        """(source rows, destination rows) proven once the first ``runs_done`` runs (or the
        runs a bool array marks) were copied in full.

        The proof rule, for every backend: a destination row is True only when every token
        its view asks for arrived, that is when every run that writes into it was copied (a
        block that got only some of its runs is False); a source row only when every token the
        transfer needed from it was copied. A row nothing asks for is False."""
        if isinstance(runs_done, (int, np.integer)):
            done = np.zeros(self.runs, dtype=np.bool_)
            done[: int(runs_done)] = True
        else:
            done = np.asarray(runs_done, dtype=np.bool_)
        copied = np.where(done, self.run_tokens, 0)
        src = np.bincount(self.run_src_row, copied, minlength=self.src_expected.size)
        dst = np.bincount(self.run_dst_row, copied, minlength=self.dst_expected.size)
        return (src == self.src_expected) & (self.src_expected > 0), (dst == self.dst_expected) & (self.dst_expected > 0)


def _row_table(rows: Rows, block_tokens: int, blocks: int, what: str) -> np.ndarray:
    """ordinal -> row index (-1: the view has no row for it), over the ordinals in use."""
    if rows.slots.size and (int(rows.slots.min()) < 0 or int(rows.slots.max()) >= blocks):
        bad = int(rows.slots.min()) if int(rows.slots.min()) < 0 else int(rows.slots.max())
        raise LayoutMismatch(f"{what} block table names block {bad}, outside the {blocks} blocks of its tensors")
    if rows.ordinals.size and int(rows.ordinals.min()) < 0:
        raise LayoutMismatch(f"{what} rows name a negative logical block")
    size = int(rows.ordinals.max()) + 1 if rows.ordinals.size else 0
    table = np.full(size, -1, dtype=np.int64)
    table[rows.ordinals] = np.arange(rows.ordinals.size, dtype=np.int64)
    return table


def _expected(rows: Rows, block_tokens: int, first: int, end: int) -> IndexArray:
    """Per row: how many of its block's tokens lie in [first, end)."""
    lo = np.maximum(rows.ordinals * block_tokens, first)
    hi = np.minimum((rows.ordinals + 1) * block_tokens, end)
    return np.maximum(hi - lo, 0).astype(np.int64)


def plan_transform(src: KVGeometry, src_rows: Rows, dst: KVGeometry, dst_rows: Rows) -> TransformPlan:
    """The segments that move the tokens both ends cover; LayoutMismatch names why two ends
    cannot meet (model KV differs, the destination holds a head the source lacks, a block
    table outside its tensors)."""
    first, end = check_compatible(src, dst)
    if (first, end) != dst.heads:
        raise LayoutMismatch(
            f"the destination holds heads [{dst.heads[0]}, {dst.heads[1]}) but the source only "
            f"[{src.heads[0]}, {src.heads[1]}): narrow the destination's view to the source's heads")
    src_table = _row_table(src_rows, src.block_tokens, src.blocks, "the source's")
    dst_table = _row_table(dst_rows, dst.block_tokens, dst.blocks, "the destination's")
    lo, hi = max(src_rows.start, dst_rows.start), min(src_rows.end, dst_rows.end)
    cuts = _cuts(lo, hi, src.block_tokens, dst.block_tokens)
    starts, lengths = cuts[:-1], np.diff(cuts)
    s_ord, d_ord = starts // src.block_tokens, starts // dst.block_tokens
    s_row, d_row = _lookup(src_table, s_ord), _lookup(dst_table, d_ord)
    keep = (s_row >= 0) & (d_row >= 0)
    starts, lengths, s_row, d_row = starts[keep], lengths[keep], s_row[keep], d_row[keep]
    s_off = (src_rows.slots[s_row] * src.block_stride + (starts % src.block_tokens) * src.token_stride
             + (first - src.heads[0]) * src.head_stride)
    d_off = dst_rows.slots[d_row] * dst.block_stride + (starts % dst.block_tokens) * dst.token_stride
    src_planes = np.array([src.plane_address(p) for p in range(2 * src.layers)], dtype=np.int64)
    dst_planes = np.array([dst.plane_address(p) for p in range(2 * dst.layers)], dtype=np.int64)
    planes = src_planes.size
    dst_first = np.maximum(dst_rows.ordinals[d_row] * dst.block_tokens, dst_rows.start)
    return TransformPlan(
        src=src, dst=dst,
        src_addr=_frozen(np.add.outer(s_off, src_planes).ravel()),
        dst_addr=_frozen(np.add.outer(d_off, dst_planes).ravel()),
        tokens=_frozen(np.repeat(lengths, planes)),
        run_src_row=_frozen(s_row), run_dst_row=_frozen(d_row), run_tokens=_frozen(lengths),
        run_dst_offset=_frozen(starts - dst_first),
        src_expected=_frozen(_expected(src_rows, src.block_tokens, lo, hi)),
        dst_expected=_frozen(_expected(dst_rows, dst.block_tokens, dst_rows.start, dst_rows.end)),
    )


def _lookup(table: np.ndarray, ordinals: np.ndarray) -> np.ndarray:
    """table[ordinals], -1 past its end."""
    padded = np.concatenate([table, [-1]])
    return padded[np.minimum(ordinals, table.size)]


def _cuts(lo: int, hi: int, a: int, b: int) -> np.ndarray:
    """lo, every multiple of a or b strictly inside (lo, hi), hi: sorted, distinct."""
    if hi <= lo:
        return np.array([lo], dtype=np.int64)
    inner = [np.arange((lo // step + 1) * step, hi, step, dtype=np.int64) for step in (a, b)]
    return np.unique(np.concatenate([[lo], *inner, [hi]])).astype(np.int64)


def _frozen(array: np.ndarray) -> IndexArray:
    out = np.ascontiguousarray(array, dtype=np.int64)
    out.flags.writeable = False
    return out


@dataclass(frozen=True, eq=False)
class Oriented:
    """A submission's plan, and which end of it this backend's view is."""

    plan: TransformPlan
    local_is_src: bool

    def masks(self, runs_done: int | BoolArray) -> tuple[list[BoolArray], list[BoolArray]]:
        """(masks of the local view, masks of the peer's hint) once ``runs_done`` were copied."""
        src, dst = self.plan.masks(runs_done)
        return ([src], [dst]) if self.local_is_src else ([dst], [src])

    def sealed_masks(self, runs_done: int | BoolArray) -> tuple[list[BoolArray], list[BoolArray]]:
        """``masks``, read-only: outcomes and completion records take them without a copy."""
        local, peer = self.masks(runs_done)
        for mask in (*local, *peer):
            mask.flags.writeable = False
        return local, peer

    def landed_masks(self, segments: BoolArray) -> tuple[list[BoolArray], list[BoolArray]]:
        """``sealed_masks`` once the segments ``segments`` marks (one flag per segment) landed."""
        return self.sealed_masks(self.plan.runs_landed(segments))


def plan_between(view: View, hint: Hint, *, fetching: bool, peer: KVGeometry | None = None) -> Oriented:
    """The plan of a submission whose view and hint both carry geometries (the fetching end
    is the destination). ``peer`` replaces the hint's geometry (a peer's memory as mapped
    here). LayoutMismatch names why the two cannot meet."""
    if view.geometry is None or hint.geometry is None or hint.tokens is None or len(hint.groups) != 1:
        raise LayoutMismatch("a transform needs a geometry, with its token range and one row group, at both ends")
    theirs = Rows.of_hint(hint.groups[0], (hint.tokens.start, hint.tokens.end))
    ours = Rows.of_view(view)
    other = hint.geometry if peer is None else peer
    if fetching:
        return Oriented(plan_transform(other, theirs, view.geometry, ours), local_is_src=False)
    return Oriented(plan_transform(view.geometry, ours, other, theirs), local_is_src=True)


def rebased(geometry: KVGeometry, addresses: Sequence[int]) -> KVGeometry:
    """``geometry`` with its regions at ``addresses`` (a peer's memory as mapped here)."""
    if len(addresses) != len(geometry.regions):
        raise ValueError(f"{len(addresses)} addresses for {len(geometry.regions)} regions")
    regions = tuple(dataclasses.replace(r, address=int(a)) for r, a in zip(geometry.regions, addresses))
    return dataclasses.replace(geometry, regions=regions)


def copy_runs(plan: TransformPlan, first_run: int, end_run: int, *, memory: MemoryKind, device: int = 0,
              stream: int = 0) -> None:
    """Copy runs [first_run, end_run) of ``plan`` with one ``transform_copy`` call."""
    seg = plan.segment_range(first_run, end_run)
    if seg.start == seg.stop:
        return
    native.transform_copy(plan.src_addr[seg], plan.dst_addr[seg], plan.tokens[seg], heads=plan.heads,
                          unit_bytes=plan.dst.unit_bytes,
                          src_strides=(plan.src.token_stride, plan.src.head_stride),
                          dst_strides=(plan.dst.token_stride, plan.dst.head_stride),
                          memory=memory, device=device, stream=stream)
