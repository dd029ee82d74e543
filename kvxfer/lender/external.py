"""Leases over an engine's own KV: rows of its block table, lent with no copy and no pool.

::

    kv = EngineKV.per_layer(engine_tensors, kv_heads=8, heads=(0, 4))
    lender = ExternalLender(kv)                                   # one lender per EngineKV's memory
    backend.register(lender.regions)
    lease = lender.lend_write("req-1", block_table, (0, 4096),   # the engine's block ids, in order
                              shared=prefix_blocks)              # blocks other requests share: refused
    hint = backend.describe(lease.view())                        # ... fetch, then:
    lease.track(attempt); lease.mark_arrived(outcome.masks); lease.release()
    lease.usable_until                                           # tokens in place from the start
    reusable = lender.free(blocks, defer=True)                   # the engine frees blocks: those it may reuse now
    reusable = lender.reclaim()                                  # later: the deferred blocks now safe

    lenders = ExternalLender.for_groups({"full": kv_full, "sliding": kv_sliding})  # a hybrid cache

An engine whose cache holds layer groups of different geometries over one memory (full and
sliding-window attention, each with its own block size and its own block ids) lends each
group with a lender of its own, from ``for_groups``: the lenders hold one claim on the memory
together (no other lender can lend it), each keeps its own group's blocks (a block id means
a block of that group only), and its views name their rows by the group. A request then
moves as one lease, one view and one transfer per group.

The engine owns its blocks and keeps the lender's rules through two calls. Its block free
goes through ``free(blocks)``: a block that a lease, or an attempt of a released lease that
has not quiesced, may still touch is refused (``BlocksBusy``, naming the blocks), or with
``defer=True`` handed to the lender, which gives it back from ``reclaim()`` once nothing can
touch it. A block so handed over cannot be lent again until it comes back, and a lease
whose blocks were freed counts no arrival. ``reset()`` says the KV's meaning changed (new
weights): lending stops for good, and the busy blocks come back by ``reclaim()``.

The rest is the pool lender's rules (``kvxfer.lender.base``): bool masks only, one report
of arrival before release, two leases never write one block at once and no block is read
while another lease may write it, blocks the engine names as shared by prefix are not lent
for writing unless it allows it, one lender per memory (``AlreadyLent``), and ``shutdown``
refuses (``LenderBusy``) while leases hold memory, unless forced, reporting what stays
retained.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from kvxfer.contract import (
    Attempt,
    BoolArray,
    CacheKind,
    LayerGroupRows,
    SlotRegion,
    TokenRange,
    View,
)
from kvxfer.lender.base import ShutdownReport
from kvxfer.lender.claims import Claim, claim
from kvxfer.lender.engine_kv import EngineKV
from kvxfer.lender.errors import BlocksBusy, LeaseError, LenderBusy, LendingDisabled
from kvxfer.lender.marks import arrival_masks, check_markable

GROUP = "kv"
_ids = itertools.count(1)
_NONE = np.zeros(0, dtype=np.int64)


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
        self._void = False  # the engine freed (or reset) some of its blocks: arrivals count nothing

    def view(self) -> View:
        return self._view

    @property
    def released(self) -> bool:
        return self._released

    @property
    def arrived(self) -> bool:
        return self._arrived is not None

    def track(self, attempt: Attempt) -> None:
        """Keep the blocks busy after release until ``attempt`` quiesced."""
        if self._released:
            raise LeaseError(f"lease {self.id} of {self.request!r} is released; track attempts before release")
        self._attempts.append(attempt)

    def unquiesced(self) -> int:
        return sum(1 for a in self._attempts if not a.quiesced())

    def mark_arrived(self, masks: Sequence[Any]) -> None:
        """Write leases, once, before release: the blocks True in ``masks`` (bool arrays,
        ``outcome.masks``) hold the peer's KV."""
        lender = self.lender
        check_markable(self, write=self.write, arrived=self._arrived is not None, released=self._released,
                       disabled=lender._disabled if lender._closed else None)
        self._arrived = arrival_masks(self, self._view, masks)[0]

    @property
    def usable_until(self) -> int:
        """The token up to which KV is in place, from the lease's first token (its start when
        nothing arrived, or when the engine freed its blocks meanwhile). A block that arrived
        after one that did not does not count."""
        if self._arrived is None or self._void:
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
    """Lends blocks of an engine's KV (an ``EngineKV``) under leases; one per memory."""

    def __init__(self, kv: EngineKV, *, group: str = GROUP, _joint: _Joint | None = None) -> None:
        if not isinstance(kv, EngineKV):
            raise TypeError(f"ExternalLender takes an EngineKV, got {type(kv).__name__}")
        self.what = _what(kv.regions)
        self.group = group  # the name of its views' rows
        # A peer's EngineKV (no tensors here) is another process's memory: a space of its own.
        self._claim: Claim | _Share = (claim(self, kv.regions, self.what, local=bool(kv.tensors)) if _joint is None
                                       else _Share(_joint))
        self.kv = kv
        self._leases: dict[int, ExternalLease] = {}
        self._releasing: dict[int, ExternalLease] = {}
        self._deferred = _NONE  # freed by the engine, busy: handed back by reclaim()
        self._retained = _NONE  # kept out of use for good by a forced shutdown
        self._disabled: str | None = None
        self._closed = False

    @staticmethod
    def for_groups(kvs: Mapping[str, EngineKV]) -> dict[str, ExternalLender]:
        """One lender per layer group of an engine whose groups lie in the same memory, each
        with its own geometry (group name -> EngineKV): one claim on the union of their
        regions for all of them (AlreadyLent if another lender holds any byte of it), ended
        when the last of them shuts down or all are collected. Each lends, frees and reports
        its own group's blocks; its views name their rows ``group``."""
        groups = dict(kvs)
        if not groups:
            raise LeaseError("for_groups: no layer group given")
        for name, kv in groups.items():
            if not isinstance(name, str) or not name:
                raise LeaseError(f"for_groups: a group name must be a non-empty str, got {name!r}")
            if not isinstance(kv, EngineKV):
                raise TypeError(f"for_groups: group {name!r} is a {type(kv).__name__}, not an EngineKV")
        kinds = {bool(kv.tensors) for kv in groups.values()}
        if len(kinds) != 1:
            raise LeaseError("for_groups: the groups mix this process's memory and a peer's")
        regions = tuple(dict.fromkeys(r for kv in groups.values() for r in kv.regions))
        joint = _Joint(len(groups), _what(regions), sorted(groups))
        joint.claim = claim(joint, regions, joint.what, local=kinds.pop())
        return {name: ExternalLender(kv, group=name, _joint=joint) for name, kv in groups.items()}

    @property
    def regions(self) -> tuple[SlotRegion, ...]:
        return self.kv.regions

    def __repr__(self) -> str:
        group = "" if self.group == GROUP else f" (group {self.group!r})"
        return f"<ExternalLender of {self.what}{group}>"

    # --- lending -------------------------------------------------------------------------------
    def lend_read(self, request: str, block_table: Any, tokens: TokenRange | tuple[int, int],
                  heads: tuple[int, int] | None = None) -> ExternalLease:
        """Lend the blocks holding ``tokens`` of ``request`` (``block_table[i]``: the block of
        logical block i) for reading."""
        return self._lend(request, block_table, tokens, write=False, heads=heads)

    def lend_write(self, request: str, block_table: Any, tokens: TokenRange | tuple[int, int],
                   heads: tuple[int, int] | None = None, *, shared: Any = None,
                   allow_shared: bool = False) -> ExternalLease:
        """Lend them for writing. ``heads`` narrows the view to the heads one source provides
        (a TP rank fetching its heads from several peers takes one lease per source).
        ``shared``: the blocks other requests share by prefix (block ids, or a bool mask over
        ``block_table``); lending one of them for writing is refused, since a peer would
        rewrite other requests' KV, unless ``allow_shared``."""
        return self._lend(request, block_table, tokens, write=True, heads=heads, shared=shared,
                          allow_shared=allow_shared)

    def busy(self, blocks: Any) -> BoolArray:
        """Per block: True while a lease, an attempt of a released one, or the lender (a
        deferred free not handed back yet, or a forced shutdown) holds it."""
        self._progress()
        return np.isin(np.asarray(blocks, dtype=np.int64), self._busy())

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
        self._progress()

    # --- the engine's notifications ----------------------------------------------------------
    def free(self, blocks: Any, *, defer: bool = False) -> np.ndarray:
        """The engine frees (or is about to reuse) ``blocks``; returns those it may reuse now.

        A block a lease or an unquiesced attempt may still touch is busy: BlocksBusy names
        them and nothing is recorded, unless ``defer``: then the lender holds them (a lease
        over them counts no arrival, and they cannot be lent) and ``reclaim()`` hands them back
        once nothing can touch them. A block a forced shutdown retained is refused by name
        (without ``defer``) and never returned."""
        ids = self._block_ids(blocks, "free")
        self._progress()
        kept = ids[np.isin(ids, self._retained)]
        if kept.size and not defer:
            raise BlocksBusy(f"blocks {_listed(kept)} are retained for good: a forced shutdown left them to a "
                             "transfer that may still touch them; never reuse them", kept)
        again = ids[np.isin(ids, self._deferred)]
        if again.size and not defer:
            raise BlocksBusy(f"blocks {_listed(again)} were freed already and are held by the lender until "
                             "reclaim() hands them back", again)
        busy = ids[np.isin(ids, self._held())]
        if busy.size and not defer:
            raise BlocksBusy(f"blocks {_listed(busy)} are busy: a lease, or an attempt of a released lease that has "
                             "not quiesced, may still touch them; free them with defer=True (reclaim() hands them "
                             "back) or once their attempts quiesced", busy)
        if busy.size:
            self._deferred = np.union1d(self._deferred, busy)
            self._void(busy)
        return ids[~np.isin(ids, self._busy())]

    def reset(self) -> np.ndarray:
        """The engine's KV changed meaning (new weights, a reuse reset): lending stops for good
        and every lease counts no arrival. Returns the blocks still busy: the engine may
        reuse all others now, and these once ``reclaim()`` hands them back."""
        self._progress()
        self._disabled = ("the engine reset its KV (reset()): lending is disabled for this lender; shut it down and "
                          "lend with a new one")
        held = self._held()
        self._deferred = np.union1d(self._deferred, held)
        self._void(held)
        return np.setdiff1d(self._deferred, self._retained)

    def reclaim(self) -> np.ndarray:
        """The blocks freed with ``defer`` (or busy at ``reset``) that nothing can touch any
        more, each handed back once; released leases whose attempts quiesced end too."""
        self._progress()
        if not self._deferred.size:
            return _NONE
        safe = np.setdiff1d(self._deferred, self._held())
        safe = safe[~np.isin(safe, self._retained)]
        self._deferred = np.setdiff1d(self._deferred, safe)
        return safe

    def shutdown(self, force: bool = False) -> ShutdownReport:
        """Stop lending. Refuses (LenderBusy) while leases are open or released leases wait
        for attempts, unless ``force``: then their blocks are retained for good and reported
        (``retained_blocks[group]``), with the deferred frees still busy. Every other block
        the engine freed here may be reused. The memory may get a lender again (once every
        lender of its ``for_groups`` shut down too)."""
        self._progress()
        open_leases, waiting = list(self._leases.values()), list(self._releasing.values())
        attempts = sum(lease.unquiesced() for lease in open_leases + waiting)
        if (open_leases or waiting) and not force:
            raise LenderBusy(f"{len(open_leases)} leases open and {len(waiting)} released leases holding memory "
                             f"({attempts} attempts not quiesced); release them, or shutdown(force=True)")
        held = self._held()
        self._retained = np.union1d(self._retained, held)
        self._deferred = _NONE
        self._leases.clear()
        self._releasing.clear()
        self._closed = True
        self._disabled = f"lender of {self.what} is shut down"
        self._claim.release()
        return ShutdownReport(len(open_leases), attempts, {self.group: held} if held.size else {})

    # --- internals -------------------------------------------------------------------------
    def _progress(self) -> None:
        done = [lease for lease in self._releasing.values() if lease.unquiesced() == 0]
        for lease in done:
            del self._releasing[lease.id]

    def _held(self, *, write_only: bool = False) -> np.ndarray:
        """Blocks of open leases and of released ones waiting for attempts."""
        leases = [*self._leases.values(), *self._releasing.values()]
        parts = [lease.blocks for lease in leases if lease.write or not write_only]
        return np.unique(np.concatenate(parts)) if parts else _NONE

    def _busy(self) -> np.ndarray:
        return np.union1d(np.union1d(self._held(), self._deferred), self._retained)

    def _void(self, blocks: np.ndarray) -> None:
        for lease in self._leases.values():
            if np.isin(lease.blocks, blocks).any():
                lease._void = True

    def _block_ids(self, blocks: Any, what: str) -> np.ndarray:
        ids = np.asarray(blocks)
        if ids.dtype == np.bool_ or not np.issubdtype(ids.dtype, np.integer) and ids.size:
            raise LeaseError(f"{what}: blocks must be block ids (ints), got dtype {ids.dtype}")
        ids = ids.astype(np.int64, copy=False)
        if ids.ndim != 1:
            raise LeaseError(f"{what}: blocks must be one-dimensional, got shape {ids.shape}")
        n = self.kv.geometry.blocks
        if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= n):
            raise LeaseError(f"{what}: blocks {_listed(ids[(ids < 0) | (ids >= n)])} lie outside [0, {n})")
        if np.unique(ids).size != ids.size:
            raise LeaseError(f"{what}: a block is named twice")
        return ids

    def _shared_ids(self, request: str, table: np.ndarray, shared: Any) -> np.ndarray:
        if shared is None:
            return _NONE
        arr = np.asarray(shared)
        if arr.dtype == np.bool_:
            if arr.shape != table.shape:
                raise LeaseError(f"request {request!r}: the shared mask has shape {arr.shape}, the block table "
                                 f"{table.shape}")
            return table[arr]
        if arr.size and not np.issubdtype(arr.dtype, np.integer):
            raise LeaseError(f"request {request!r}: shared must be block ids (ints) or a bool mask over the block "
                             f"table, got dtype {arr.dtype}")
        return arr.astype(np.int64).ravel()

    def _lend(self, request: str, block_table: Any, tokens: TokenRange | tuple[int, int], *, write: bool,
              heads: tuple[int, int] | None, shared: Any = None, allow_shared: bool = False) -> ExternalLease:
        if self._disabled is not None:
            raise LendingDisabled(self._disabled)
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
        self._progress()
        freed = blocks[np.isin(blocks, self._deferred) | np.isin(blocks, self._retained)]
        if freed.size:
            raise LeaseError(f"request {request!r}: blocks {_listed(freed)} were freed by the engine and are held by "
                             "the lender until reclaim() hands them back: a block table names them")
        if write:
            common = blocks[np.isin(blocks, self._shared_ids(request, table, shared))]
            if common.size and not allow_shared:
                raise LeaseError(f"request {request!r}: blocks {_listed(common)} are shared by prefix with other "
                                 "requests; lent for writing, a peer would rewrite their KV (allow_shared=True "
                                 "only where the engine knows that is safe)")
        clash = np.intersect1d(blocks, self._held(write_only=not write))
        if clash.size:
            raise LeaseError(f"request {request!r}: block {int(clash[0])} is lent to another lease "
                             f"{'(any lease blocks a write)' if write else 'for writing'}")
        view_geometry = geometry if heads is None else geometry.narrowed(*heads)
        region = geometry.regions[0]
        rows = LayerGroupRows(self.group, CacheKind.PAGED, region, blocks, ordinals)
        view = View(request, span, (rows,), layout=self.kv.layout, geometry=view_geometry)
        lease = ExternalLease(self, request, span, write, blocks, view)
        self._leases[lease.id] = lease
        return lease


