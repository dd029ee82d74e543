"""An IpcBackend's passive waits, and the two short ways they end: a done-token frame and a
doorbell.

A wait is found by our transfer id (a record names it), by its done-token (a 20-byte frame,
``frames``) and by its doorbell value (a word of our ``BellRing``, ``doorbells``). A token that
comes before its wait is kept for it (``early``); a token whose wait its doorbell ended
already is dropped when it comes (``answered``). The tables share the backend's jobs lock;
only the progress thread concludes waits here.
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable

import numpy as np

from kvxfer.backends.common.transfers import put_bounded
from kvxfer.backends.ipc.doorbells import BellRing, bell_slot
from kvxfer.backends.ipc.jobs import PassiveWait

log = logging.getLogger(__name__)

EARLY_KEPT = 4096  # tokens that arrived before their fetch/publish, kept for it (and rung tokens)


class PassiveWaits:
    """The waits of backend ``name``, guarded by its ``lock``; ``retire`` forgets our
    transfer id once a wait ended. ``doorbell``: offer a ring to the peers (busy-polling)."""

    def __init__(self, lock: threading.Lock, retire: Callable[[str], None], name: str, doorbell: bool) -> None:
        self._lock = lock
        self._retire = retire
        self.name = name
        self.doorbell = doorbell  # False once no ring could be made: sockets only
        self.bells_rung = 0  # waits concluded by their doorbell (the socket record came later)
        self.by_id: dict[str, PassiveWait] = {}  # by our transfer id
        self.by_token: dict[bytes, PassiveWait] = {}
        self.early: collections.OrderedDict[bytes, None] = collections.OrderedDict()  # tokens before their wait
        self.ring: BellRing | None = None  # ours, made at the first describe() (doorbell only)
        self.by_bell: dict[int, PassiveWait] = {}
        self._bell_slots: np.ndarray | None = None  # the slots by_bell's waits watch (None: stale)
        self.answered: collections.OrderedDict[bytes, None] = collections.OrderedDict()  # rung tokens

    def make_ring(self) -> BellRing | None:
        """Our doorbell ring, made on first use; None without doorbells (or if no ring can be
        made here: then sockets only, said once)."""
        if self.ring is None and self.doorbell:
            try:
                self.ring = BellRing()
            except OSError as exc:
                log.warning("IPC backend %s: no doorbell ring (%s); completions come over sockets only",
                            self.name, exc)
                self.doorbell = False
        return self.ring

    def add(self, wait: PassiveWait) -> bool:
        """With the lock held: register ``wait``; True if its token came already (taken: the
        caller hands it to ``on_token`` once the lock is released)."""
        self.by_id[wait.own_id] = wait  # a record that came early is stashed: the progress step looks
        self.by_token[wait.token] = wait
        if wait.bell:
            self.by_bell[wait.bell] = wait
            self._bell_slots = None
        early = wait.token in self.early
        if early:
            del self.early[wait.token]
        return early

    def end(self, wait: PassiveWait) -> None:
        with self._lock:
            self.by_id.pop(wait.own_id, None)
            self.by_token.pop(wait.token, None)
            if wait.bell and self.by_bell.pop(wait.bell, None) is not None:
                self._bell_slots = None
        self._retire(wait.own_id)
        wait.attempt.mark_quiesced()

    def on_token(self, token: bytes) -> None:
        """A peer's "DELIVERED, every row" for the wait of this token (one dict lookup, no
        decoding); a token whose wait is not registered yet is kept for it."""
        with self._lock:
            wait = self.by_token.get(token)
            if wait is None:
                if token in self.answered:
                    del self.answered[token]  # its doorbell concluded it already
                    return
                put_bounded(self.early, token, None, EARLY_KEPT)
                return
        if wait.attempt.poll() is None:
            assert wait.delivered is not None
            wait.attempt.conclude(wait.delivered)
        self.end(wait)  # also when we gave up earlier: the peer has stopped

    def bell_watch(self) -> tuple[np.ndarray | None, np.ndarray | None]:
        """(ring words, slots of the waits holding a doorbell) for the spin."""
        if self.ring is None or not self.by_bell:
            return None, None
        slots = self._bell_slots
        if slots is None:
            with self._lock:  # with the invalidation in add/end: none is lost
                slots = np.unique(np.fromiter((bell_slot(w.own_id) for w in self.by_bell.values()), np.int64))
                self._bell_slots = slots
        return self.ring.words, slots

    def check_bells(self) -> None:
        """Conclude the waits whose doorbell rang (first: the bookkeeping after). A word holding
        no wait's value (a store of an earlier transfer of that slot, or anything else) is
        cleared and ignored: the socket record still ends its wait."""
        ring, slots = self.ring, self._bell_slots
        if ring is None:
            return
        if slots is None:
            slots = self.bell_watch()[1]
            if slots is None:
                return
        for _slot, value in ring.take(slots):
            wait = self.by_bell.get(value)
            if wait is None:
                continue
            self.bells_rung += 1  # before the outcome: whoever sees it concluded sees it counted
            if wait.attempt.poll() is None:
                # Concluded here, first: the owner waits for nothing of the bookkeeping below
                # (on_token finds it concluded and only retires the wait).
                assert wait.delivered is not None
                wait.attempt.conclude(wait.delivered)
            self.on_token(wait.token)
            with self._lock:
                put_bounded(self.answered, wait.token, None, EARLY_KEPT)  # its record will follow: dropped then

    def close_ring(self) -> None:
        if self.ring is not None:
            self.ring.close()  # a peer's store into it after this lands in its own mapping only
