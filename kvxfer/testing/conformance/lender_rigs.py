"""Lenders set up for the lender checks (``lender_checks``): each with memory of its own and
its owner's side, a pool, or an engine's block tables, reference counts and free list.

A rig gives the checks one vocabulary over both kinds of lender: requests of whole blocks
(``BLOCK_TOKENS`` tokens each), lent from token 0. ``make_rig(kind)`` builds one of
``RIG_KINDS``; a lender of your own gets a rig of the same shape (``LenderRig``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import numpy as np
import torch

from kvxfer.lender import ExternalLender, InPlaceLender, Lender, StagingLender
from kvxfer.lender.engine_kv import EngineKV
from kvxfer.pool import LayerGroupSpec, PagedKVPool

BLOCK_TOKENS = 4
BLOCKS = 16
RIG_KINDS = ("inplace", "staging", "external")
_SPEC = LayerGroupSpec("full", layers=2, block_tokens=BLOCK_TOKENS, kv_heads=2, head_dim=8)


class LenderRig(Protocol):
    """A lender under test and the owner of its memory, driven as the checks need."""

    lender: Any

    def commit(self, request: str, blocks: int) -> None:
        """Give ``request`` ``blocks`` blocks of written KV, full blocks shareable by prefix."""

    def lend_read(self, request: str, blocks: int) -> Any:
        """A read lease over the committed request's first ``blocks`` blocks."""

    def lend_write(self, request: str, blocks: int) -> Any:
        """A new request of ``blocks`` empty blocks, lent for writing."""

    def lend_write_shared(self, request: str, donor: str, blocks: int) -> Any:
        """A new request of ``blocks`` blocks whose first is ``donor``'s first, shared by
        prefix (the owner says so), lent for writing."""

    def blocks_of(self, request: str) -> np.ndarray:
        """The owner's blocks holding ``request``, in order."""

    def usable(self, request: str, lease: Any) -> int:
        """Tokens of ``request`` in place from token 0, as the lender counts them after ``lease``."""

    def free(self, request: str) -> None:
        """The owner frees ``request``; the lender's rules decide when its blocks are reused."""

    def reclaim(self) -> None:
        """The owner's periodic call: blocks and leases whose attempts quiesced come back."""

    def reusable(self, blocks: np.ndarray) -> np.ndarray:
        """Per block: whether the owner may hand it to another request now."""

    def new_lender(self) -> Any:
        """Another lender over the same memory (the rig keeps using its own)."""


def make_rig(kind: str) -> LenderRig:
    """A rig of ``kind`` (one of ``RIG_KINDS``), on the host."""
    if kind == "inplace":
        return PoolRig(InPlaceLender)
    if kind == "staging":
        return PoolRig(lambda pool: StagingLender(pool, fetch_tokens=4 * BLOCK_TOKENS, max_fetches=4,
                                                  max_bytes=1 << 20))
    if kind == "external":
        return EngineRig()
    raise ValueError(f"rig kind must be one of {RIG_KINDS}, got {kind!r}")


def _token_ids(request: str, blocks: int) -> list[int]:
    seed = sum(request.encode())
    return [(seed * 31 + i) % 1000 for i in range(blocks * BLOCK_TOKENS)]


