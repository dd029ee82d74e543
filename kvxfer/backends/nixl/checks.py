"""Row integrity on the NIXL backend (``kvxfer.backends.common.integrity``): which digests a
finished job's record carries, and the pull fetcher's check of the rows it READ.

Between engine geometries (push only): the publisher sums each destination row's digest from
the source segments of each chunk it posted (``plan_digest``), and the fetcher checks its
blocks with its own plan; a pull between geometries is not checked (``integrity`` says why).

Push: the publisher digests the rows it WROTE (host memory, pool rows), each chunk's just after
posting it, so the digest runs while the WRITE moves (the rows are pinned; both only read them),
and sends them in its completion record; the fetcher checks its rows when the record comes
(``conclude_from_record`` and ``conclude_packed``), so a packed wait no longer concludes before
the record when integrity is on. A packed fetcher digests each chunk's rows as it scatters them
(``receiver.py``, ``RowCheck.sum_landed``), so that only the comparison waits for the record. Pull: the publisher digested its rows in describe() (``Hint.extras``); the fetcher
checks each chunk it READ as soon as NIXL says it is DONE, while the later READs move
(``check_chunks_read``), and before it concludes refuses the rows that failed and tells the
publisher, whose record then marks them False too (``check_read``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from kvxfer.backends.common.integrity import (
    DIGEST_EXTRA,
    U64,
    RowCheck,
    expected_from_hint,
    geometry_digests,
    group_digests,
    no_digests,
    pack_digests,
    peer_masks_from_local,
    refuse,
    region_digests,
)
from kvxfer.backends.common.matching import match_rows
from kvxfer.backends.nixl.jobs import ActiveJob
from kvxfer.contract import BoolArray, IndexArray, TransferMode, View


def describe_extras(check: RowCheck, mode: TransferMode, view: View) -> tuple[tuple[str, bytes], ...]:
    """A pull hint's digests of its rows (committed and pinned while described for reading)."""
    if mode is TransferMode.PULL and check.applies(view):
        return ((DIGEST_EXTRA, pack_digests(group_digests(view))),)
    return ()


def digest_posted(check: RowCheck, job: ActiveJob) -> None:
    """A push publisher digests the rows of the chunks posted since it last did (those posted
    inline at submission included), into ``job.digests`` at their rows of the peer's hint."""
    first, job.digested = job.digested, job.next_chunk
    if job.op != "WRITE" or job.next_chunk <= first:
        return
    transform = getattr(job, "transform", None)
    if transform is not None:  # chunks are consecutive segment ranges: one call for those posted
        if check.applies_geometry(job.view):
            sums = geometry_digests(transform, (job.chunks[first].first, job.chunks[job.next_chunk - 1].end))
            job.digests = [sums if job.digests is None else job.digests[0] + sums]
        return
    if not check.applies(job.view):
        return
    if job.digests is None:
        job.digests = [np.zeros(len(g), dtype=np.uint64) for g in job.hint.groups]
    for chunk in job.chunks[first:job.next_chunk]:
        group = job.view.groups[chunk.group]
        job.digests[chunk.peer_group][chunk.peer_rows] = region_digests(group.region, group.slots[chunk.local_rows])


def record_digests(check: RowCheck, job: ActiveJob) -> list[U64] | None:
    """A push publisher's digests of the rows it wrote, aligned with the peer's hint (zero
    where no chunk went: those rows are False in the record)."""
    if job.op != "WRITE" or not (check.applies(job.view) or check.applies_geometry(job.view)):
        return None
    return job.digests or [np.zeros(len(g), dtype=np.uint64) for g in job.hint.groups]


@dataclass(eq=False)
class ChunksRead:
    """A pull fetcher's check so far: the rows of the chunks it READ that failed their digest."""

    expected: list[U64] | None  # per local group, from the publisher's hint; None: it sent none
    wrong: list[list[IndexArray]] = field(default_factory=list)  # per local group
    checked: int = 0  # job.done[:checked] are checked
    refused: int = 0  # rows counted in the check's rows_failed so far


def check_chunks_read(check: RowCheck, job: ActiveJob) -> None:
    """Check the rows of each chunk a pull fetcher READ since it last did: called on the
    progress thread after each step, so a chunk's digest runs while later chunks move.
    Whether the check applies is asked once per job (``job.read_check`` False: it does not)."""
    if job.op != "READ" or job.read_check is False:
        return
    state = job.read_check
    if state is None:
        if not check.applies(job.view):
            job.read_check = False
            return
        expected = expected_from_hint(match_rows(job.view, job.hint), job.hint)
        state = job.read_check = ChunksRead(expected, [[] for _ in job.view.groups])
    for index in job.done[state.checked:]:
        chunk = job.chunks[index]
        group = job.view.groups[chunk.group]
        slots = group.slots[chunk.local_rows]
        if check.corrupt is not None:
            check.corrupt(group.region, slots)
        if state.expected is not None:
            got = region_digests(group.region, slots)
            wrong = chunk.local_rows[got != state.expected[chunk.group][chunk.local_rows]]
            if wrong.size:
                state.wrong[chunk.group].append(wrong)
    state.checked = len(job.done)


def check_read(check: RowCheck, job: ActiveJob, local: list[BoolArray], peer: list[BoolArray]) -> str | None:
    """A pull fetcher's conclusion of its check (both mask lists changed in place): the rows
    that failed, or every row READ when the publisher sent no digests, are refused. Called
    for a failure concluded while READs were still in flight, and again at the end."""
    check_chunks_read(check, job)
    state = job.read_check
    if not isinstance(state, ChunksRead):  # not a READ, or no check applies
        return None
    landed = sum(int(np.count_nonzero(m)) for m in local)
    if landed == 0:
        return None
    local[:] = [np.array(m, dtype=np.bool_) for m in local]  # job.masks() are read-only
    peer[:] = [np.array(m, dtype=np.bool_) for m in peer]
    if state.expected is None:
        for m in local:
            m[:] = False
        bad: str | None = no_digests(landed)
    else:
        wrong = [np.unique(np.concatenate(w)) if w else np.zeros(0, dtype=np.int64) for w in state.wrong]
        bad = refuse(job.view, local, wrong, landed)
    if bad is not None:
        refused = landed - sum(int(np.count_nonzero(m)) for m in local)
        check.rows_failed += max(0, refused - state.refused)  # an early conclusion counted some
        state.refused = max(state.refused, refused)
        peer_masks_from_local(match_rows(job.view, job.hint), job.hint, local, peer)
    return bad


def checked_masks(check: RowCheck, job: ActiveJob) -> tuple[list[BoolArray], list[BoolArray], str | None]:
    """A job's (local, peer) masks of proven chunks, less the rows a pull fetcher's check
    refused, and why it refused them (None: none was)."""
    local, peer = job.masks()
    return local, peer, check_read(check, job, local, peer)
