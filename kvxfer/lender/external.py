"""Leases over an engine's own KV: rows of its block table, lent with no copy and no pool.

::

    kv = EngineKV.per_layer(engine_tensors, kv_heads=8, heads=(0, 4))
    lender = ExternalLender(kv)
    backend.register(lender.regions)
    lease = lender.lend_write("req-1", block_table, (0, 4096))   # the engine's block ids, in order
    hint = backend.describe(lease.view())                        # ... fetch, then:
    lease.track(attempt); lease.mark_arrived(outcome.masks); lease.release()
    lease.usable_until                                           # tokens in place from the start
    lender.busy(blocks)                                          # blocks the engine must not reuse yet

The engine owns its blocks; the lender keeps the promise that matters for safety: until
every attempt on a released lease has quiesced, ``busy`` says its blocks are still in use,
and the engine must not hand them to another request. Two leases never write one block at
once, and no block is read while another lease may write it.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvxfer.contract import (
    Attempt,
    BoolArray,
    CacheKind,
    InvalidSubmission,
    LayerGroupRows,
    TokenRange,
    View,
    check_masks,
)
from kvxfer.lender.base import LeaseError
from kvxfer.lender.engine_kv import EngineKV

GROUP = "kv"
_ids = itertools.count(1)


class ExternalLease:
    """Blocks of one request lent for reading (to send) or writing (to receive)."""

    def __init__(self, lender: ExternalLender, request: str, tokens: TokenRange, write: bool,
                 blocks: np.ndarray, view: View) -> None:
        self.id = next(_ids)
        self.lender = lender
        self.request = request
        self.tokens = tokens
        self.write = write
        self.blocks = blocks
        self._view = view
        self._attempts: list[Attempt] = []
        self._arrived: BoolArray | None = None
        self._released = False

    def view(self) -> View:
        return self._view

    @property
    def released(self) -> bool:
        return self._released

    def track(self, attempt: Attempt) -> None:
        """Keep the blocks busy after release until ``attempt`` quiesced."""
        if self._released:
            raise LeaseError(f"lease {self.id} of {self.request!r} is released; track attempts before release")
        self._attempts.append(attempt)

    def unquiesced(self) -> int:
        return sum(1 for a in self._attempts if not a.quiesced())

    def mark_arrived(self, masks: Sequence[Any]) -> None:
        """Write leases, once: the blocks True in ``masks`` (``outcome.masks``) hold the peer's KV."""
        if not self.write:
            raise LeaseError(f"lease {self.id} of {self.request!r} lends for reading: nothing arrives into it")
        if self._arrived is not None:
            raise LeaseError(f"lease {self.id} of {self.request!r}: arrivals were marked already")
        arrays = [np.asarray(m) for m in masks]
        try:
            check_masks(self._view, arrays)
        except ValueError as exc:
            raise InvalidSubmission(f"lease {self.id} of {self.request!r}: {exc}") from None
        self._arrived = arrays[0].astype(np.bool_)

    @property
    def usable_until(self) -> int:
        """The token up to which KV is in place, from the lease's first token (its start when
        nothing arrived). A block that arrived after one that did not does not count."""
        if self._arrived is None:
            return self.tokens.start
        missing = np.flatnonzero(~self._arrived)
        rows = self._view.groups[0]
        if missing.size == 0:
            return self.tokens.end
        block_tokens = self.lender.kv.geometry.block_tokens
        return max(self.tokens.start, int(rows.ordinals[missing[0]]) * block_tokens)

    def release(self) -> None:
        """End the lease (idempotent); the blocks stay busy until tracked attempts quiesced."""
        self.lender.release(self)

    def __repr__(self) -> str:
        return f"<ExternalLease {self.id} {'write' if self.write else 'read'} {self.request!r} [{self.tokens.start}, {self.tokens.end})>"


