"""The packed NIXL path: many small rows cross as one WRITE of packed bytes per chunk.

Why: each NIXL descriptor costs about 12 µs in UCX (docs/performance.md), so scattered small rows,
one descriptor each, cap a transfer near 5-8 GB/s. Packed, the publisher gathers a chunk
of rows into a slot of its registered bounce arena, WRITEs it as one descriptor into a slot
of the fetcher's arena, and the fetcher scatters it into its rows on its progress thread.
On host memory packing adds two memcpys to NIXL's one and pays only for small rows
(``nixl.MIN_DESCRIPTORS`` says where ``packed="auto"`` draws the line, and why).

Protocol (push only; notes are NIXL notifications, ``NOTE_PREFIX`` + msgpack):

- sender -> receiver ``req`` {t, n, r, h}: transfer ``t`` (the receiver's id) has ``n`` chunks
  carrying ``r`` rows, all it will send (-1: the sender will fail after them, an injected fault),
  and the sender holds ``h`` slots granted ahead (below);
- receiver -> sender ``credit`` {t, grant, ok, no}: arena slots the sender may write now
  (each granted to one transfer at a time), chunks scattered (``ok``) and chunks dropped
  unscattered (``no``: the receiver had already concluded, or the scatter failed);
- sender -> receiver ``chunk`` {t, c, s, g, rs, rl}: rides on the WRITE itself (NIXL
  delivers it once the bytes are in the receiver's arena): chunk ``c`` is in slot ``s``,
  rows of hint group ``g`` given as runs (int64 starts ``rs``, lengths ``rl``).

A fetch() whose publisher has an arena too, and whose view is large enough to go packed,
grants up to ``PREGRANT_SLOTS`` slots at once, unasked (a ``credit`` note before any ``req``;
at most half the landing slots are held so by waits whose sender has not asked yet), once
this end has heard from that publisher (a notification proves that it holds our metadata,
so it can answer the withdrawal that frees the slots should the wait end unasked): a push
published later finds them waiting and starts writing without the request's round trip. The
sender keeps such credits (bounded) until its push is submitted; if the push goes unpacked
they are dropped there and freed here by its completion record, as are slots of a wait that
ends unasked.

The receiver concludes Delivered by itself once it scattered all ``r`` rows (the sender's
record, one notification later, then finds the wait retired); its memory is quiet then, as
the sender writes nothing but the receiver's arena. A slot returns to the receiver's free
list only after its chunk was scattered (or dropped), or after the sender's completion
record (then nothing of the sender writes any more), so a sender never overwrites a chunk
still being scattered. Masks: the receiver's are the rows it
scattered; the sender's are the chunks acknowledged ``ok``; a sender that stops waits for the
acknowledgements of what it wrote (unless the peer died or the deadline passed, when it
undercounts), so both ends report the same rows.

Pull stays unpacked: packing a READ needs the publisher to gather first (a request, a
gather, a notification, then the READ: a round trip more per chunk), and on one node NIXL's
READ lane falls back to TCP (docs/performance.md: 0.5 GB/s) which packing cannot fix; the router sends
such transfers by push.
"""

from __future__ import annotations

import logging
import struct
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvxfer import native
from kvxfer.backends.common.matching import GroupMatch
from kvxfer.backends.nixl.agent import NixlAgent, PeerGone, PeerUnknown, XferError
from kvxfer.backends.nixl.jobs import ActiveJob, check_deadline_and_peer, disconnected, reap_requests
from kvxfer.backends.nixl.packed_notes import encode_note
from kvxfer.contract import Hint, IndexArray, MemoryKind, SlotRegion

log = logging.getLogger(__name__)

ARENA_EXTRA = "nixl.arena"
_ARENA = struct.Struct("<QQQBI")  # address, bytes, slot bytes, kind (0 host, 1 device), device id
_KINDS = (MemoryKind.HOST, MemoryKind.DEVICE)
PREGRANT_SLOTS = 4  # landing slots one fetch() may grant before its sender asks


