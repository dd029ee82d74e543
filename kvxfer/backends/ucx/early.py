"""Data messages that arrive before their fetch(): a publisher in push mode may send as soon
as it holds the fetcher's hint. They are held (taken out of UCX's queue, not received) for
the fetch() of a transfer this end described, and dropped once that can no longer come: its
hint expired, or its describe was pushed out of the bounded table. The backend's jobs lock
guards this."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container
from typing import Any

from kvxfer.backends.common.transfers import put_bounded

DESCRIBED_KEPT = 4096  # describes awaiting their fetch(), the newest
HELD_MAX = 1 << 16  # messages held in all, at most; past it they are dropped (the transfer then fails)


class EarlyMessages:
    def __init__(self) -> None:
        self._described: OrderedDict[int, float] = OrderedDict()  # data tag -> when its hint expires
        self._held: OrderedDict[int, list[Any]] = OrderedDict()
        self._count = 0

    def described(self, tag: int, expires: float) -> None:
        put_bounded(self._described, tag, expires, DESCRIBED_KEPT)

    def hold(self, tag: int, probe: Any) -> bool:
        """Keep ``probe`` for the fetch() of ``tag``; False when no such fetch() can come (or
        too much is held already): then the caller drops it."""
        if tag not in self._described or self._count >= HELD_MAX:
            return False
        self._held.setdefault(tag, []).append(probe)
        self._count += 1
        return True

    def take(self, tag: int) -> list[Any]:
        """The messages held for ``tag``, whose fetch() now exists."""
        self._described.pop(tag, None)
        held = self._held.pop(tag, [])
        self._count -= len(held)
        return held

    def expired(self, now: float, live: Container[int]) -> list[Any]:
        """Messages whose fetch() can no longer come, taken out to be dropped."""
        for tag in [t for t, expires in self._described.items() if expires < now]:
            del self._described[tag]
        gone = [t for t in self._held if t not in self._described and t not in live]
        held = [probe for tag in gone for probe in self._held.pop(tag)]
        self._count -= len(held)
        return held

    def everything(self) -> list[Any]:
        held = [probe for probes in self._held.values() for probe in probes]
        self._held.clear()
        self._count = 0
        return held