class _Joint:
    """The claim the lenders of one engine's layer groups hold together (``for_groups``)."""

    def __init__(self, count: int, what: str, groups: list[str]) -> None:
        self.left = count
        self.what = what
        self.groups = groups
        self.claim: Claim | None = None

    def __repr__(self) -> str:
        return f"<ExternalLenders of {self.what} (groups {', '.join(self.groups)})>"


class _Share:
    """One lender's part of a joint claim: the claim ends when every part is released (or
    every lender collected: each holds the joint, the claim's owner)."""

    def __init__(self, joint: _Joint) -> None:
        self._joint: _Joint | None = joint

    def release(self) -> None:
        joint, self._joint = self._joint, None
        if joint is None:
            return
        joint.left -= 1
        if joint.left == 0 and joint.claim is not None:
            joint.claim.release()


def _what(regions: tuple[SlotRegion, ...]) -> str:
    names = [r.name for r in regions]
    return f"engine KV {', '.join(names[:3])}{', ...' if len(names) > 3 else ''}"


def _listed(blocks: np.ndarray, most: int = 16) -> str:
    """Block ids for a message: all of them, or the first ``most`` and how many more."""
    ids = [int(b) for b in blocks[:most]]
    return f"{ids}" if blocks.size <= most else f"{ids} and {blocks.size - most} more"