@dataclass(frozen=True)
class ArenaInfo:
    """An arena as a hint advertises it (``Hint.extras[ARENA_EXTRA]``)."""

    address: int
    nbytes: int
    slot_bytes: int
    memory_kind: MemoryKind
    device_id: int

    @property
    def slots(self) -> int:
        return self.nbytes // self.slot_bytes

    def pack(self) -> bytes:
        return _ARENA.pack(self.address, self.nbytes, self.slot_bytes, _KINDS.index(self.memory_kind), self.device_id)

    @staticmethod
    def unpack(data: bytes) -> ArenaInfo:
        if len(data) != _ARENA.size:
            raise ValueError(f"hint extra {ARENA_EXTRA!r} has {len(data)} bytes, expected {_ARENA.size}")
        address, nbytes, slot_bytes, kind, device = _ARENA.unpack(data)
        if kind >= len(_KINDS) or address == 0 or slot_bytes == 0 or nbytes < slot_bytes:
            raise ValueError(f"hint extra {ARENA_EXTRA!r} is malformed (kind {kind}, address {address:#x}, "
                             f"{nbytes} bytes in slots of {slot_bytes})")
        return ArenaInfo(address, nbytes, slot_bytes, _KINDS[kind], device)

    @staticmethod
    def of(hint: Hint) -> ArenaInfo | None:
        data = hint.extra(ARENA_EXTRA)
        return None if data is None else ArenaInfo.unpack(data)


class Arena:
    """This backend's registered bounce memory, cut into equal slots: the first half gathers
    outgoing chunks, the second half lands incoming ones (so that sending never waits on
    receiving). Touched only by the backend's progress thread once the backend runs."""

    def __init__(self, nbytes: int, slot_bytes: int, memory_kind: MemoryKind, device_id: int = 0) -> None:
        slots = nbytes // slot_bytes if slot_bytes > 0 else 0
        if slots < 2:
            raise ValueError(f"the packed arena needs at least 2 slots: {nbytes} bytes in slots of {slot_bytes}")
        self.slot_bytes = slot_bytes
        self.nbytes = slots * slot_bytes
        self.memory_kind = memory_kind
        self.device_id = device_id
        self._stream: Any = None
        if memory_kind is MemoryKind.DEVICE:
            import torch  # noqa: PLC0415 - only for CUDA pools

            self._buffer: Any = torch.zeros(self.nbytes, dtype=torch.uint8, device=f"cuda:{device_id}")
            self._stream = torch.cuda.Stream(device=device_id)  # the backend's own stream
            self.address = int(self._buffer.data_ptr())
        else:
            self._buffer = np.zeros(self.nbytes, dtype=np.uint8)  # zeros + fill: pages faulted in now
            self._buffer.fill(0)
            self.address = int(self._buffer.ctypes.data)
        half = slots // 2
        self.free_out: deque[int] = deque(range(half))
        self.free_in: deque[int] = deque(range(half, slots))

    @property
    def landing_slots(self) -> int:
        return self.nbytes // self.slot_bytes - self.nbytes // self.slot_bytes // 2

    @property
    def info(self) -> ArenaInfo:
        return ArenaInfo(self.address, self.nbytes, self.slot_bytes, self.memory_kind, self.device_id)

    def region(self, name: str) -> SlotRegion:
        return SlotRegion(name, self.address, self.slot_bytes, self.nbytes // self.slot_bytes, self.memory_kind,
                          self.device_id)

    def slot_address(self, slot: int) -> int:
        return self.address + slot * self.slot_bytes

    def _copy_options(self) -> dict[str, Any]:
        if self._stream is None:
            return {"memory": MemoryKind.HOST}
        return {"memory": MemoryKind.DEVICE, "stream": int(self._stream.cuda_stream), "device": self.device_id}

    def _settle(self) -> None:
        if self._stream is not None:
            self._stream.synchronize()  # the bytes must be in place before a WRITE or an ack

    def gather(self, parts: list[tuple[SlotRegion, IndexArray, int]]) -> None:
        """Each (region, its slots, arena slot): rows into the arena slot. All are queued
        before one wait (a wait per chunk cost tens of µs each on the GPU machine); returns
        once every byte is in place, or raises RowCopyError after waiting for what was queued."""
        try:
            for region, slots, slot in parts:
                native.gather_rows(src_base=region.address, src_stride=region.slot_bytes, src_slots=slots,
                                   dst_base=self.slot_address(slot), row_bytes=region.slot_bytes,
                                   src_limit=region.slots, **self._copy_options())
        finally:
            self._settle()

    def transform(self, calls: list[dict[str, Any]]) -> None:
        """Each a ``native.transform_copy`` call (addresses, tokens, geometry) between the arena
        and a geometry's planes, in this arena's memory; as ``gather``."""
        try:
            for call in calls:
                native.transform_copy(**call, **self._copy_options())
        finally:
            self._settle()

    def scatter(self, parts: list[tuple[int, SlotRegion, IndexArray]]) -> None:
        """Each (arena slot, region, its slots): the slot's rows into the region; as ``gather``."""
        try:
            for slot, region, slots in parts:
                native.scatter_rows(src_base=self.slot_address(slot), dst_base=region.address,
                                    dst_stride=region.slot_bytes, dst_slots=slots, row_bytes=region.slot_bytes,
                                    dst_limit=region.slots, **self._copy_options())
        finally:
            self._settle()


