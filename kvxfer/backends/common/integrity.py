"""End-to-end row integrity: a digest of each row's bytes, taken where they were read for
sending and checked where they landed.

The digest of a row of ``n`` bytes: pad the bytes with zeros to a whole number ``m`` of
8-byte words, read them as little-endian uint64 ``x_0 .. x_{m-1}``, and take, modulo 2**64,

    D = sum_i (1 + K * (m - i)) * x_i  =  A + K * B,   A = sum_i x_i,  B = sum_i (m - i) * x_i

with ``K = DIGEST_K`` (an even constant). Every weight ``1 + K * (m - i)`` is odd, so a change
confined to one word (any single bit flip among them) always changes D; words moved to other
places within the row (a reversed row, pages swapped) change it unless the weights happen to
cancel. ``B`` is Fletcher's running sum of running sums (``a += x; b += a``), so a copy loop or
a GPU kernel can compute D with additions as it reads, and a reduction over words in any order
gives the same value: that is what lets the IPC kernel compute it later, fused in its copy.
Here the compiled host core computes it (``kvxfer.native.row_digests``: each row read where it
lies, eight Fletcher chains in vector registers, the GIL released), once at the reading end
and once over the destination rows where they landed; without the compiled module, numpy
(``numpy_row_digests``: ``rows @ weights``, no Python per row), which stays the definition the
tests check the native one against.

A digest is an integrity check, not an authenticity check: anyone who can write the rows can
write a matching digest. The completion record's HMAC (``KVXFER_HINT_KEY``) is what says who
sent the digests.

Engine geometries (TP and layout transforms): a destination row is a block of the fetcher's
layout, not the source row's bytes, so its digest is defined over its canonical bytes (the
units its view asks for, in (plane, token, head) order; ``plan_digest``). A push publisher sums
it from the segments it reads, with no row assembled; the fetcher from the segments where they
landed, with its own plan. A pull between geometries carries no digest and is not checked:
the publisher's hint is made before it knows the fetcher's layout, and a destination row's
digest depends on it.

Where digests travel: in the completion record (``CompletionRecord.digests``, one uint64
array per mask) from the end that read the source rows; in pull mode, where the fetcher reads
them itself, in the publisher's hint (``Hint.extras`` under ``DIGEST_EXTRA``, digested at
describe(), when its rows are committed and pinned); in a store, under a second key per row
(the blob backend).
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable, Sequence

import numpy as np
import numpy.typing as npt

from kvxfer import native
from kvxfer.backends.common import plan_digest
from kvxfer.backends.common.matching import GroupMatch
from kvxfer.backends.common.transform import Oriented
from kvxfer.contract import (
    BoolArray,
    Cancelled,
    CompletionRecord,
    Delivered,
    Failed,
    Hint,
    IndexArray,
    MemoryKind,
    Outcome,
    SlotRegion,
    View,
)

U64 = npt.NDArray[np.uint64]
DIGEST_K = 0x3C6EF372FE94F82A  # 2 * 0x9E3779B97F4A7C15 mod 2**64: even, so every weight is odd
DIGEST_EXTRA = "kvxfer.digests"  # Hint.extras key: a pull publisher's row digests
MISMATCH = "digest mismatch"  # how a failed outcome's reason starts when rows failed their check
_GATHER_BYTES = 8 << 20  # rows gathered per numpy call when they are scattered

CorruptFn = Callable[[SlotRegion, IndexArray], None]
"""Test hook (fault injection): called with a region and the slots of rows that just landed
in it, after the copy and before the check; it may change their bytes."""


@functools.lru_cache(maxsize=16)
def _weights(words: int) -> U64:
    w = np.uint64(1) + np.uint64(DIGEST_K) * np.arange(words, 0, -1, dtype=np.uint64)
    w.flags.writeable = False
    return w


def row_digests(address: int, row_bytes: int, slots: IndexArray) -> U64:
    """The digest of each row ``address + slots[i] * row_bytes`` (host memory), as uint64."""
    slots = np.ascontiguousarray(slots, dtype=np.int64)
    if native.info().digest:
        return native.row_digests(base=address, stride=row_bytes, slots=slots, row_bytes=row_bytes, k=DIGEST_K)
    return numpy_row_digests(address, row_bytes, slots)


def region_digests(region: SlotRegion, slots: IndexArray) -> U64:
    """The digest of each row ``slots[i]`` of ``region``: host memory read where it lies, device
    memory by a kernel of its own (``native.device_row_digests``; ``RowCheck.applies`` says
    where that runs)."""
    if region.memory_kind is MemoryKind.DEVICE:
        return native.device_row_digests(base=region.address, stride=region.slot_bytes,
                                         slots=np.ascontiguousarray(slots, dtype=np.int64),
                                         row_bytes=region.slot_bytes, k=DIGEST_K, device=region.device_id)
    return row_digests(region.address, region.slot_bytes, slots)


def numpy_row_digests(address: int, row_bytes: int, slots: IndexArray) -> U64:
    """``row_digests`` in numpy: the fallback without the compiled module, and the reference."""
    slots = np.asarray(slots, dtype=np.int64)
    out = np.zeros(slots.size, dtype=np.uint64)
    if slots.size == 0:
        return out
    span = (int(slots.max()) + 1) * row_bytes
    if row_bytes % 8 or address % 8:
        return _digests_unaligned(address, row_bytes, slots, span)
    words = row_bytes // 8
    rows = np.ctypeslib.as_array(ctypes.cast(address, ctypes.POINTER(ctypes.c_uint64)), shape=(span // 8,))
    rows = rows.reshape(-1, words)
    weights = _weights(words)
    starts = np.flatnonzero(np.diff(slots, prepend=slots[0] - 2) != 1)
    if starts.size * 16 <= slots.size:  # mostly runs: numpy reads them in place, a call per run
        ends = np.append(starts[1:], slots.size)
        for b, e in zip(starts.tolist(), ends.tolist()):
            s = int(slots[b])
            np.matmul(rows[s:s + e - b], weights, out=out[b:e])
        return out
    step = max(1, _GATHER_BYTES // row_bytes)
    for b in range(0, slots.size, step):
        np.matmul(rows[slots[b:b + step]], weights, out=out[b:b + step])
    return out


def _digests_unaligned(address: int, row_bytes: int, slots: IndexArray, span: int) -> U64:
    raw = np.ctypeslib.as_array(ctypes.cast(address, ctypes.POINTER(ctypes.c_uint8)), shape=(span,))
    words = (row_bytes + 7) // 8
    padded = np.zeros((slots.size, words * 8), dtype=np.uint8)
    padded[:, :row_bytes] = raw.reshape(-1, row_bytes)[slots]
    return padded.view("<u8").astype(np.uint64, copy=False) @ _weights(words)


def group_digests(view: View) -> list[U64]:
    """The digest of every row of ``view``, one array per group (host memory)."""
    return [region_digests(g.region, g.slots) for g in view.groups]


def pack_digests(digests: Sequence[U64]) -> bytes:
    return b"".join(np.ascontiguousarray(d, dtype="<u8").tobytes() for d in digests)


def unpack_digests(data: bytes | None, lengths: Sequence[int]) -> list[U64] | None:
    """The per-group digests ``pack_digests`` made, or None when ``data`` is absent or does not
    fit ``lengths`` (then no row can be checked)."""
    if data is None or len(data) != 8 * sum(lengths):
        return None
    flat = np.frombuffer(data, dtype="<u8").astype(np.uint64)
    cuts = np.cumsum(lengths)[:-1] if lengths else []
    return list(np.split(flat, cuts))


def check_landed(view: View, masks: list[BoolArray], digests: Sequence[U64] | None,
                 corrupt: CorruptFn | None = None) -> str | None:
    """Check the rows ``masks`` marks as landed in ``view`` against ``digests`` (aligned with
    the view's groups; None: the sender sent none). A row that fails, or has no digest to
    check, becomes False in ``masks`` (changed in place). Returns the reason to fail the
    outcome with (starting with ``MISMATCH`` or naming the missing digests), or None when
    every landed row checked out."""
    if corrupt is not None:
        for g, mask in zip(view.groups, masks):
            if mask.any():
                corrupt(g.region, g.slots[mask])
    groups = view.groups
    return _compare(masks, digests, view, lambda i, rows: region_digests(groups[i].region, groups[i].slots[rows]))


def check_summed(view: View, masks: list[BoolArray], digests: Sequence[U64] | None,
                 sums: Sequence[U64]) -> str | None:
    """``check_landed`` when this end took the digests of the landed rows as it placed them
    (``sums``, aligned with the view's groups, the corrupt hook applied before): only the
    comparison is left, no row is read again."""
    return _compare(masks, digests, view, lambda i, rows: np.asarray(sums[i])[rows])


def _compare(masks: list[BoolArray], digests: Sequence[U64] | None, view: View,
             got: Callable[[int, IndexArray], U64]) -> str | None:
    """The landed rows' digests (``got(group index, rows)``) against ``digests``: ``check_landed``."""
    landed = sum(int(m.sum()) for m in masks)
    if landed == 0:
        return None
    if digests is None or len(digests) != len(masks):
        for m in masks:
            m[:] = False
        return no_digests(landed)
    wrong = []
    for i, (mask, expected) in enumerate(zip(masks, digests)):
        rows = np.flatnonzero(mask)
        wrong.append(rows[got(i, rows) != np.asarray(expected)[rows]] if rows.size else rows)
    return refuse(view, masks, wrong, landed)


def no_digests(landed: int) -> str:
    """Why ``landed`` rows are refused when no digests came with them."""
    return (f"{MISMATCH}: {landed} rows came without a digest to check them against "
            "(is integrity off at the end that read them?)")


def refuse(view: View, masks: list[BoolArray], wrong: Sequence[IndexArray], landed: int) -> str | None:
    """Make the rows ``wrong[g]`` of each group False in ``masks`` (in place): those that failed
    their check among ``landed`` rows. Returns the reason naming them, or None when none did."""
    bad: list[str] = []
    total = 0
    for g, mask, rows in zip(view.groups, masks, wrong):
        if rows.size:
            mask[rows] = False
            total += int(rows.size)
            shown = ", ".join(str(r) for r in rows[:8].tolist()) + (", ..." if rows.size > 8 else "")
            bad.append(f"group {g.layer_group!r} rows [{shown}]")
    if not bad:
        return None
    return f"{MISMATCH}: {total} of {landed} rows landed with other bytes than were sent ({'; '.join(bad)})"


def check_landed_geometry(transform: Oriented, view: View, masks: list[BoolArray], digests: Sequence[U64] | None,
                          corrupt: CorruptFn | None = None) -> str | None:
    """``check_landed`` for a geometry view (the plan's destination, ``masks``: one over its
    rows): the digest of each landed row's canonical bytes, summed from the plan's segments
    where they landed, against ``digests[0]`` (the publisher's, aligned with the view's rows)."""
    mask = masks[0]
    rows = np.flatnonzero(mask)
    if corrupt is not None and rows.size:
        plan_digest.corrupt_rows(corrupt, view, rows)
    if rows.size == 0:
        return None
    if digests is None or len(digests) != 1 or np.asarray(digests[0]).size != mask.size:
        mask[:] = False
        return (f"{MISMATCH}: {rows.size} rows came without a digest to check them against "
                "(is integrity off at the end that read them?)")
    plan = transform.plan
    got = plan_digest.row_digests(plan, plan_digest.segments_of_rows(plan, mask), at_source=False, k=DIGEST_K)
    wrong = rows[got[rows] != np.asarray(digests[0], dtype=np.uint64)[rows]]
    if wrong.size == 0:
        return None
    mask[wrong] = False
    shown = ", ".join(str(r) for r in wrong[:8].tolist()) + (", ..." if wrong.size > 8 else "")
    return (f"{MISMATCH}: {wrong.size} of {rows.size} rows landed with other bytes than were sent "
            f"(group {view.groups[0].layer_group!r} rows [{shown}], digests of their blocks' KV in this layout)")


def geometry_digests(transform: Oriented, segments: int | tuple[int, int]) -> U64:
    """A push publisher's digest of each destination row (aligned with the fetcher's hint rows),
    from the source segments [0, segments) or [first, end) it read."""
    first, end = (0, segments) if isinstance(segments, int) else segments
    return plan_digest.row_digests(transform.plan, np.arange(first, end, dtype=np.int64), at_source=True,
                                   k=DIGEST_K)


def sent_digests(matches: Sequence[GroupMatch], hint: Hint, moved: Sequence[int]) -> list[U64]:
    """The record's digests from the reading end: the digest of each local row it sent
    (``moved[i]`` rows of ``matches[i]``, in order), placed at its row of the peer's hint."""
    out = [np.zeros(len(g), dtype=np.uint64) for g in hint.groups]
    index = {g.layer_group: i for i, g in enumerate(hint.groups)}
    for match, n in zip(matches, moved):
        if match.peer is None or n <= 0:
            continue
        out[index[match.peer.layer_group]][match.peer_rows[:n]] = region_digests(match.local.region,
                                                                                 match.local_slots[:n])
    return out


def expected_from_hint(matches: Sequence[GroupMatch], hint: Hint) -> list[U64] | None:
    """A pull fetcher's expected digests per local row, from the publisher's hint (None when
    the hint carries none)."""
    published = unpack_digests(hint.extra(DIGEST_EXTRA), [len(g) for g in hint.groups])
    if published is None:
        return None
    index = {g.layer_group: i for i, g in enumerate(hint.groups)}
    out = []
    for match in matches:
        mine = np.zeros(len(match.local), dtype=np.uint64)
        if match.peer is not None:
            mine[match.local_rows] = published[index[match.peer.layer_group]][match.peer_rows]
        out.append(mine)
    return out


def peer_masks_from_local(matches: Sequence[GroupMatch], hint: Hint, local: Sequence[BoolArray],
                          peer: list[BoolArray]) -> None:
    """Make the peer-aligned masks agree with the local ones after a check dropped rows."""
    index = {g.layer_group: i for i, g in enumerate(hint.groups)}
    for gi, match in enumerate(matches):
        if match.peer is not None:
            peer[index[match.peer.layer_group]][match.peer_rows] &= local[gi][match.local_rows]


class RowCheck:
    """One backend's integrity setting, its fault hook, and the rows it refused.

    ``enabled``: the reading end sends digests and the fetching end checks them (on by
    default; off for those who measure the transport alone). ``rows_failed``: rows this
    backend marked False because their bytes failed the check or came with no digest; only
    its progress thread adds to it."""

    def __init__(self, enabled: bool = True, corrupt: CorruptFn | None = None) -> None:
        self.enabled = bool(enabled)
        self.corrupt = corrupt
        self.rows_failed = 0

    def applies(self, view: View) -> bool:
        """Pool rows in host memory, or in device memory where the CUDA digest runs
        (``native.has_device_digests``; the IPC backend checks in its copy kernel instead); an
        engine geometry's rows: ``applies_geometry``."""
        return self.enabled and view.geometry is None and all(
            g.region.memory_kind is MemoryKind.HOST
            or (g.region.memory_kind is MemoryKind.DEVICE and native.has_device_digests()) for g in view.groups)

    def applies_geometry(self, view: View) -> bool:
        """An engine geometry's rows in host memory: a push publisher sends the digests of the
        destination rows and the fetcher checks them (a pull is not checked: module docstring)."""
        return self.enabled and view.geometry is not None and all(
            r.memory_kind is MemoryKind.HOST for r in view.geometry.regions)

    def checks_records(self, view: View) -> bool:
        """A push fetcher of ``view`` concludes only from a record, which has the digests."""
        return self.applies(view) or self.applies_geometry(view)

    def check(self, view: View, masks: list[BoolArray], digests: Sequence[U64] | None) -> str | None:
        return self._counted(masks, lambda: check_landed(view, masks, digests, self.corrupt))

    def check_geometry(self, transform: Oriented, view: View, masks: list[BoolArray],
                       digests: Sequence[U64] | None) -> str | None:
        return self._counted(masks, lambda: check_landed_geometry(transform, view, masks, digests, self.corrupt))

    def check_summed(self, view: View, masks: list[BoolArray], digests: Sequence[U64] | None,
                     sums: Sequence[U64]) -> str | None:
        return self._counted(masks, lambda: check_summed(view, masks, digests, sums))

    def _counted(self, masks: list[BoolArray], run: Callable[[], str | None]) -> str | None:
        """``run()``'s reason, with the rows it made False in ``masks`` counted as refused."""
        before = sum(int(m.sum()) for m in masks)
        reason = run()
        if reason is not None:
            self.rows_failed += before - sum(int(m.sum()) for m in masks)
        return reason

    def sum_landed(self, region: SlotRegion, slots: IndexArray) -> U64:
        """The digests of rows this end just placed (the corrupt hook applied first), for
        ``check_summed`` once the digests they should have come."""
        if self.corrupt is not None:
            self.corrupt(region, slots)
        return region_digests(region, slots)

    def record_check(self, view: View, transform: Oriented | None = None, sums: Sequence[U64] | None = None
                     ) -> Callable[[list[BoolArray], CompletionRecord], str | None] | None:
        """What ``conclude_from_record`` takes for a passive (push) fetch of ``view``
        (``transform``: its plan, for a geometry view; ``sums``: the digests this end took of
        the rows as it placed them, when it did)."""
        if transform is not None and self.applies_geometry(view):
            return lambda masks, record: self.check_geometry(transform, view, masks, record.digests or None)
        if not self.applies(view):
            return None
        if sums is not None:
            return lambda masks, record: self.check_summed(view, masks, record.digests or None, sums)
        return lambda masks, record: self.check(view, masks, record.digests or None)


def checked_outcome(check: RowCheck, view: View, outcome: Outcome, digests: Sequence[U64] | None) -> Outcome:
    """``outcome`` with the rows it says landed checked against ``digests`` (aligned with
    ``view``'s groups; None: none came): rows that fail are False, and an outcome with such
    rows is never Delivered."""
    masks = [np.array(m, dtype=np.bool_) for m in outcome.masks]
    bad = check.check(view, masks, digests)
    return outcome if bad is None else with_refused(outcome, masks, bad)


def with_refused(outcome: Outcome, masks: Sequence[BoolArray], bad: str) -> Outcome:
    """``outcome`` once a check refused rows (``masks``: what is left, ``bad``: why)."""
    if isinstance(outcome, Delivered):
        return Failed(bad, masks)
    if isinstance(outcome, Cancelled):
        return Cancelled(outcome.by_peer, masks)
    return Failed(f"{outcome.reason}; {bad}", masks)
