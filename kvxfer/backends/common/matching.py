"""Pair local rows with the peer's by (layer group, ordinal), coalesce runs of slots, and
mark the rows a transfer proved (``proven_mask``)."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvxfer.backends.common.regions import RegionTable
from kvxfer.contract import (
    BoolArray,
    Hint,
    HintGroup,
    IndexArray,
    InvalidSubmission,
    LayerGroupRows,
    LayoutMismatch,
    View,
    check_compatible,
    constant_mask,
)


@dataclass(frozen=True, eq=False)
class GroupMatch:
    """Rows of one local group with a counterpart at the peer.

    ``local_rows`` indexes the local group's rows; ``peer_rows`` the peer group's rows;
    ``local_slots`` and ``peer_slots`` are the slots they name, all in local-row order.
    """

    local: LayerGroupRows
    peer: HintGroup | None
    local_rows: IndexArray
    peer_rows: IndexArray
    local_slots: IndexArray
    peer_slots: IndexArray

    @property
    def unmatched(self) -> IndexArray:
        """Local rows with no counterpart at the peer."""
        mask = np.ones(len(self.local), dtype=np.bool_)
        mask[self.local_rows] = False
        return np.flatnonzero(mask).astype(np.int64)


def check_submission(view: View, hint: Hint, regions: RegionTable, backend: str, mode: object,
                     *, fetching: bool) -> None:
    """Every backend's checks before a fetch/publish touches anything: InvalidSubmission if the
    hint is not a Hint, the view's rows are not ours, the ends disagree, or the requests differ."""
    if not isinstance(hint, Hint):
        raise InvalidSubmission(f"expected a Hint, got {type(hint).__name__}")
    regions.check_view(view, for_fetch=fetching)
    check_agreement(view, hint, backend, mode)
    if hint.request != view.request:
        raise InvalidSubmission(f"hint is for request {hint.request!r}, the view for {view.request!r}")
    if view.geometry is not None and hint.geometry is not None:
        local, peer = view.geometry, hint.geometry
        src, dst = (peer, local) if fetching else (local, peer)
        if not (src.heads[0] <= dst.heads[0] and dst.heads[1] <= src.heads[1]):
            raise LayoutMismatch(
                f"the fetching end holds heads [{dst.heads[0]}, {dst.heads[1]}) but the publishing end only "
                f"[{src.heads[0]}, {src.heads[1]}): narrow the fetching view to heads the publisher holds")


def check_agreement(view: View, hint: Hint, backend: str, mode: object) -> None:
    """Refuse a hint of another backend kind, mode, layout, request or row format."""
    if hint.backend != backend:
        raise InvalidSubmission(f"hint is for backend {hint.backend!r}, this is {backend!r}")
    if hint.mode != mode:
        raise InvalidSubmission(f"hint is for {hint.mode.value} mode, this backend runs {getattr(mode, 'value', mode)}")
    if (hint.geometry is None) != (view.geometry is None):
        ours, theirs = ("an engine's KV (a geometry)", "a pool's rows") if view.geometry else (
            "a pool's rows", "an engine's KV (a geometry)")
        raise LayoutMismatch(f"this view lends {ours}, the peer's hint describes {theirs}: both ends must be one kind")
    if view.geometry is not None and hint.geometry is not None:
        check_compatible(view.geometry, hint.geometry)
    if hint.layout != view.layout:
        raise InvalidSubmission(
            f"layout mismatch: peer {hint.layout.hex()[:16] or '(none)'} vs local {view.layout.hex()[:16] or '(none)'}"
        )
    for group in view.groups:
        peer = hint.group(group.layer_group)
        if view.geometry is not None:
            continue  # rows of two geometries differ in size by design: the transform plan pairs them
        if peer is not None and peer.slot_bytes != group.region.slot_bytes:
            raise InvalidSubmission(
                f"group {group.layer_group!r}: peer rows are {peer.slot_bytes} bytes, local rows {group.region.slot_bytes}"
            )
        if peer is not None and peer.kind != group.kind:
            raise InvalidSubmission(f"group {group.layer_group!r}: peer kind {peer.kind.name}, local {group.kind.name}")


