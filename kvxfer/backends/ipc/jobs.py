"""The IPC backend's bookkeeping for one attempt.

An active job (push publisher, pull fetcher) queues row-copy kernels (between two engine
geometries, one layout-transform kernel) and then tells the passive end what landed; a
passive wait (push fetcher, pull publisher) waits for that word, by socket frame or
doorbell. The owner thread makes them at submission; after that the progress thread
changes them, except for the fields that say otherwise.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import numpy as np

from kvxfer.backends.common.attempt import TrackedAttempt
from kvxfer.backends.common.matching import GroupMatch
from kvxfer.backends.common.transform import Oriented
from kvxfer.backends.ipc.mappings import Export, Mapping
from kvxfer.backends.ipc.rowcheck import CheckBytes, CheckedLaunch
from kvxfer.contract import Delivered, Hint, View


@dataclass(eq=False, slots=True)
class ActiveJob:
    """This end moves the bytes (push publisher, pull fetcher)."""

    attempt: TrackedAttempt
    view: View
    hint: Hint
    matches: list[GroupMatch]
    exports: dict[str, Export]  # peer region name -> its allocation
    writes_peer: bool
    bell: tuple[str, int] | None = None  # the passive end's doorbell: (ring path, slot)
    transform: Oriented | None = None  # engine geometries at both ends: this plan moves the bytes (geometry)
    checked: bool = False  # the kernels check every row (rowcheck): set at submission
    check: CheckBytes | None = None  # where they write their verdicts, and each kernel's rows in it
    check_launches: list[CheckedLaunch] = field(default_factory=list)
    cancelled_by_peer: bool = False
    launched: bool = False
    event: int = 0
    nbytes: int = 0  # queued for copying
    mappings: list[Mapping] = field(default_factory=list)
    local_masks: list[np.ndarray] = field(default_factory=list)
    peer_masks: list[np.ndarray] = field(default_factory=list)
    failure: str | None = None
    token: bytes | None = None  # the token of "DELIVERED, every row" (b"": none); see CompletionFrames.job_token
    frame: bytes | None = None  # DELIVERED (a token frame, or the record), made while the kernel runs
    delivered: Delivered | None = None  # and our outcome if it ends so
    # Who sends the record: the owner thread (a copy already ended when publish() was
    # about to return) or the progress thread; whoever sets ``sent`` first, under the lock.
    sent: bool = False
    send_lock: threading.Lock = field(default_factory=threading.Lock)


@dataclass(eq=False, slots=True)
class PassiveWait:
    """The peer moves the bytes; this end waits for its completion record."""

    attempt: TrackedAttempt
    view: View
    hint: Hint
    own_id: str
    deadline: float
    told_peer: bool = False
    watching: bool = False  # connected to the peer, so that its death is seen
    gone_at: float | None = None
    token: bytes = b""  # the usual answer's token (see CompletionFrames) and its outcome, made at submission
    delivered: Delivered | None = None
    bell: int = 0  # the doorbell value that stands for the token (0: no doorbell)