def runs_of(rows: IndexArray) -> tuple[bytes, bytes]:
    """Rows as runs of consecutive values (usually one run): int64 starts, int64 lengths."""
    breaks = np.flatnonzero(np.diff(rows) != 1) + 1
    starts = np.concatenate(([0], breaks)).astype(np.int64)
    lengths = np.diff(np.concatenate((starts, [rows.size]))).astype(np.int64)
    return rows[starts].astype(np.int64).tobytes(), lengths.tobytes()


def rows_from_runs(starts_b: Any, lengths_b: Any, limit: int) -> IndexArray:
    """Expand runs; ValueError when malformed or outside ``[0, limit)``."""
    if not isinstance(starts_b, bytes) or not isinstance(lengths_b, bytes) or len(starts_b) != len(lengths_b) \
            or len(starts_b) % 8 or not starts_b:
        raise ValueError("packed note runs are malformed")
    starts = np.frombuffer(starts_b, dtype=np.int64)
    lengths = np.frombuffer(lengths_b, dtype=np.int64)
    # Compared without adding: starts + lengths could wrap around int64 and pass.
    if (lengths <= 0).any() or (starts < 0).any() or (lengths > limit).any() or (starts > limit - lengths).any():
        raise ValueError(f"packed note runs fall outside the group's {limit} rows")
    total = int(lengths.sum())
    offsets = np.repeat(np.cumsum(lengths) - lengths, lengths)
    return (np.arange(total, dtype=np.int64) - offsets + np.repeat(starts, lengths)).astype(np.int64)


# --- the sender ---------------------------------------------------------------------------
@dataclass(frozen=True, eq=False)
class PackedChunk:
    """Rows of one group that fit one arena slot, in view order."""

    group: int
    peer_group: int
    local_rows: IndexArray
    peer_rows: IndexArray
    region: SlotRegion
    local_slots: IndexArray

    @property
    def rows(self) -> int:
        return int(self.local_rows.size)

    @property
    def nbytes(self) -> int:
        return self.rows * self.region.slot_bytes


def plan_packed(matches: list[GroupMatch], hint: Hint, *, chunk_bytes: int,
                row_limit: int | None = None) -> list[PackedChunk]:
    """Packed chunks of the matched rows, in view order; only the first ``row_limit`` rows when set."""
    peer_index = {g.layer_group: i for i, g in enumerate(hint.groups)}
    budget = row_limit
    chunks: list[PackedChunk] = []
    for gi, match in enumerate(matches):
        if match.peer is None or match.local_rows.size == 0:
            continue
        n = int(match.local_rows.size) if budget is None else min(budget, int(match.local_rows.size))
        if budget is not None:
            budget -= n
        region = match.local.region
        per_chunk = chunk_bytes // region.slot_bytes
        if per_chunk < 1:
            raise ValueError(f"rows of {region.slot_bytes} bytes do not fit packed chunks of {chunk_bytes}")
        for start in range(0, n, per_chunk):
            part = slice(start, min(n, start + per_chunk))
            chunks.append(PackedChunk(gi, peer_index[match.peer.layer_group], match.local_rows[part],
                                      match.peer_rows[part], region, match.local_slots[part]))
        if budget == 0:
            break
    return chunks


