"""The sending side of a NIXL submission: the job a submission becomes (packed or one
descriptor per run; between two geometries, ``geometry_packed``), the posts publish() makes
itself, and each progress step's posts.

The backend snapshots its knobs into a ``SendPolicy`` per call, so that a test or tool that
changes one (``fail_after_rows``, ``chunk_pause_s``) affects the next submission.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvxfer.backends.common.attempt import TrackedAttempt
from kvxfer.backends.common.matching import GroupMatch
from kvxfer.backends.common.transform import Oriented
from kvxfer.backends.nixl.agent import NixlAgent
from kvxfer.backends.nixl.geometry_packed import plan_geometry_job
from kvxfer.backends.nixl.jobs import ActiveJob, step_chunks
from kvxfer.backends.nixl.packed import Arena, PackedJob, plan_packed, request_slots, step_packed
from kvxfer.backends.nixl.paths import PackedMode, packed_target, posts_inline
from kvxfer.backends.nixl.plan import ChunkBytes, plan_chunks
from kvxfer.contract import Hint, View


@dataclass(frozen=True)
class SendPolicy:
    """The backend's knobs as one submission or step sees them (see NixlBackend's arguments)."""

    packed: PackedMode
    min_descriptors: int | None
    chunk_bytes: ChunkBytes
    coalesce: bool
    post_inline: bool | None
    window: int
    pause_s: float
    deadline_s: float
    fail_after_rows: int | None


@dataclass(frozen=True)
class Posted:
    """What one step of a job sent: the peer found gone, and the packed chunks and bytes posted."""

    lost: bool
    chunks: int = 0
    nbytes: int = 0


def plan_job(policy: SendPolicy, attempt: TrackedAttempt, view: View, hint: Hint, matches: list[GroupMatch],
             deadline: float, *, ready: bool, fetching: bool, arena: Arena | None, agent: str,
             transform: Oriented | None = None) -> ActiveJob:
    """This end's job, packed or not; nothing posted. InvalidSubmission for a peer arena that
    cannot be read. With a ``transform`` (two geometries) the plan's segments move, not rows."""
    if transform is not None:
        return plan_geometry_job(policy, attempt, view, hint, transform, deadline, ready=ready, fetching=fetching,
                                 arena=arena)
    total = sum(int(m.local_rows.size) for m in matches if m.peer is not None)
    limit = policy.fail_after_rows
    injected = f"injected fault after {limit} rows" if limit is not None and limit < total else None
    row_limit = limit if injected else None
    remote = None if fetching else packed_target(
        matches, hint, arena, row_limit, packed=policy.packed, min_descriptors=policy.min_descriptors,
        chunk_bytes=policy.chunk_bytes, coalesce=policy.coalesce, agent=agent)
    if remote is not None and arena is not None:
        packed = plan_packed(matches, hint, chunk_bytes=min(arena.slot_bytes, remote.slot_bytes), row_limit=row_limit)
        return PackedJob(attempt, view, hint, "WRITE", packed, deadline, injected=injected, ready=ready, remote=remote)
    chunks = plan_chunks(matches, hint, chunk_bytes=policy.chunk_bytes, row_limit=row_limit,
                         coalesce_runs=policy.coalesce)
    return ActiveJob(attempt, view, hint, "READ" if fetching else "WRITE", chunks, deadline, injected=injected,
                     ready=ready)


def start_job(policy: SendPolicy, job: ActiveJob, agent: NixlAgent, granted_ahead: list[int]) -> bool:
    """Once the hint is claimed: what publish() sends itself. A packed push asks for arena
    slots now rather than on the progress thread's next step (the request's round trip is on
    its critical path); an unpacked push between device memory posts its first chunks
    (``post_inline``). True when the peer turned out to be disconnected."""
    if isinstance(job, PackedJob):
        job.on_credit(granted_ahead, [], [])
        return request_slots(job, agent)
    if posts_inline(job, post_inline=policy.post_inline, paced=bool(policy.pause_s)):
        return step_chunks(job, agent, window=policy.window, pause_s=0.0, deadline_s=policy.deadline_s)
    return False


def step_job(policy: SendPolicy, job: ActiveJob, agent: NixlAgent, arena: Arena | None) -> Posted:
    """One progress step of a job's requests (see ``step_chunks`` and ``step_packed``)."""
    if isinstance(job, PackedJob):
        assert arena is not None
        first = job.next_chunk
        lost = step_packed(job, agent, arena, pause_s=policy.pause_s, deadline_s=policy.deadline_s)
        sent = job.chunks[first:job.next_chunk]
        return Posted(lost, len(sent), sum(c.nbytes for c in sent))
    return Posted(step_chunks(job, agent, window=policy.window, pause_s=policy.pause_s,
                              deadline_s=policy.deadline_s))