@functools.lru_cache(maxsize=16)
def positions(n: int) -> IndexArray:
    """0..n-1, read-only and shared: requests of one size repeat, and allocating it per
    submission costs as much as the rest of a large submission's matching."""
    rows = np.arange(n, dtype=np.int64)
    rows.flags.writeable = False
    return rows


def match_rows(view: View, hint: Hint) -> list[GroupMatch]:
    """One GroupMatch per view group, aligned with ``view.groups``. Arrays are read-only."""
    matches = []
    empty = positions(0)
    for group in view.groups:
        peer = hint.group(group.layer_group)
        if peer is None or len(peer) == 0 or len(group) == 0:
            matches.append(GroupMatch(group, peer, empty, empty, empty, empty))
            continue
        # HintGroup and RegionTable.check_view already refused repeated ordinals on both ends.
        if len(group) == len(peer) and (
                (group.ordinals_are_positions and peer.ordinals_are_positions)  # known: O(1)
                or _same(group.ordinals, peer.ordinals)):
            # Row i pairs with row i (a whole request, usually): the slots as they are.
            rows = positions(len(group))
            matches.append(GroupMatch(group, peer, rows, rows, group.slots, peer.slots))
            continue
        local_rows, peer_rows = _pair_ordinals(group.ordinals, peer.ordinals)
        arrays = (local_rows, peer_rows, group.slots[local_rows], peer.slots[peer_rows])
        for array in arrays:
            array.flags.writeable = False
        matches.append(GroupMatch(group, peer, *arrays))
    return matches


def _same(a: IndexArray, b: IndexArray) -> bool:
    if a.size <= 128:  # a small request: comparing bytes beats numpy's per-call overhead
        return a.shape == b.shape and a.tobytes() == b.tobytes()
    return bool(np.array_equal(a, b))


def _pair_ordinals(local: IndexArray, peer: IndexArray) -> tuple[IndexArray, IndexArray]:
    """Indices (into local, into peer) of equal ordinals, in local order. Both sides distinct."""
    if local.size == peer.size and np.array_equal(local, peer):
        same = positions(local.size)
        return same, same
    low = min(int(local.min()), int(peer.min()))
    span = max(int(local.max()), int(peer.max())) - low + 1
    if span <= 4 * (local.size + peer.size) + 4096:
        # Dense ordinals (the usual token blocks): a lookup table, linear time.
        table = np.full(span, -1, dtype=np.int64)
        table[peer - low] = np.arange(peer.size, dtype=np.int64)
        at = table[local - low]
        local_rows = np.flatnonzero(at >= 0).astype(np.int64)
        return local_rows, at[local_rows]
    order = np.argsort(peer, kind="stable")
    sorted_ordinals = peer[order]
    pos = np.minimum(np.searchsorted(sorted_ordinals, local), sorted_ordinals.size - 1)
    found = sorted_ordinals[pos] == local
    return np.flatnonzero(found).astype(np.int64), order[pos[found]].astype(np.int64)


def coalesce(src: IndexArray, dst: IndexArray) -> tuple[IndexArray, IndexArray, IndexArray]:
    """Split paired slot lists into runs contiguous on both ends.

    Returns (src_start, dst_start, length) arrays; rows keep their given order.
    """
    n = src.size
    if n == 0:
        return (np.zeros(0, np.int64),) * 3  # type: ignore[return-value]
    breaks = np.flatnonzero((np.diff(src) != 1) | (np.diff(dst) != 1)) + 1
    starts = np.concatenate(([0], breaks)).astype(np.int64)
    lengths = np.diff(np.concatenate((starts, [n]))).astype(np.int64)
    return src[starts], dst[starts], lengths


def proven_mask(size: int, parts: Sequence[IndexArray]) -> BoolArray:
    """The proof rule for pool rows: a row is one unit whose bytes move together, True once the
    chunk or copy that carries it completed. ``parts``: the distinct rows (indices into a group
    of ``size`` rows) of the completed chunks or copies. Read-only; a group proven whole gets
    the shared all-True mask (``constant_mask``): nothing to fill, and the wire codec sends it
    without packing its bits. Between engine geometries the rule is ``TransformPlan.masks``."""
    if sum(int(rows.size) for rows in parts) == size:
        return constant_mask(size, True)
    mask = np.zeros(size, dtype=np.bool_)
    for rows in parts:
        mask[rows] = True
    mask.flags.writeable = False
    return mask