@dataclass(eq=False)
class PackedJob(ActiveJob):
    """A push whose chunks travel packed: credits in, chunks out, acknowledgements back."""

    remote: ArenaInfo | None = None
    requested: bool = False                                  # the ``req`` note was sent
    credits: deque[int] = field(default_factory=deque)       # granted remote slots, unused yet
    out_slots: dict[int, int] = field(default_factory=dict)  # chunk index -> local slot, while in flight
    written: set[int] = field(default_factory=set)           # in the peer's arena, not acknowledged yet
    abandoned: bool = False                                  # peer gone or deadline passed: stop waiting

    @property
    def finished(self) -> bool:
        if self.touching or (self.written and not self.abandoned):
            return False
        stopping = self.failure is not None or self.attempt.cancel_requested
        if not self.ready and not stopping:
            return False
        return stopping or len(self.done) == len(self.chunks)

    # What the path of a submission's rows needs (``geometry_packed.GeometryPackedJob`` moves
    # segments of a plan instead): what the ``req`` note counts, the gather, the chunk note.
    def carried(self) -> int:
        return sum(c.rows for c in self.chunks)

    def gather(self, arena: Arena, parts: list[tuple[Any, int]]) -> None:
        arena.gather([(chunk.region, chunk.local_slots, slot) for chunk, slot in parts])

    def chunk_fields(self, chunk: Any) -> dict[str, Any]:
        starts, lengths = runs_of(chunk.peer_rows)
        return {"g": chunk.peer_group, "rs": starts, "rl": lengths}

    def on_credit(self, grant: list[int], ok: list[int], no: list[int]) -> None:
        assert self.remote is not None
        # Acknowledgements first: a bad grant in the same note must not strand chunks the
        # peer did scatter (they would stay "written" until the deadline).
        if any(s < 0 or s >= self.remote.slots for s in grant):
            self.failure = self.failure or f"peer {self.hint.agent!r} granted an arena slot outside its arena"
        else:
            self.credits.extend(grant)
        for c in ok:
            if c in self.written:
                self.written.discard(c)
                self.done.append(c)
        for c in no:
            if c in self.written:
                self.written.discard(c)
                if not self.attempt.cancel_requested:
                    self.failure = self.failure or f"peer {self.hint.agent!r} did not scatter chunk {c}"


def request_slots(job: PackedJob, agent: NixlAgent) -> bool:
    """Send the job's ``req`` note once its peer is loaded; True when the peer is gone."""
    stopping = job.failure is not None or job.attempt.cancel_requested
    if job.requested or not job.ready or stopping:
        return False
    peer = job.hint.agent
    try:
        rows = -1 if job.injected else job.carried()
        agent.notify(peer, encode_note("req", t=job.hint.transfer_id, n=len(job.chunks), r=rows,
                                       h=len(job.credits)))
        job.requested = True
    except PeerUnknown:
        pass  # etcd metadata not there yet: asked again on the next step
    except PeerGone:
        job.failure, job.abandoned = f"peer {peer!r} disconnected (NIXL_ERR_REMOTE_DISCONNECT)", True
        job.peer_gone = True
        return True
    return False


