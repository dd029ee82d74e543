"""Pair local rows with the peer's by (layer group, ordinal), and coalesce runs of slots."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvxfer.contract import Hint, HintGroup, IndexArray, InvalidSubmission, LayerGroupRows, View


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


def check_agreement(view: View, hint: Hint, backend: str, mode: object) -> None:
    """Refuse a hint of another backend kind, mode, layout, request or row format."""
    if hint.backend != backend:
        raise InvalidSubmission(f"hint is for backend {hint.backend!r}, this is {backend!r}")
    if hint.mode != mode:
        raise InvalidSubmission(f"hint is for {hint.mode.value} mode, this backend runs {getattr(mode, 'value', mode)}")
    if hint.layout != view.layout:
        raise InvalidSubmission(
            f"layout mismatch: peer {hint.layout.hex()[:16] or '(none)'} vs local {view.layout.hex()[:16] or '(none)'}"
        )
    for group in view.groups:
        peer = hint.group(group.layer_group)
        if peer is not None and peer.slot_bytes != group.region.slot_bytes:
            raise InvalidSubmission(
                f"group {group.layer_group!r}: peer rows are {peer.slot_bytes} bytes, local rows {group.region.slot_bytes}"
            )
        if peer is not None and peer.kind != group.kind:
            raise InvalidSubmission(f"group {group.layer_group!r}: peer kind {peer.kind.name}, local {group.kind.name}")


def match_rows(view: View, hint: Hint) -> list[GroupMatch]:
    """One GroupMatch per view group, aligned with ``view.groups``."""
    matches = []
    empty = np.zeros(0, dtype=np.int64)
    for group in view.groups:
        peer = hint.group(group.layer_group)
        if peer is None or len(peer) == 0 or len(group) == 0:
            matches.append(GroupMatch(group, peer, empty, empty, empty, empty))
            continue
        if np.unique(peer.ordinals).size != len(peer):
            raise InvalidSubmission(f"peer's group {group.layer_group!r} repeats an ordinal")
        order = np.argsort(peer.ordinals, kind="stable")
        sorted_ordinals = peer.ordinals[order]
        pos = np.searchsorted(sorted_ordinals, group.ordinals)
        pos_clipped = np.minimum(pos, sorted_ordinals.size - 1)
        found = sorted_ordinals[pos_clipped] == group.ordinals
        local_rows = np.flatnonzero(found).astype(np.int64)
        peer_rows = order[pos_clipped[found]].astype(np.int64)
        matches.append(
            GroupMatch(group, peer, local_rows, peer_rows, group.slots[local_rows], peer.slots[peer_rows])
        )
    return matches


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
