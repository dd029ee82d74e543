"""A blob driver that misbehaves on cue, around a real one (MemoryDriver, ShmDriver).

Real stores and their clients do more than raise StoreError: a directory another process
writes races a stat into FileNotFoundError, a client answers fewer statuses than keys, a call
hangs. ``FaultyDriver`` wraps a working driver and does these on purpose, planned per call
(``plan``), at random from a seed (``chaos``), or for every call while held (``hold``), and
records what a test checks afterwards: calls in flight, unregistrations, closes and whether
one came during a call.

    driver = FaultyDriver(MemoryDriver(store))
    driver.plan("put", Fault.RAISE)               # the next put raises FileNotFoundError
    driver.hold(); ...; driver.stuck.wait(5)      # a call is now blocked in the driver
    driver.release()

A call whose keys are all row digests (``BlobBackend``'s integrity: ``DIGEST_SUFFIX``) passes
straight to the real driver, neither counted nor faulted nor held: faults land on the calls
that move rows, one per batch, as before digests were stored.
"""

from __future__ import annotations

import enum
import errno
import random
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from typing import Any

from kvxfer.backends.blob import BlobDriver, KeyStatus, Span
from kvxfer.backends.blob.digests import DIGEST_SUFFIX
from kvxfer.contract import IndexArray

OPS = ("put", "get", "exists")


class Fault(enum.Enum):
    RAISE = "raise"  # raise before the real call: memory untouched, nothing stored
    RAISE_AFTER = "raise after"  # make the real call, then raise: rows may be stored or written
    SHORT = "short"  # the real answer without its last value
    LONG = "long"  # the real answer and one value more
    NOT_A_STATUS = "not a status"  # the real answer with its first value as a str ("ok", "yes")
    NOT_A_LIST = "not a list"  # None instead of the answer
    STALL = "stall"  # a short pause (``stall_s``) before the real call


def file_gone() -> BaseException:
    """What ``ShmDriver.put`` raised when a key's file went between its exists() and stat()."""
    return FileNotFoundError(errno.ENOENT, "No such file or directory", "/dev/shm/kvxfer-store/<key>")


class FaultyDriver(BlobDriver):
    def __init__(self, inner: BlobDriver, *, error: Callable[[], BaseException] = file_gone,
                 stall_s: float = 0.002) -> None:
        self.inner = inner
        self.name = inner.name
        self.error = error  # what RAISE and RAISE_AFTER raise (made fresh per call)
        self.stall_s = stall_s
        self._lock = threading.Lock()
        self._planned: dict[str, deque[Fault | None]] = {op: deque() for op in OPS}
        self._chaos: tuple[random.Random, float, tuple[Fault, ...]] | None = None
        self._gate = threading.Event()
        self._gate.set()
        self.stuck = threading.Event()  # set once a call waits at the closed gate (hold)
        self.in_call = 0  # put, get and exists calls running now
        self.calls: Counter[str] = Counter()
        self.injected: Counter[Fault] = Counter()
        self.unregistered: list[Span] = []
        self.closes = 0
        self.closed_during_call = False

    # --- the faults ---------------------------------------------------------------------------
    def plan(self, op: str, *faults: Fault | None) -> None:
        """The next calls of ``op`` (put, get, exists) get ``faults`` in order (None: no fault)."""
        if op not in OPS:
            raise ValueError(f"op must be one of {OPS}, got {op!r}")
        with self._lock:
            self._planned[op].extend(faults)

    def chaos(self, seed: int, rate: float, faults: Sequence[Fault] = tuple(Fault)) -> None:
        """From now on each unplanned call gets one of ``faults`` with probability ``rate``;
        rate 0 ends it."""
        with self._lock:
            self._chaos = (random.Random(seed), rate, tuple(faults)) if rate > 0 else None

    def hold(self) -> None:
        """Every put, get and exists call from now on waits in the driver until ``release``."""
        self.stuck.clear()
        self._gate.clear()

    def release(self) -> None:
        self._gate.set()

    def _draw(self, op: str) -> Fault | None:
        with self._lock:
            self.calls[op] += 1
            self.in_call += 1
            if self._planned[op]:
                fault = self._planned[op].popleft()
            elif self._chaos is not None and self._chaos[0].random() < self._chaos[1]:
                fault = self._chaos[0].choice(self._chaos[2])
            else:
                fault = None
            if fault is not None:
                self.injected[fault] += 1
            return fault

    def _call(self, op: str, real: Callable[[], list[Any]]) -> Any:
        fault = self._draw(op)
        try:
            if not self._gate.is_set():
                self.stuck.set()
                self._gate.wait()
            if fault is Fault.RAISE:
                raise self.error()
            if fault is Fault.STALL:
                time.sleep(self.stall_s)  # the fault itself: a store that answers late
            answer = real()
            if fault is Fault.RAISE_AFTER:
                raise self.error()
            return _spoil(answer, fault)
        finally:
            with self._lock:
                self.in_call -= 1

    # --- the driver ---------------------------------------------------------------------------
    def register(self, span: Span) -> None:
        self.inner.register(span)

    def unregister(self, span: Span) -> None:
        self.unregistered.append(span)
        self.inner.unregister(span)

    def put(self, keys: Sequence[bytes], addresses: IndexArray, sizes: IndexArray) -> list[KeyStatus]:
        if _digests_only(keys):
            return self.inner.put(keys, addresses, sizes)
        return self._call("put", lambda: self.inner.put(keys, addresses, sizes))

    def get(self, keys: Sequence[bytes], addresses: IndexArray, sizes: IndexArray) -> list[KeyStatus]:
        if _digests_only(keys):
            return self.inner.get(keys, addresses, sizes)
        return self._call("get", lambda: self.inner.get(keys, addresses, sizes))

    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        return self._call("exists", lambda: self.inner.exists(keys))

    def remove(self, keys: Sequence[bytes]) -> list[KeyStatus]:
        return self.inner.remove(keys)

    def close(self) -> None:
        with self._lock:
            self.closes += 1
            self.closed_during_call |= self.in_call > 0
        self.inner.close()


def _spoil(answer: list[Any], fault: Fault | None) -> Any:
    if fault is Fault.SHORT:
        return answer[:-1]
    if fault is Fault.LONG:
        return [*answer, *(answer[:1] or [KeyStatus.OK])]
    if fault is Fault.NOT_A_STATUS and answer:
        first = answer[0]
        return [first.value if isinstance(first, KeyStatus) else "yes", *answer[1:]]
    if fault is Fault.NOT_A_LIST:
        return None
    return answer


def _digests_only(keys: Sequence[bytes]) -> bool:
    return bool(keys) and all(k.endswith(DIGEST_SUFFIX) for k in keys)