def step_packed(job: PackedJob, agent: NixlAgent, arena: Arena, *, pause_s: float, deadline_s: float) -> bool:
    """Check the job's WRITEs, then post more while credits and local gather slots allow (they
    bound what is in flight: each WRITE is one large descriptor, so no further window).
    Returns True when the peer turned out to be disconnected."""
    assert job.remote is not None
    now = time.monotonic()
    if now > job.deadline:
        job.abandoned = True
    check_deadline_and_peer(job, agent, now, deadline_s)

    def ended(index: int, released: bool) -> None:
        slot = job.out_slots.pop(index)
        if released:
            arena.free_out.append(slot)  # else never reused: NIXL may still read it

    # Even after a failure or past the deadline a WRITE still in progress is waited for: NIXL
    # does not abort it (ActiveJob.peer_gone), and one that completes is acknowledged by the
    # peer, which scatters it: both ends must then count its rows. DONE: its ``chunk`` note
    # reaches the peer with the bytes.
    if reap_requests(job, agent, "packed chunk", job.written.add, ended):
        job.abandoned = True
        return True
    if request_slots(job, agent):
        return True
    batch = _gathered_batch(job, arena, now, pause_s)
    for at, (index, chunk, slot, remote_slot) in enumerate(batch):
        try:
            _post_packed(job, agent, arena, index, chunk, slot, remote_slot)
        except PeerGone:
            arena.free_out.extend(s for _, _, s, _ in batch[at:])
            job.abandoned = True
            disconnected(job)
            return True
        except XferError as exc:
            arena.free_out.extend(s for _, _, s, _ in batch[at:])
            job.failure = str(exc)
            break
    return False


def _gathered_batch(job: PackedJob, arena: Arena, now: float, pause_s: float) -> list[tuple[int, Any, int, int]]:
    """The chunks to post now (chunk index, chunk, local slot, remote slot), gathered into
    their local arena slots; none when the gather fails (the job then fails)."""
    batch: list[tuple[int, Any, int, int]] = []  # a PackedChunk, or a geometry's segments
    while (job.failure is None and not job.attempt.cancel_requested and job.requested and job.credits
           and arena.free_out and job.next_chunk < len(job.chunks)
           and now >= job.not_before):
        chunk = job.chunks[job.next_chunk]
        batch.append((job.next_chunk, chunk, arena.free_out.popleft(), job.credits.popleft()))
        job.next_chunk += 1
        if pause_s:
            job.not_before = now + pause_s
            break
    if batch:
        try:
            job.gather(arena, [(chunk, slot) for _, chunk, slot, _ in batch])
        except native.RowCopyError as exc:
            arena.free_out.extend(slot for _, _, slot, _ in batch)
            job.failure = f"gathering packed chunks {batch[0][0]}-{batch[-1][0]}: {exc}"
            return []
    return batch


def _post_packed(job: PackedJob, agent: NixlAgent, arena: Arena, index: int, chunk: Any, slot: int,
                 remote_slot: int) -> None:
    """WRITE one gathered chunk into the peer's granted slot, its ``chunk`` note riding along."""
    assert job.remote is not None
    note = encode_note("chunk", t=job.hint.transfer_id, c=index, s=remote_slot, **job.chunk_fields(chunk))
    local = np.array([[arena.slot_address(slot), chunk.nbytes, arena.device_id]], dtype=np.uint64)
    remote = np.array([[job.remote.address + remote_slot * job.remote.slot_bytes, chunk.nbytes,
                        job.remote.device_id]], dtype=np.uint64)
    post = agent.post("WRITE", local, arena.memory_kind, remote, job.remote.memory_kind, job.hint.agent, notif=note)
    if post.state == "DONE":
        job.written.add(index)
        if agent.release(post.handle):
            arena.free_out.append(slot)
        else:
            job.stuck.append(post.handle)
    else:
        job.inflight[index] = post.handle
        job.out_slots[index] = slot


# --- the receiver -------------------------------------------------------------------------
@dataclass(frozen=True, eq=False)
class Landing:
    """A chunk in our arena, checked, with where its rows go."""

    wait: Any            # the backend's passive wait (its ``inbound`` is set)
    chunk: int
    slot: int            # the arena slot it is in
    group: int           # the view group its rows belong to
    rows: IndexArray     # rows of that group, in the chunk's order
    region: SlotRegion
    slots: IndexArray    # the region slots of those rows
    segments: tuple[int, int] | None = None  # a geometry's chunk: plan segments [first, end) instead of rows
