"""Between two geometries, which path a submission takes, and the packed path's two ends.

Packed (push only; see ``packed`` for the protocol, which is unchanged): the sender gathers a
chunk's segments with ``native.transform_copy`` from its layout into an arena slot in a
canonical order (segment after segment, each token-major then head: strides (heads * unit,
unit)), and WRITEs the slot; the ``chunk`` note says which segments of the plan the slot
carries (``a``, ``b``: [first, end)) and the plan's ``fingerprint`` (``p``). The receiver, the
passive fetcher, made the same plan at fetch() from the sender's hint: it refuses a chunk
whose fingerprint differs from its own (the two ends would disagree on where a byte goes),
then scatters the slot into its layout (packed strides on the source side, its geometry's on
the destination side, the plan's destination addresses). The ``req`` note counts segments.

Masks: the receiver's are the runs whose every segment it scattered, the sender's the runs
whose every segment was acknowledged; as for rows, a sender that stops waits for the
acknowledgements of what it wrote, so both ends report the same blocks.

``packed="auto"`` packs a push whose descriptors per host-sized chunk reach the threshold of
rows (``paths.MIN_DESCRIPTORS``), counted as the descriptor path would make them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from kvxfer.backends.common.attempt import TrackedAttempt
from kvxfer.backends.common.transform import Oriented, TransformPlan
from kvxfer.backends.nixl.geometry_path import (
    GeometryJob,
    count_descriptors,
    cut_chunks,
    fingerprint,
    memory_of,
    proven_masks,
    segment_chunks,
    segments,
    shape_of,
    unit_row,
)
from kvxfer.backends.nixl.jobs import ActiveJob, PassiveWait
from kvxfer.backends.nixl.packed import ARENA_EXTRA, PREGRANT_SLOTS, Arena, ArenaInfo, PackedJob
from kvxfer.backends.nixl.packed_notes import ints
from kvxfer.backends.nixl.paths import MIN_DESCRIPTORS, PackedMode, slots_ahead
from kvxfer.backends.nixl.plan import ChunkBytes
from kvxfer.contract import BoolArray, Hint, IndexArray, InvalidSubmission, View

if TYPE_CHECKING:
    from kvxfer.backends.nixl.sender import SendPolicy


def _offsets(tokens: IndexArray, row: int) -> IndexArray:
    """Each segment's byte offset in a packed slot."""
    return (np.cumsum(tokens) - tokens) * row


def packed_bytes(plan: TransformPlan, first: int, end: int) -> int:
    return int(plan.tokens[first:end].sum()) * unit_row(plan)


def _copy(plan: TransformPlan, first: int, end: int, base: int, *, into_slot: bool) -> dict[str, Any]:
    """The ``transform_copy`` call between segments [first, end) and a packed slot at ``base``."""
    seg, row, unit = slice(first, end), unit_row(plan), plan.dst.unit_bytes
    tokens = plan.tokens[seg]
    packed, packed_strides = base + _offsets(tokens, row), (row, unit)
    if into_slot:
        src, dst = plan.src_addr[seg], packed
        src_strides, dst_strides = (plan.src.token_stride, plan.src.head_stride), packed_strides
    else:
        src, dst = packed, plan.dst_addr[seg]
        src_strides, dst_strides = packed_strides, (plan.dst.token_stride, plan.dst.head_stride)
    return {"src_addr": src, "dst_addr": dst, "tokens": tokens, "heads": plan.heads, "unit_bytes": unit,
            "src_strides": src_strides, "dst_strides": dst_strides}


# --- the sender ---------------------------------------------------------------------------
@dataclass(frozen=True, eq=False)
class PackedSegments:
    """Segments [first, end) of the plan that fit one arena slot."""

    first: int
    end: int
    nbytes: int

    @property
    def rows(self) -> int:
        return self.end - self.first


@dataclass(eq=False)
class GeometryPackedJob(PackedJob):
    """A packed push between two geometries: chunks are segment ranges of its plan."""

    transform: Oriented | None = None
    fingerprint: bytes = b""

    @property
    def plan(self) -> TransformPlan:
        assert self.transform is not None
        return self.transform.plan

    def masks(self) -> tuple[list[BoolArray], list[BoolArray]]:
        return proven_masks(self.transform, self.chunks, self.done)

    def gather(self, arena: Arena, parts: list[tuple[Any, int]]) -> None:
        arena.transform([_copy(self.plan, c.first, c.end, arena.slot_address(slot), into_slot=True)
                         for c, slot in parts])

    def chunk_fields(self, chunk: Any) -> dict[str, Any]:
        return {"a": chunk.first, "b": chunk.end, "p": self.fingerprint}


def packed_arena(policy: SendPolicy, transform: Oriented, end: int, hint: Hint, arena: Arena | None) -> ArenaInfo | None:
    """The peer's arena when this geometry push goes packed, else None."""
    if policy.packed == "never" or arena is None or end == 0:
        return None
    try:
        remote = ArenaInfo.of(hint)
    except ValueError as exc:
        raise InvalidSubmission(str(exc)) from None
    plan = transform.plan
    if remote is None or memory_of(plan.src) != (arena.memory_kind, arena.device_id) \
            or memory_of(plan.dst) != (remote.memory_kind, remote.device_id):
        return None
    if int(plan.tokens[:end].max()) * unit_row(plan) > min(arena.slot_bytes, remote.slot_bytes):
        return None  # a segment must fit one slot
    if policy.packed == "auto" and not _many_descriptors(plan, end, policy.chunk_bytes.host, policy.min_descriptors,
                                                          arena, coalesce=policy.coalesce):
        return None  # few, large descriptors: NIXL moves them as fast without a copy
    return remote


