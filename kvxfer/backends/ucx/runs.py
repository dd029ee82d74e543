"""The runs a ucx transfer moves, numbered the same way at both ends.

Each end matches its view with the peer's hint (``match_rows``), then both order the
matched rows the same way: by layer group name, then by ordinal. A run is a stretch of that
order whose slots are consecutive at both ends, so it travels as one tag message, straight
from the sender's rows into the receiver's. Run ``i`` of one end is run ``i`` of the other,
which is how a message's tag names its rows without a header.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvxfer.backends.common.matching import GroupMatch, proven_mask
from kvxfer.contract import BoolArray, Hint, IndexArray, InvalidSubmission, MemoryKind, View

MAX_RUN_ROWS = 1 << 16  # a longer stretch goes as several runs: a receive is posted only once its message came
PACK_BYTES = 4 << 20  # a pack_bytes to try: host runs up to a quarter of it travel packed, this many bytes a message


@dataclass(frozen=True, eq=False)
class RunPlan:
    """Runs in their shared order: per run its groups at both ends, first local slot, rows and
    row size; ``local_rows``/``peer_rows`` list the rows of every run back to back (indices
    into their group), ``starts`` where each run begins in them."""

    local_group: IndexArray   # view group of each run
    peer_group: IndexArray    # hint group of each run
    local_slot: IndexArray    # first local slot
    lengths: IndexArray       # rows
    row_bytes: IndexArray     # bytes per row
    starts: IndexArray        # offsets into local_rows / peer_rows, one past the end last
    local_rows: IndexArray    # row indices into their view group, run after run
    peer_rows: IndexArray     # row indices into their hint group, run after run
    chunk_end: IndexArray     # at the first run of a message: one past its last run; elsewhere -1

    @property
    def runs(self) -> int:
        return int(self.lengths.size)

    @property
    def rows(self) -> int:
        return int(self.lengths.sum())

    def nbytes(self, run: int) -> int:
        return int(self.lengths[run] * self.row_bytes[run])

    def local_masks(self, view: View, counts: IndexArray) -> list[BoolArray]:
        """Masks over the view's groups, read-only: True for the first ``counts[i]`` rows of each
        run ``i`` (a row is proven once its message was received: ``proven_mask``)."""
        return _masks([len(g) for g in view.groups], self, counts, self.local_group, self.local_rows)

    def peer_masks(self, hint: Hint, counts: IndexArray) -> list[BoolArray]:
        """The same rows, as masks over the peer's hint groups (what its records carry)."""
        return _masks([len(g) for g in hint.groups], self, counts, self.peer_group, self.peer_rows)

    def limited(self, rows: int | None) -> IndexArray:
        """Rows to send of each run when only the first ``rows`` rows may go (a fault injected
        after them): whole runs, then part of one, then none."""
        if rows is None:
            return self.lengths.copy()
        return np.clip(rows - self.starts[:-1], 0, self.lengths).astype(np.int64)


    def rows_per_run(self, view: View, masks: list[BoolArray]) -> IndexArray:
        """How many rows of each run are True in ``masks`` (masks over the view's groups)."""
        if not self.runs:
            return np.zeros(0, np.int64)
        rows_true = np.concatenate([np.asarray(m, dtype=np.bool_) for m in masks])
        offsets = np.cumsum([0] + [len(g) for g in view.groups])[:-1]
        flat = offsets[np.repeat(self.local_group, self.lengths)] + self.local_rows
        return np.add.reduceat(rows_true[flat].astype(np.int64), self.starts[:-1]).astype(np.int64)


def _masks(sizes: list[int], plan: RunPlan, counts: IndexArray, groups: IndexArray,
           rows: IndexArray) -> list[BoolArray]:
    if not plan.runs:
        return [proven_mask(n, []) for n in sizes]
    within = np.arange(plan.rows, dtype=np.int64) - np.repeat(plan.starts[:-1], plan.lengths)
    take = within < np.repeat(counts, plan.lengths)
    row_groups = np.repeat(groups, plan.lengths)[take]
    chosen = rows[take]
    return [proven_mask(n, [chosen[row_groups == g]]) for g, n in enumerate(sizes)]


