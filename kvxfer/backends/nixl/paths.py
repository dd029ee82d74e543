"""Which path a NIXL submission takes: packed through the arenas, or one descriptor per run
of rows; and whether publish() posts an unpacked push's first chunks itself.

See the nixl backend's module docstring for the packed path, ``MIN_DESCRIPTORS`` for where
its threshold comes from, and ``post_inline`` for the inline posts.
"""

from __future__ import annotations

import logging
from typing import Literal

from kvxfer.backends.common.matching import GroupMatch
from kvxfer.backends.nixl.jobs import ActiveJob
from kvxfer.backends.nixl.packed import ARENA_EXTRA, PREGRANT_SLOTS, Arena, ArenaInfo
from kvxfer.backends.nixl.plan import ChunkBytes, count_descriptors
from kvxfer.contract import Hint, InvalidSubmission, MemoryKind, View

log = logging.getLogger(__name__)

PackedMode = Literal["auto", "always", "never"]
Path = Literal["packed", "unpacked"]

# packed="auto" packs a push when its host-sized chunks (``ChunkBytes.host``, 16 MiB by
# default) average at least this many descriptors (runs after coalescing) each. DEVICE:
# every descriptor costs ~12 µs in UCX while the device gathers and scatters at TB/s
# (docs/performance.md), so pack early. HOST: packing adds two memcpys to
# NIXL's one; measured on the 2-core CPU machine (bench/nixl_packed.py, 256 MiB of scattered
# rows, two processes, best of 3-7 over several runs) packed was 2.2-2.9x unpacked at 4 KiB
# rows, 0.8-1.1x at 16 KiB, 0.5-0.65x at 64 KiB, so with 16 MiB chunks only rows of about
# 8 KiB or less (2,048 per chunk) go packed.
MIN_DESCRIPTORS = {MemoryKind.DEVICE: 64, MemoryKind.HOST: 2048}


def packed_target(matches: list[GroupMatch], hint: Hint, arena: Arena | None, row_limit: int | None, *,
                  packed: PackedMode, min_descriptors: int | None, chunk_bytes: ChunkBytes, coalesce: bool,
                  agent: str) -> ArenaInfo | None:
    """The peer's arena when this push goes packed, else None."""
    if packed == "never" or arena is None:
        return None
    try:
        remote = ArenaInfo.of(hint)
    except ValueError as exc:
        raise InvalidSubmission(str(exc)) from None
    if remote is None:
        return None
    # Counted per host-sized chunk whatever the memory: MIN_DESCRIPTORS was measured so
    # (with 16 MiB chunks), and an unpacked push of device rows then goes in larger ones.
    descriptors, chunks = count_descriptors(matches, chunk_bytes=chunk_bytes.host, row_limit=row_limit,
                                            coalesce_runs=coalesce)
    if chunks == 0:
        return None
    if packed == "auto":
        floor = min_descriptors or MIN_DESCRIPTORS[arena.memory_kind]
        if descriptors < floor * chunks:
            return None  # few, large descriptors: NIXL moves them as fast without a copy
    fit = min(arena.slot_bytes, remote.slot_bytes)
    for m in matches:
        if m.peer is None or m.local_rows.size == 0:
            continue
        region = m.local.region
        if (region.memory_kind, region.device_id) != (arena.memory_kind, arena.device_id) \
                or (m.peer.memory_kind, m.peer.device_id) != (remote.memory_kind, remote.device_id) \
                or region.slot_bytes > fit:
            log.debug("nixl backend %s: group %s cannot go packed (memory or row size)", agent, m.local.layer_group)
            return None
    return remote


def slots_ahead(view: View, hint: Hint, arena: Arena | None, *, packed: PackedMode,
                min_descriptors: int | None) -> int:
    """Landing slots to grant a fetch() before its sender asks: only when the sender has
    an arena and the view is large enough that its push would go packed under ``auto``."""
    if arena is None or packed == "never" or hint.extra(ARENA_EXTRA) is None:
        return 0
    if view.rows < (min_descriptors or MIN_DESCRIPTORS[arena.memory_kind]):
        return 0
    if any((g.region.memory_kind, g.region.device_id) != (arena.memory_kind, arena.device_id)
           for g in view.groups):
        return 0
    nbytes = sum(len(g) * g.region.slot_bytes for g in view.groups)
    return min(PREGRANT_SLOTS, -(-nbytes // arena.slot_bytes))


def posts_inline(job: ActiveJob, *, post_inline: bool | None, paced: bool) -> bool:
    """Whether publish() posts this unpacked push's first chunks itself (``post_inline``)."""
    if job.op != "WRITE" or not job.ready or not job.chunks or paced or post_inline is False:
        return False
    return bool(post_inline) or all(
        c.local_kind is MemoryKind.DEVICE and c.remote_kind is MemoryKind.DEVICE for c in job.chunks)
