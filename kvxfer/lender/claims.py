"""One lender per memory: the process's claims on the memory its lenders lend.

A lender pins blocks so that nothing reuses them while a transfer may touch them. Two
lenders over one pool (or one engine's tensors) would each believe they own the pins:
each would lend for writing a block the other lends, and each would let its owner reuse a
block the other still pins. So a lender claims its memory when it is made, and a second
lender over any byte of it is refused (``AlreadyLent``, naming both). The claim ends when
its lender shuts down or is collected: the registry holds lenders by weak reference only,
and a finalizer drops the claim of a lender nobody holds any more.

Memory is named by its regions (``SlotRegion``: kind, device, address, bytes). Regions of
another process's memory (an ``EngineKV`` without tensors: a peer's blocks, lent from here)
are a space of their own, compared only with each other: their addresses mean nothing in
this process. While a claim lives, its lender keeps its memory alive (the pool or the
tensors), so an address range cannot be handed to other memory meanwhile.
"""

from __future__ import annotations

import gc
import itertools
import threading
import weakref
from collections.abc import Iterable
from dataclasses import dataclass

from kvxfer.contract import SlotRegion
from kvxfer.lender.errors import AlreadyLent

# Reentrant: a finalizer may run (garbage collection) while this thread holds the lock.
_lock = threading.RLock()
_claims: dict[int, _Entry] = {}
_tokens = itertools.count(1)
# Claims that ended, dropped from _claims under the lock before it is next read. A finalizer
# (a lender collected) may run in the middle of any allocation, the iteration over _claims
# included: it only appends here, so the dict never changes size while it is read.
_ended: list[int] = []


@dataclass(frozen=True)
class _Entry:
    owner: weakref.ref[object]
    regions: tuple[SlotRegion, ...]
    local: bool
    what: str


class Claim:
    """A lender's hold on its memory; ``release()`` ends it (idempotent, and automatic when
    the lender is collected)."""

    def __init__(self, token: int, owner: object) -> None:
        self.token = token
        self._finalizer = weakref.finalize(owner, _drop, token)
        self._finalizer.atexit = False

    def release(self) -> None:
        self._finalizer()

    @property
    def alive(self) -> bool:
        return self._finalizer.alive


def claim(owner: object, regions: Iterable[SlotRegion], what: str, *, local: bool = True) -> Claim:
    """Claim ``regions`` (``what`` names them in errors) for ``owner``; AlreadyLent when a
    live lender holds any byte of them. ``local``: False for another process's memory."""
    wanted = tuple(regions)
    with _lock:
        clashes = _clash(wanted, local) is not None
    if clashes:
        # A lender nobody can reach any more, kept only by a reference cycle (its open
        # leases point back at it), is let go, not mistaken for a live one. Outside the
        # lock: the collection runs finalizers of anything, and one that waits for a thread
        # waiting for this lock would never return. Looked at again below, under it.
        gc.collect()
    with _lock:
        found = _clash(wanted, local)
        if found is not None:
            other, region = found
            raise AlreadyLent(f"{what} is lent already by {other!r} (its region {region.name!r} overlaps): one "
                              "lender per pool; shut that lender down, or let it go, before lending again")
        token = next(_tokens)
        _claims[token] = _Entry(weakref.ref(owner), wanted, local, what)
        return Claim(token, owner)


def _clash(wanted: tuple[SlotRegion, ...], local: bool) -> tuple[object, SlotRegion] | None:
    while _ended:
        _claims.pop(_ended.pop(), None)
    for token, entry in list(_claims.items()):
        owner = entry.owner()
        if owner is None:  # collected; its finalizer is about to run
            _claims.pop(token, None)
            continue
        if entry.local != local:
            continue
        region = next((b for b in entry.regions if any(a.overlaps(b) for a in wanted)), None)
        if region is not None:
            return owner, region
    return None


def holder(regions: Iterable[SlotRegion], *, local: bool = True) -> object | None:
    """The live lender that claims any byte of ``regions``, if one does."""
    with _lock:
        found = _clash(tuple(regions), local)
    return None if found is None else found[0]


def _drop(token: int) -> None:
    _ended.append(token)  # no lock, no dict change: see _ended