def _many_descriptors(plan: TransformPlan, end: int, chunk_bytes: int, min_descriptors: int | None, arena: Arena,
                      *, coalesce: bool = True) -> bool:
    """The descriptor path would average at least the threshold per host-sized chunk."""
    chunks = cut_chunks(plan, end, chunk_bytes, hard=False)
    floor = min_descriptors or MIN_DESCRIPTORS[arena.memory_kind]
    return count_descriptors(shape_of(plan, end), chunks, coalesce=coalesce) >= floor * len(chunks)


def plan_geometry_job(policy: SendPolicy, attempt: TrackedAttempt, view: View, hint: Hint, transform: Oriented,
                      deadline: float, *, ready: bool, fetching: bool, arena: Arena | None) -> ActiveJob:
    """This end's job between two geometries, packed or not; nothing posted."""
    plan = transform.plan
    limit = policy.fail_after_rows  # counts runs here
    injected = f"injected fault after {limit} runs" if limit is not None and limit < plan.runs else None
    end = segments(plan) if injected is None or limit is None else max(0, limit) * plan.planes
    remote = None if fetching else packed_arena(policy, transform, end, hint, arena)
    if remote is not None and arena is not None:
        fit = min(arena.slot_bytes, remote.slot_bytes)
        chunks = [PackedSegments(a, b, packed_bytes(plan, a, b)) for a, b in cut_chunks(plan, end, fit, hard=True)]
        return GeometryPackedJob(attempt, view, hint, "WRITE", chunks, deadline, injected=injected, ready=ready,
                                 remote=remote, transform=transform, fingerprint=fingerprint(plan))
    local, peer = (plan.src, plan.dst) if transform.local_is_src else (plan.dst, plan.src)
    budget = policy.chunk_bytes.between(memory_of(local)[0], memory_of(peer)[0])
    return GeometryJob(attempt, view, hint, "READ" if fetching else "WRITE",
                       list(segment_chunks(transform, end, budget, coalesce=policy.coalesce)), deadline,
                       injected=injected, ready=ready, transform=transform)


# --- the receiver -------------------------------------------------------------------------
@dataclass(eq=False)
class Shaped:
    """A geometry transfer landing packed at this end: its plan and the segments scattered."""

    transform: Oriented
    fingerprint: bytes
    landed: BoolArray

    @staticmethod
    def of(transform: Oriented) -> Shaped:
        return Shaped(transform, fingerprint(transform.plan), np.zeros(segments(transform.plan), dtype=np.bool_))

    @property
    def count(self) -> int:
        return int(np.count_nonzero(self.landed))

    def mark(self, first: int, end: int) -> list[BoolArray]:
        """Segments [first, end) are in place: the view's masks now (runs whose every segment is)."""
        self.landed[first:end] = True
        local, _ = self.transform.landed_masks(self.landed)
        return [m.copy() for m in local]


def shaped(wait: PassiveWait) -> Shaped | None:
    return None if wait.transform is None else Shaped.of(wait.transform)


def request_limit(wait: PassiveWait) -> int:
    """What a ``req`` note may count at most: the view's rows, or the plan's segments."""
    return wait.view.rows if wait.transform is None else segments(wait.transform.plan)


def landing_segments(shape: Shaped, note: dict[str, Any], arena: Arena) -> tuple[int, int]:
    """Segments [first, end) a ``chunk`` note says its slot holds; ValueError when they
    cannot be this end's."""
    first, end = ints([note.get("a"), note.get("b")], "a/b")
    if note.get("p") != shape.fingerprint:
        raise ValueError("the sender's plan differs from this end's (another geometry or other blocks than "
                         "the ones described)")
    plan = shape.transform.plan
    if not 0 <= first < end <= segments(plan):
        raise ValueError(f"segments [{first}, {end}) of a plan of {segments(plan)}")
    if packed_bytes(plan, first, end) > arena.slot_bytes:
        raise ValueError(f"segments [{first}, {end}) exceed an arena slot")
    if memory_of(plan.dst) != (arena.memory_kind, arena.device_id):
        raise ValueError("the view's KV is not in the arena's memory")
    return first, end


def scatter_calls(arena: Arena, landings: list[Any]) -> list[dict[str, Any]]:
    """``transform_copy`` calls that scatter geometry landings from their slots."""
    calls = []
    for x in landings:
        first, end = x.segments
        calls.append(_copy(x.wait.inbound.shaped.transform.plan, first, end, arena.slot_address(x.slot),
                           into_slot=False))
    return calls


def landing_slots_ahead(wait: PassiveWait, arena: Arena | None, *, packed: PackedMode,
                        min_descriptors: int | None) -> int:
    """Landing slots to grant a fetch() before its sender asks (``paths.slots_ahead``); between
    geometries as for rows, when the
    sender has an arena and its push would go packed under ``auto`` (the receiver counts the
    descriptors of the same plan, with the default chunk size)."""
    if wait.transform is None:
        return slots_ahead(wait.view, wait.hint, arena, packed=packed, min_descriptors=min_descriptors)
    if arena is None or packed == "never" or wait.hint.extra(ARENA_EXTRA) is None:
        return 0
    plan = wait.transform.plan
    end = segments(plan)
    if end == 0 or memory_of(plan.dst) != (arena.memory_kind, arena.device_id):
        return 0
    if int(plan.tokens.max()) * unit_row(plan) > arena.slot_bytes:
        return 0
    if not _many_descriptors(plan, end, ChunkBytes().host, min_descriptors, arena):
        return 0
    return min(PREGRANT_SLOTS, math.ceil(plan.nbytes / arena.slot_bytes))