class ExternalLender:
    """Lends blocks of an engine's KV (an ``EngineKV``) under leases."""

    def __init__(self, kv: EngineKV) -> None:
        if not isinstance(kv, EngineKV):
            raise TypeError(f"ExternalLender takes an EngineKV, got {type(kv).__name__}")
        self.kv = kv
        self._leases: dict[int, ExternalLease] = {}
        self._releasing: dict[int, ExternalLease] = {}
        self._closed = False

    @property
    def regions(self) -> tuple:  # type: ignore[type-arg]
        return self.kv.regions

    def lend_read(self, request: str, block_table: Any, tokens: TokenRange | tuple[int, int],
                  heads: tuple[int, int] | None = None) -> ExternalLease:
        """Lend the blocks holding ``tokens`` of ``request`` (``block_table[i]``: the block of
        logical block i) for reading."""
        return self._lend(request, block_table, tokens, write=False, heads=heads)

    def lend_write(self, request: str, block_table: Any, tokens: TokenRange | tuple[int, int],
                   heads: tuple[int, int] | None = None) -> ExternalLease:
        """Lend them for writing. ``heads`` narrows the view to the heads one source provides
        (a TP rank fetching its heads from several peers takes one lease per source)."""
        return self._lend(request, block_table, tokens, write=True, heads=heads)

    def busy(self, blocks: Any) -> BoolArray:
        """Per block: True while a lease, or an attempt of a released one, may touch it."""
        self.reclaim()
        ids = np.asarray(blocks, dtype=np.int64)
        held = self._held(write_only=False)
        return np.isin(ids, held)

    def reclaim(self) -> None:
        done = [lease for lease in self._releasing.values() if lease.unquiesced() == 0]
        for lease in done:
            del self._releasing[lease.id]

    @property
    def open_leases(self) -> int:
        return len(self._leases)

    def release(self, lease: ExternalLease) -> None:
        if not isinstance(lease, ExternalLease) or lease.lender is not self:
            raise LeaseError(f"{lease!r} is not a lease of this lender")
        if lease._released:
            return
        lease._released = True
        self._leases.pop(lease.id, None)
        self._releasing[lease.id] = lease
        self.reclaim()

    def shutdown(self, force: bool = False) -> int:
        """Stop lending; LeaseError while leases are open or attempts unquiesced, unless
        ``force``. Returns how many blocks stay busy (the engine must not reuse them)."""
        self.reclaim()
        busy = len(self._leases) + len(self._releasing)
        if busy and not force:
            raise LeaseError(f"{len(self._leases)} leases open and {len(self._releasing)} released leases "
                             "waiting for attempts: release them, or shutdown(force=True)")
        self._closed = True
        return int(self._held(write_only=False).size)

    # --- internals -------------------------------------------------------------------------
    def _held(self, *, write_only: bool) -> np.ndarray:
        leases = [*self._leases.values(), *self._releasing.values()]
        parts = [lease.blocks for lease in leases if lease.write or not write_only]
        return np.unique(np.concatenate(parts)) if parts else np.zeros(0, dtype=np.int64)

    def _lend(self, request: str, block_table: Any, tokens: TokenRange | tuple[int, int], *, write: bool,
              heads: tuple[int, int] | None) -> ExternalLease:
        if self._closed:
            raise LeaseError("the lender is shut down")
        span = tokens if isinstance(tokens, TokenRange) else TokenRange(*tokens)
        geometry = self.kv.geometry
        table = np.asarray(block_table, dtype=np.int64)
        if table.ndim != 1:
            raise LeaseError(f"request {request!r}: the block table must be one-dimensional, got shape {table.shape}")
        bt = geometry.block_tokens
        first, end = span.start // bt, -(-span.end // bt)
        if end > table.size:
            raise LeaseError(f"request {request!r}: tokens up to {span.end} need {end} blocks, the block table has "
                             f"{table.size}")
        ordinals = np.arange(first, end, dtype=np.int64)
        blocks = table[first:end].copy()
        if blocks.size and (int(blocks.min()) < 0 or int(blocks.max()) >= geometry.blocks):
            raise LeaseError(f"request {request!r}: the block table names a block outside [0, {geometry.blocks})")
        if np.unique(blocks).size != blocks.size:
            raise LeaseError(f"request {request!r}: the block table names one block twice")
        self.reclaim()
        clash = np.intersect1d(blocks, self._held(write_only=not write))
        if clash.size:
            raise LeaseError(f"request {request!r}: block {int(clash[0])} is lent to another lease "
                             f"{'(any lease blocks a write)' if write else 'for writing'}")
        view_geometry = geometry if heads is None else geometry.narrowed(*heads)
        region = geometry.regions[0]
        rows = LayerGroupRows(GROUP, CacheKind.PAGED, region, blocks, ordinals)
        view = View(request, span, (rows,), layout=self.kv.layout, geometry=view_geometry)
        lease = ExternalLease(self, request, span, write, blocks, view)
        self._leases[lease.id] = lease
        return lease
