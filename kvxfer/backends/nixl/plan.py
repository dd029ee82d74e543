"""Cut a matched submission into chunks of NIXL descriptors, built with numpy.

A chunk is one NIXL transfer request: rows of one layer group (one memory kind on each
end, as one descriptor list has one memory type), at most ``chunk_bytes`` of them, with
runs that are contiguous on both ends coalesced into one descriptor (docs/performance.md: each
descriptor costs about 12 µs in UCX). A chunk is the unit of proof: when its request is
DONE, NIXL has flushed the endpoint, so every row of it is visible at the destination;
a failure part-way reports exactly the rows of the chunks that completed.

How large a chunk is depends on the memory at both ends (``ChunkBytes``): every request
costs the backend's progress thread a post, state checks and a pause between them, about
half a millisecond a round on the GPU machine, which host memory (10 GB/s: 1.6 ms per
16 MiB) hides and device memory (1.5 TB/s over cuda_ipc: 11 µs per 16 MiB) does not.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvxfer.backends.common.matching import GroupMatch, coalesce
from kvxfer.contract import Hint, IndexArray, MemoryKind

DescArray = np.ndarray  # (n, 3) uint64: address, bytes, device id


@dataclass(frozen=True)
class ChunkBytes:
    """Bytes per chunk: ``device`` when both ends are device memory, else ``host``."""

    host: int = 16 << 20
    device: int = 256 << 20

    def __post_init__(self) -> None:
        if self.host <= 0 or self.device <= 0:
            raise ValueError(f"chunk sizes must be positive, got host {self.host}, device {self.device}")

    @staticmethod
    def uniform(nbytes: int) -> ChunkBytes:
        return ChunkBytes(nbytes, nbytes)

    @staticmethod
    def of(chunk_bytes: int | ChunkBytes | None) -> ChunkBytes:
        """``chunk_bytes`` as given to a backend: None, the defaults; an int, that size for
        every memory; ValueError or TypeError naming ``chunk_bytes`` for anything else."""
        if chunk_bytes is None:
            return ChunkBytes()
        if isinstance(chunk_bytes, ChunkBytes):
            return chunk_bytes
        if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int):
            raise TypeError(f"chunk_bytes must be an int, a ChunkBytes or None, got {chunk_bytes!r}")
        if chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
        return ChunkBytes.uniform(chunk_bytes)

    def between(self, local: MemoryKind, remote: MemoryKind) -> int:
        return self.device if local is MemoryKind.DEVICE and remote is MemoryKind.DEVICE else self.host


@dataclass(frozen=True, eq=False)
class Chunk:
    """One transfer request's worth of rows of one group."""

    group: int              # index into the local view's groups
    peer_group: int         # index into the hint's groups
    local_rows: IndexArray  # rows of the local group it carries
    peer_rows: IndexArray   # the matching rows of the peer's group
    local_descs: DescArray
    remote_descs: DescArray
    local_kind: MemoryKind
    remote_kind: MemoryKind

    @property
    def rows(self) -> int:
        return int(self.local_rows.size)

    @property
    def nbytes(self) -> int:
        return int(self.local_descs[:, 1].sum())


def _descs(base: int, slot_bytes: int, device: int, starts: IndexArray, lengths: IndexArray) -> DescArray:
    out = np.empty((starts.size, 3), dtype=np.uint64)
    out[:, 0] = np.uint64(base) + starts.astype(np.uint64) * np.uint64(slot_bytes)
    out[:, 1] = lengths.astype(np.uint64) * np.uint64(slot_bytes)
    out[:, 2] = device
    return out


def plan_chunks(matches: list[GroupMatch], hint: Hint, *, chunk_bytes: int | ChunkBytes, row_limit: int | None = None,
                coalesce_runs: bool = True) -> list[Chunk]:
    """Chunks for the matched rows, in view order; only the first ``row_limit`` rows when set.
    An int ``chunk_bytes`` applies to every group, whatever its memory."""
    sizes = ChunkBytes.of(chunk_bytes)
    peer_index = {g.layer_group: i for i, g in enumerate(hint.groups)}
    budget = row_limit
    chunks: list[Chunk] = []
    for gi, match in enumerate(matches):
        if match.peer is None or match.local_rows.size == 0:
            continue
        n = int(match.local_rows.size) if budget is None else min(budget, int(match.local_rows.size))
        if budget is not None:
            budget -= n
        region, peer = match.local.region, match.peer
        per_chunk = max(1, sizes.between(region.memory_kind, peer.memory_kind) // region.slot_bytes)
        for start in range(0, n, per_chunk):
            part = slice(start, min(n, start + per_chunk))
            local_slots, peer_slots = match.local_slots[part], match.peer_slots[part]
            if coalesce_runs:
                ls, ps, lengths = coalesce(local_slots, peer_slots)
            else:
                ls, ps, lengths = local_slots, peer_slots, np.ones(local_slots.size, dtype=np.int64)
            chunks.append(Chunk(
                group=gi, peer_group=peer_index[peer.layer_group],
                local_rows=match.local_rows[part], peer_rows=match.peer_rows[part],
                local_descs=_descs(region.address, region.slot_bytes, region.device_id, ls, lengths),
                remote_descs=_descs(peer.address, peer.slot_bytes, peer.device_id, ps, lengths),
                local_kind=region.memory_kind, remote_kind=peer.memory_kind,
            ))
        if budget == 0:
            break
    return chunks


def count_descriptors(matches: list[GroupMatch], *, chunk_bytes: int, row_limit: int | None = None,
                      coalesce_runs: bool = True) -> tuple[int, int]:
    """(descriptors, chunks) that ``plan_chunks`` would make, without making them.

    Why: choosing between the packed and the unpacked path needs only these two counts, and
    building every descriptor of a push that then goes packed cost more than a millisecond
    at 4,096 rows on the GPU machine (bench/results/2026-11-29-h200-nixl-packed, the packed timeline).
    """
    budget = row_limit
    descriptors = chunks = 0
    for match in matches:
        if match.peer is None or match.local_rows.size == 0:
            continue
        n = int(match.local_rows.size) if budget is None else min(budget, int(match.local_rows.size))
        if budget is not None:
            budget -= n
        per_chunk = max(1, chunk_bytes // match.local.region.slot_bytes)
        parts = -(-n // per_chunk)
        chunks += parts
        if not coalesce_runs:
            descriptors += n
        elif n:
            local, peer = match.local_slots[:n], match.peer_slots[:n]
            ends = np.diff(local) != 1  # ends[k]: a run ends after row k
            ends |= np.diff(peer) != 1
            # A run that ends at a chunk's last row (k = per_chunk - 1 mod per_chunk) adds no
            # descriptor: the chunk ends there anyway.
            descriptors += parts + int(np.count_nonzero(ends)) - int(np.count_nonzero(ends[per_chunk - 1::per_chunk]))
        if budget == 0:
            break
    return descriptors, chunks
