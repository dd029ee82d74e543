"""Blocks of one layer group: free stack, reference counts, lender pins, prefix cache.

A block is in exactly one of: free (on the stack), cached (refcount 0, named, unpinned:
evictable, least recently used first), or held (refcount > 0 or pinned or retained).
Pins come from leases: a pinned block is never freed, evicted or handed out again until
every pin is gone, whatever its requests did meanwhile. Retained blocks (kept after a
forced shutdown because some access may still land) never come back at all.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from kvxfer.contract import KvxferError


class PoolExhausted(KvxferError):
    """Not enough free or evictable blocks in a layer group; nothing was allocated."""


class BlockAllocator:
    """Blocks ``0 .. num_blocks-1`` of one group. All index work is int64 numpy arrays."""

    def __init__(self, group: str, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"group {group!r}: num_blocks must be positive, got {num_blocks}")
        self.group = group
        self.num_blocks = num_blocks
        self.refcount = np.zeros(num_blocks, dtype=np.int32)
        self.pins = np.zeros(num_blocks, dtype=np.int32)
        self.write_pins = np.zeros(num_blocks, dtype=np.int32)
        self.retained = np.zeros(num_blocks, dtype=np.bool_)
        self._free = np.arange(num_blocks - 1, -1, -1, dtype=np.int64)  # a stack: top at the end
        self._nfree = num_blocks
        self._is_free = np.ones(num_blocks, dtype=np.bool_)
        self.named = np.zeros(num_blocks, dtype=np.bool_)  # in _key_of: index work stays vectorized
        self._lru: OrderedDict[int, None] = OrderedDict()  # cached, evictable blocks
        self._key_of: dict[int, bytes] = {}
        self._by_key: dict[bytes, int] = {}
        self._pending_key: dict[int, bytes] = {}  # named while write-pinned: applied at unpin

    # --- capacity -----------------------------------------------------------------------
    @property
    def free_count(self) -> int:
        return self._nfree

    @property
    def cached_count(self) -> int:
        return len(self._lru)

    def available(self, sharing: np.ndarray | None = None) -> int:
        """Blocks ``take`` can hand out, not counting cached blocks about to be shared."""
        lru = len(self._lru)
        if sharing is not None and sharing.size:
            lru -= sum(1 for b in sharing.tolist() if b in self._lru)
        return self._nfree + lru

    def take(self, n: int) -> np.ndarray:
        """``n`` blocks with refcount 1: free ones first, then evict least recently used."""
        if n == 0:
            return np.zeros(0, dtype=np.int64)
        if n > self.available():
            raise PoolExhausted(
                f"group {self.group!r}: need {n} blocks, {self._nfree} free and {len(self._lru)} evictable"
            )
        from_free = min(n, self._nfree)
        out = self._free[self._nfree - from_free: self._nfree][::-1].copy()
        self._nfree -= from_free
        evicted = []
        for _ in range(n - from_free):
            block, _ = self._lru.popitem(last=False)
            self._forget_key(block)
            evicted.append(block)
        if evicted:
            out = np.concatenate((out, np.asarray(evicted, dtype=np.int64)))
        self._is_free[out] = False
        self.refcount[out] = 1
        return out

    # --- references -----------------------------------------------------------------------
    def lookup(self, key: bytes) -> int | None:
        return self._by_key.get(key)

    def share(self, blocks: np.ndarray) -> None:
        """One more request holds each of ``blocks`` (cached ones leave the evictable list)."""
        np.add.at(self.refcount, blocks, 1)
        for b in blocks.tolist():
            self._lru.pop(b, None)

    def drop(self, blocks: np.ndarray) -> None:
        """One request fewer holds each of ``blocks``; idle ones go back (deferred if pinned)."""
        if blocks.size == 0:
            return
        np.subtract.at(self.refcount, blocks, 1)
        if (self.refcount[blocks] < 0).any():
            raise AssertionError(f"group {self.group!r}: refcount below zero")
        self._settle(blocks)

    def name(self, block: int, key: bytes) -> None:
        """Make ``block`` shareable under ``key`` (first name wins; deferred while write-pinned;
        never for a retained block)."""
        if block in self._key_of or key in self._by_key or self.retained[block]:
            return
        if self.write_pins[block] > 0:
            self._pending_key[block] = key
            return
        self._key_of[block] = key
        self._by_key[key] = block
        self.named[block] = True

    def key_of(self, block: int) -> bytes | None:
        return self._key_of.get(block)

    def unname(self, blocks: np.ndarray) -> None:
        """``blocks`` will no longer hold what their names stand for (a shrink cut into them,
        or their only holder is about to write them): forget their names, pending ones too."""
        for b in blocks[self.named[blocks]].tolist():
            self._forget_key(b)
        if self._pending_key:
            pending = np.fromiter(self._pending_key, dtype=np.int64, count=len(self._pending_key))
            for b in blocks[np.isin(blocks, pending)].tolist():
                self._pending_key.pop(b, None)

    def claim_for_write(self, blocks: np.ndarray, what: str) -> None:
        """``blocks`` are about to be written by their one holder: refuse shared blocks (no
        copy on write), and drop names, since the bytes will differ from what they name."""
        if (self.refcount[blocks] > 1).any():
            raise ValueError(f"{what} lie in blocks shared with another request")
        self.unname(blocks)

    def _forget_key(self, block: int) -> None:
        key = self._key_of.pop(block, None)
        if key is not None:
            self._by_key.pop(key, None)
        self.named[block] = False
        self._pending_key.pop(block, None)

    # --- pins -----------------------------------------------------------------------------
    def pin(self, blocks: np.ndarray, write: bool) -> None:
        """One more lease holds each of ``blocks`` (distinct, as one request's blocks are)."""
        self.pins[blocks] += 1
        if write:
            self.write_pins[blocks] += 1

    def unpin(self, blocks: np.ndarray, write: bool) -> None:
        if blocks.size == 0:
            return
        self.pins[blocks] -= 1
        if write:
            self.write_pins[blocks] -= 1
            if self._pending_key:
                for b in blocks.tolist():
                    if self.write_pins[b] == 0 and b in self._pending_key:
                        self.name(b, self._pending_key.pop(b))
        self._settle(blocks)

    def retain(self, blocks: np.ndarray) -> None:
        """Never hand these blocks out again (some access to them may still land): not as
        free blocks, and not through a prefix name either, so their names go too."""
        self.retained[blocks] = True
        for b in blocks.tolist():
            self._forget_key(b)
            self._lru.pop(b, None)

    def unretain(self, blocks: np.ndarray) -> None:
        """``retain`` undone, once nothing can touch these blocks: they go back to their
        request, or to the free list when no request or lease holds them."""
        self.retained[blocks] = False
        self._settle(blocks)

    def _settle(self, blocks: np.ndarray) -> None:
        idle = blocks[(self.refcount[blocks] == 0) & (self.pins[blocks] == 0)
                      & ~self.retained[blocks] & ~self._is_free[blocks]]
        if idle.size == 0:
            return
        idle = np.unique(idle)
        named = self.named[idle]
        for b in idle[named].tolist():
            self._lru[b] = None
            self._lru.move_to_end(b)
        plain = idle[~named]
        if self._pending_key:
            for b in plain.tolist():
                self._pending_key.pop(b, None)
        self._free[self._nfree: self._nfree + plain.size] = plain
        self._nfree += plain.size
        self._is_free[plain] = True

    def reset_names(self) -> None:
        """Forget every prefix name; cached blocks become free (a scope change)."""
        cached = np.asarray(list(self._lru), dtype=np.int64)
        self._lru.clear()
        self._key_of.clear()
        self._by_key.clear()
        self._pending_key.clear()
        self.named[:] = False
        if cached.size:
            self._free[self._nfree: self._nfree + cached.size] = cached
            self._nfree += cached.size
            self._is_free[cached] = True