class PoolRig:
    """A pool lender (in place or staging) over a pool of its own; the pool is the owner."""

    def __init__(self, make: Callable[[PagedKVPool], Lender]) -> None:
        self.pool = PagedKVPool([_SPEC], BLOCKS, scope=b"lender-conformance")
        self.make = make
        self.lender: Lender = make(self.pool)

    def commit(self, request: str, blocks: int) -> None:
        n = blocks * BLOCK_TOKENS
        self.pool.allocate(request, n)
        self.pool.commit(request, n, token_ids=_token_ids(request, blocks))

    def lend_read(self, request: str, blocks: int) -> Any:
        return self.lender.lend_read(request, (0, blocks * BLOCK_TOKENS))

    def lend_write(self, request: str, blocks: int) -> Any:
        self.pool.allocate(request, 0)
        return self.lender.lend_write(request, (0, blocks * BLOCK_TOKENS))

    def lend_write_shared(self, request: str, donor: str, blocks: int) -> Any:
        ids = _token_ids(donor, 1) + _token_ids(request, blocks)[BLOCK_TOKENS:]
        self.pool.allocate(request, blocks * BLOCK_TOKENS, token_ids=ids)
        return self.lender.lend_write(request, (0, blocks * BLOCK_TOKENS))

    def blocks_of(self, request: str) -> np.ndarray:
        return self.pool.block_table(request, _SPEC.name).copy()

    def usable(self, request: str, lease: Any) -> int:
        bounds = self.lender.readiness(request)
        return 0 if bounds is None else bounds.usable_until

    def free(self, request: str) -> None:
        self.pool.free(request)

    def reclaim(self) -> None:
        self.lender.reclaim()

    def reusable(self, blocks: np.ndarray) -> np.ndarray:
        alloc = self.pool.allocator(_SPEC.name)
        return (alloc.refcount[blocks] == 0) & (alloc.pins[blocks] == 0) & ~alloc.retained[blocks]

    def new_lender(self) -> Any:
        return self.make(self.pool)


class EngineRig:
    """An ExternalLender over an engine stand-in: per-layer tensors, block tables, reference
    counts (prefix sharing) and a free list, every free going through ``ExternalLender.free``."""

    def __init__(self) -> None:
        tensors = [torch.zeros(2, BLOCKS, BLOCK_TOKENS, _SPEC.kv_heads, _SPEC.head_dim) for _ in range(_SPEC.layers)]
        self.kv = EngineKV.per_layer(tensors, kv_heads=_SPEC.kv_heads, scope=b"lender-conformance",
                                     name="conformance-engine")
        self.lender = ExternalLender(self.kv)
        self.tables: dict[str, np.ndarray] = {}
        self.refs = np.zeros(BLOCKS, dtype=np.int64)
        self.free_list = np.ones(BLOCKS, dtype=np.bool_)

    def _take(self, n: int) -> np.ndarray:
        got = np.flatnonzero(self.free_list)[:n]
        if got.size < n:
            raise RuntimeError(f"the engine stand-in has {got.size} free blocks, {n} asked")
        self.free_list[got] = False
        self.refs[got] += 1
        return got.astype(np.int64)

    def commit(self, request: str, blocks: int) -> None:
        self.tables[request] = self._take(blocks)

    def lend_read(self, request: str, blocks: int) -> Any:
        return self.lender.lend_read(request, self.tables[request], (0, blocks * BLOCK_TOKENS))

    def lend_write(self, request: str, blocks: int) -> Any:
        self.tables[request] = self._take(blocks)
        return self.lender.lend_write(request, self.tables[request], (0, blocks * BLOCK_TOKENS))

    def lend_write_shared(self, request: str, donor: str, blocks: int) -> Any:
        first = self.tables[donor][:1]
        self.refs[first] += 1
        self.tables[request] = np.concatenate((first, self._take(blocks - 1)))
        return self.lender.lend_write(request, self.tables[request], (0, blocks * BLOCK_TOKENS), shared=first)

    def blocks_of(self, request: str) -> np.ndarray:
        return self.tables[request].copy()

    def usable(self, request: str, lease: Any) -> int:
        return int(lease.usable_until)

    def free(self, request: str) -> None:
        table = self.tables.pop(request)
        self.refs[table] -= 1
        gone = table[self.refs[table] == 0]
        self.free_list[self.lender.free(gone, defer=True)] = True

    def reclaim(self) -> None:
        self.free_list[self.lender.reclaim()] = True

    def reusable(self, blocks: np.ndarray) -> np.ndarray:
        return self.free_list[blocks].copy()

    def new_lender(self) -> Any:
        return ExternalLender(self.kv)