def plan_runs(view: View, hint: Hint, matches: list[GroupMatch], *, pack_bytes: int = 0,
              max_runs: int | None = None) -> RunPlan:
    """The runs of a transfer between ``view`` (this end) and ``hint`` (the peer), numbered as
    the peer numbers them, grouped into messages of about ``pack_bytes`` (0: a message per
    run). Sending or receiving, both ends get the same runs: both order by (layer group,
    ordinal). InvalidSubmission past ``max_runs`` runs
    (a ucx message's tag numbers its run in a few bits)."""
    peer_index = {g.layer_group: i for i, g in enumerate(hint.groups)}
    parts: list[tuple[str, int, int, IndexArray, IndexArray, IndexArray, IndexArray, int]] = []
    for gi, match in enumerate(matches):
        if match.peer is None or match.local_rows.size == 0:
            continue
        ordinals = match.local.ordinals[match.local_rows]
        order = np.argsort(ordinals, kind="stable")
        parts.append((match.local.layer_group, gi, peer_index[match.peer.layer_group], match.local_rows[order],
                      match.peer_rows[order], match.local_slots[order], match.peer_slots[order],
                      match.local.region.slot_bytes))
    parts.sort(key=lambda p: p[0])
    cols: dict[str, list[IndexArray]] = {k: [] for k in ("lg", "pg", "ls", "len", "rb", "lr", "pr")}
    for _, gi, pgi, lrows, prows, lslots, pslots, row_bytes in parts:
        n = lslots.size
        brk = np.ones(n, dtype=np.bool_)
        brk[1:] = (np.diff(lslots) != 1) | (np.diff(pslots) != 1)
        index = np.arange(n, dtype=np.int64)
        brk |= (index - np.maximum.accumulate(np.where(brk, index, 0))) % MAX_RUN_ROWS == 0
        first = np.flatnonzero(brk).astype(np.int64)
        lengths = np.diff(np.append(first, n)).astype(np.int64)
        cols["lg"].append(np.full(first.size, gi, np.int64))
        cols["pg"].append(np.full(first.size, pgi, np.int64))
        cols["ls"].append(lslots[first].astype(np.int64))
        cols["len"].append(lengths)
        cols["rb"].append(np.full(first.size, row_bytes, np.int64))
        cols["lr"].append(lrows.astype(np.int64))
        cols["pr"].append(prows.astype(np.int64))
    cat = {k: (np.concatenate(v) if v else np.zeros(0, np.int64)) for k, v in cols.items()}
    starts = np.concatenate([[0], np.cumsum(cat["len"])]).astype(np.int64)
    host = np.array([m.local.region.memory_kind is MemoryKind.HOST and m.peer is not None
                     and m.peer.memory_kind is MemoryKind.HOST for m in matches] + [False], dtype=np.bool_)
    packable_runs = host[cat["lg"]]
    if max_runs is not None and cat["len"].size > max_runs:
        raise InvalidSubmission(f"the transfer has {cat['len'].size} runs of contiguous rows; the ucx backend "
                                f"numbers at most {max_runs} per transfer: split the request")
    return RunPlan(cat["lg"], cat["pg"], cat["ls"], cat["len"], cat["rb"], starts, cat["lr"], cat["pr"],
                   _chunk_ends(cat["len"] * cat["rb"], packable_runs, pack_bytes))


def _chunk_ends(nbytes: IndexArray, packable: BoolArray, pack_bytes: int) -> IndexArray:
    """Group small host runs into messages of about ``pack_bytes`` (one rendezvous each
    instead of one per run); every other run is a message of its own, sent from and received
    into the rows themselves. Both ends compute the same grouping: the fetcher's hint says
    which ``pack_bytes`` it expects."""
    runs = nbytes.size
    small = packable & (nbytes <= pack_bytes // 4)
    key = np.where(small, (np.cumsum(nbytes) - nbytes) // max(pack_bytes, 1), -1 - np.arange(runs))
    first = np.ones(runs, dtype=np.bool_)
    first[1:] = (key[1:] != key[:-1]) | ~small[1:] | ~small[:-1]
    starts = np.flatnonzero(first)
    ends = np.full(runs, -1, dtype=np.int64)
    ends[starts] = np.append(starts[1:], runs)
    return ends
