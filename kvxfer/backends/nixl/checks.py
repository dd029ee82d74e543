"""Row integrity on the NIXL backend (``kvxfer.backends.common.integrity``): which digests a
finished job's record carries, and the pull fetcher's check of the rows it READ.

Between engine geometries (push only): the publisher sums each destination row's digest from
the source segments of each chunk it posted (``plan_digest``), and the fetcher checks its
blocks with its own plan; a pull between geometries is not checked (``integrity`` says why).

Push: the publisher digests the rows it WROTE (host memory, pool rows), each chunk's just after
posting it, so the digest runs while the WRITE moves (the rows are pinned; both only read them),
and sends them in its completion record; the fetcher checks its rows when the record comes
(``conclude_from_record`` and ``conclude_packed``), so a packed wait no longer concludes before
the record when integrity is on. Pull: the publisher digested its rows in describe() (``Hint.extras``); the fetcher
checks what it READ before it concludes and tells the publisher, whose record then marks the
failed rows False too.
"""

from __future__ import annotations

import numpy as np

from kvxfer.backends.common.integrity import (
    DIGEST_EXTRA,
    U64,
    RowCheck,
    expected_from_hint,
    geometry_digests,
    group_digests,
    pack_digests,
    peer_masks_from_local,
    row_digests,
)
from kvxfer.backends.common.matching import match_rows
from kvxfer.backends.nixl.jobs import ActiveJob
from kvxfer.contract import BoolArray, TransferMode, View


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
        job.digests[chunk.peer_group][chunk.peer_rows] = row_digests(
            group.region.address, group.region.slot_bytes, group.slots[chunk.local_rows])


def record_digests(check: RowCheck, job: ActiveJob) -> list[U64] | None:
    """A push publisher's digests of the rows it wrote, aligned with the peer's hint (zero
    where no chunk went: those rows are False in the record)."""
    if job.op != "WRITE" or not (check.applies(job.view) or check.applies_geometry(job.view)):
        return None
    return job.digests or [np.zeros(len(g), dtype=np.uint64) for g in job.hint.groups]


def check_read(check: RowCheck, job: ActiveJob, local: list[BoolArray], peer: list[BoolArray]) -> str | None:
    """A pull fetcher's check of the rows it READ (both mask lists changed in place)."""
    if job.op != "READ" or not check.applies(job.view):
        return None
    local[:] = [np.array(m, dtype=np.bool_) for m in local]  # job.masks() are read-only
    peer[:] = [np.array(m, dtype=np.bool_) for m in peer]
    matches = match_rows(job.view, job.hint)
    bad = check.check(job.view, local, expected_from_hint(matches, job.hint))
    if bad is not None:
        peer_masks_from_local(matches, job.hint, local, peer)
    return bad
