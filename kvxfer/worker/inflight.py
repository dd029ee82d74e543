"""The calls in progress on a worker, by request id, and the aborts that reached them (or
came before them)."""

from __future__ import annotations

import time
from collections import OrderedDict

from kvxfer.worker.errors import Aborted

_EARLY_ABORTS_KEPT = 4096  # aborts of ids not seen yet: bounded, whoever sends them


class InFlight:
    def __init__(self, hold_s: float) -> None:
        self._hold_s = hold_s
        # Ids whose prefill, reservation or local generation is being set up (across awaits),
        # and which of the three: a second call with one of them is refused at once instead
        # of failing in the pool, and an abort can reach a prefill or reservation being made.
        self.starting: dict[str, str] = {}
        # Ids aborted while their /prefill or /reserve ran: dropped as soon as it is made.
        # Each entry goes when its call ends, so the set holds only calls in progress.
        self.aborted: set[str] = set()
        # Ids aborted before their /prefill or /reserve arrived here (the router's timer fired
        # while the call waited to be read): that call, if it comes within hold_s, is refused
        # at once, as it would otherwise hold what it makes until hold_s and then quarantine it.
        self.aborted_early: OrderedDict[str, float] = OrderedDict()
        self.streams = 0  # publish or generate streams in progress (their clean-up included)

    def abort_early(self, rid: str) -> None:
        self.aborted_early[rid] = time.monotonic()
        self.aborted_early.move_to_end(rid)
        while len(self.aborted_early) > _EARLY_ABORTS_KEPT:  # the oldest goes
            self.aborted_early.popitem(last=False)

    def refuse_if_aborted_early(self, rid: str) -> None:
        since = self.aborted_early.pop(rid, None)
        if since is not None and time.monotonic() - since <= self._hold_s:
            raise Aborted(f"request {rid!r} was aborted before this call arrived; nothing is made")

    def end_start(self, rid: str) -> bool:
        """End a /prefill's or /reserve's set-up of ``rid``: whether an abort came meanwhile
        (then what it made is dropped by the caller), forgetting the abort either way."""
        self.starting.pop(rid, None)
        aborted = rid in self.aborted
        self.aborted.discard(rid)
        return aborted
