"""The pair a check drives: the backend under test and the other end (a :class:`PeerEnd`)."""

from __future__ import annotations

import abc
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from kvxfer.contract import Attempt, Backend, Hint, Outcome, Peer, SlotRegion, TransferMode, View
from kvxfer.testing.memory import RowMemory

TIMEOUT = 15.0
REFUSAL_GRACE = 0.4  # how long a peer waits, during a refusal, for news it must not get
Index = npt.NDArray[np.int64]


class PeerEnd(abc.ABC):
    """The other end of a pair, as the kit drives it. May proxy a backend in another process."""

    regions: tuple[SlotRegion, ...]

    @abc.abstractmethod
    def describe(self, view: View, audience: Peer | None = None) -> Hint: ...

    @abc.abstractmethod
    def start(self, op: str, view: View, hint: Hint) -> int:
        """Submit ``op`` ("fetch" or "publish") and return a handle."""

    @abc.abstractmethod
    def result(self, handle: int, timeout: float) -> tuple[Outcome | None, bool]:
        """Wait up to ``timeout`` for conclusion and quiescence; return (outcome, quiesced)."""

    @abc.abstractmethod
    def cancel(self, handle: int) -> None: ...

    @abc.abstractmethod
    def write(self, region: str, slots: Index, data: bytes) -> None: ...

    @abc.abstractmethod
    def read(self, region: str, slots: Index) -> bytes: ...

    def inject_fault(self, rows: int | None) -> bool:
        """Make the peer's next transfers fail after ``rows`` rows; False when unsupported."""
        return False

    @abc.abstractmethod
    def shutdown(self) -> int:
        """Shut the peer's backend down; return how many attempts were not quiesced."""


class InProcessPeer(PeerEnd):
    """A PeerEnd over a backend in this process."""

    def __init__(self, backend: Backend, memory: RowMemory, regions: tuple[SlotRegion, ...],
                 inject: Callable[[int | None], None] | None = None) -> None:
        self.backend = backend
        self.memory = memory
        self.regions = regions
        self._inject = inject
        self._attempts: dict[int, Attempt] = {}

    def describe(self, view: View, audience: Peer | None = None) -> Hint:
        return self.backend.describe(view, audience)

    def start(self, op: str, view: View, hint: Hint) -> int:
        attempt = self.backend.fetch(view, hint) if op == "fetch" else self.backend.publish(view, hint)
        handle = len(self._attempts) + 1
        self._attempts[handle] = attempt
        return handle

    def result(self, handle: int, timeout: float) -> tuple[Outcome | None, bool]:
        attempt = self._attempts[handle]
        end = time.monotonic() + timeout
        while time.monotonic() < end and not (attempt.poll() is not None and attempt.quiesced()):
            time.sleep(0.001)
        return attempt.poll(), attempt.quiesced()

    def cancel(self, handle: int) -> None:
        self._attempts[handle].cancel()

    def write(self, region: str, slots: Index, data: bytes) -> None:
        self.memory.write(region, slots, data)

    def read(self, region: str, slots: Index) -> bytes:
        return self.memory.read(region, slots)

    def inject_fault(self, rows: int | None) -> bool:
        if self._inject is None:
            return False
        self._inject(rows)
        return True

    def shutdown(self) -> int:
        return len(self.backend.shutdown())


@dataclass
class Pair:
    """A connected pair: ``local`` is under test; ``peer`` is the other end."""

    local: Backend
    local_memory: RowMemory
    local_regions: tuple[SlotRegion, ...]
    peer: PeerEnd
    mode: TransferMode
    inject_local_fault: Callable[[int | None], None] | None = None
    close: Callable[[], None] = field(default=lambda: None)
    peer_hears: bool = True
    """Whether this end's submissions can reach the peer at all (a peer backend: the active
    end tells the passive one). False over a store, whose two ends never talk: each puts or
    gets its own rows, so checks that a refusal "told the peer nothing" observe nothing there."""


PairFactory = Callable[[TransferMode], Pair]
