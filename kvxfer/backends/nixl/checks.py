"""Row integrity on the NIXL backend (``kvxfer.backends.common.integrity``): which digests a
finished job's record carries, and the pull fetcher's check of the rows it READ.

Push: the publisher digests the rows it WROTE (host memory, pool rows) and sends them in its
completion record; the fetcher checks its rows when the record comes (``conclude_from_record``
and ``conclude_packed``), so a packed wait no longer concludes before the record when integrity
is on. Pull: the publisher digested its rows in describe() (``Hint.extras``); the fetcher
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
    group_digests,
    pack_digests,
    peer_masks_from_local,
    sent_digests,
)
from kvxfer.backends.common.matching import match_rows
from kvxfer.backends.nixl.jobs import ActiveJob
from kvxfer.contract import BoolArray, TransferMode, View


def describe_extras(check: RowCheck, mode: TransferMode, view: View) -> tuple[tuple[str, bytes], ...]:
    """A pull hint's digests of its rows (committed and pinned while described for reading)."""
    if mode is TransferMode.PULL and check.applies(view):
        return ((DIGEST_EXTRA, pack_digests(group_digests(view))),)
    return ()


def record_digests(check: RowCheck, job: ActiveJob) -> list[U64] | None:
    """A push publisher's digests of the rows it wrote, aligned with the peer's hint."""
    if job.op != "WRITE" or not check.applies(job.view):
        return None
    matches = match_rows(job.view, job.hint)
    return sent_digests(matches, job.hint, [int(m.local_rows.size) for m in matches])


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
