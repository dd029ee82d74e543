"""The nixl backend's bookkeeping for one attempt: which chunks are posted, proven, stuck.

An active job (push publisher, pull fetcher) moves bytes in chunks; a passive wait (push
fetcher, pull publisher) waits for the active end's completion record. Only the backend's
progress thread changes them after submission.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvxfer.backends.attempt import TrackedAttempt
from kvxfer.backends.nixl_plan import Chunk
from kvxfer.contract import BoolArray, Hint, View


@dataclass(eq=False)
class ActiveJob:
    """This end moves the bytes: WRITE into the peer's rows (push) or READ them (pull)."""

    attempt: TrackedAttempt
    view: View
    hint: Hint
    op: str                      # "WRITE" or "READ"
    chunks: list[Chunk]
    deadline: float
    injected: str | None = None  # the fault to report once the allowed rows are in
    ready: bool = True           # False while etcd has not delivered the peer's metadata
    next_chunk: int = 0
    not_before: float = 0.0      # paced posting (chunk_pause_s), for tests of mid-way faults
    inflight: dict[int, Any] = field(default_factory=dict)  # chunk index -> NIXL handle
    stuck: list[Any] = field(default_factory=list)           # handles NIXL would not release yet
    done: list[int] = field(default_factory=list)            # chunks proven delivered
    failure: str | None = None
    cancelled_by_peer: bool = False

    @property
    def touching(self) -> bool:
        """True while some NIXL request of this job may still access memory."""
        return bool(self.inflight or self.stuck)

    def masks(self) -> tuple[list[BoolArray], list[BoolArray]]:
        """(local masks aligned with the view, peer masks aligned with the hint) of proven chunks."""
        local = self.view.row_masks()
        peer = [np.zeros(len(g), dtype=np.bool_) for g in self.hint.groups]
        for index in self.done:
            chunk = self.chunks[index]
            local[chunk.group][chunk.local_rows] = True
            peer[chunk.peer_group][chunk.peer_rows] = True
        return local, peer


@dataclass(eq=False)
class PassiveWait:
    """The peer moves the bytes; this end waits for its completion record."""

    attempt: TrackedAttempt
    view: View
    hint: Hint
    own_id: str
    deadline: float
    told_peer: bool = False
