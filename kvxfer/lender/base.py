"""Lender and Lease: rows of a pool lent out under leases, pinned until released.

Every lender serves one pool, and a pool has one lender at a time (``kvxfer.lender.claims``:
a second is AlreadyLent until the first shuts down), from one call sequence (the owner's
thread); backends' threads only read the views it hands out. Progress (staging copies finishing, deferred
releases whose attempts quiesced) is driven by the lender's own calls, not by a thread.

Lease life: ``lend_read``/``lend_write`` -> ``view()`` (None until ready) -> submit to a
backend (``lease.track(attempt)`` so that release waits for quiescence) -> for a write
lease, ``mark_arrived(outcome.masks)`` once -> ``release()`` (always; idempotent).
"""

from __future__ import annotations

import abc
import itertools
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvxfer.contract import (
    Attempt,
    CacheKind,
    LayerGroupRows,
    SlotRegion,
    TokenRange,
    View,
)
from kvxfer.lender.bounds import ResumeBounds, resume_bounds
from kvxfer.lender.claims import claim
from kvxfer.lender.errors import LeaseError, LenderBusy, LendingDisabled
from kvxfer.lender.marks import arrival_masks, check_markable
from kvxfer.pool import BlockAllocator, LayerGroupSpec, PagedKVPool, RowRegion

_ids = itertools.count(1)


@dataclass(frozen=True)
class ShutdownReport:
    """What a shutdown kept out of reuse because some access to it may still happen."""

    open_leases: int
    unquiesced_attempts: int
    retained_blocks: dict[str, np.ndarray] = field(default_factory=dict)  # pool group -> blocks
    retained_staging: dict[str, np.ndarray] = field(default_factory=dict)  # staging region -> slots

    @property
    def retained_anything(self) -> bool:
        return any(a.size for a in self.retained_blocks.values()) or any(
            a.size for a in self.retained_staging.values())


@dataclass(eq=False)
class _Part:
    """The lease's rows of one pool row region: ``blocks[i]`` holds ``ordinals[i]``."""

    region: RowRegion
    group: str
    ordinals: np.ndarray
    blocks: np.ndarray


class Lease:
    """Rows of one request lent for reading (to send) or writing (to receive)."""

    def __init__(self, lender: Lender, request: str, tokens: TokenRange, write: bool,
                 parts: list[_Part], epoch: int) -> None:
        self.id = next(_ids)
        self.lender = lender
        self.request = request
        self.tokens = tokens
        self.write = write
        self.failure: str | None = None
        self._parts = parts
        self._epoch = epoch
        self._view: View | None = None
        self._arrived = False
        self._released = False
        self._attempts: list[Attempt] = []

    def view(self) -> View | None:
        """The rows to hand a backend, once ready (a staging read waits for its copy)."""
        self.lender._progress()
        return None if self.failure is not None else self._view

    @property
    def released(self) -> bool:
        return self._released

    @property
    def arrived(self) -> bool:
        return self._arrived

    def track(self, attempt: Attempt) -> None:
        """Hold this lease's memory after release until ``attempt`` is quiesced."""
        if self._released:
            raise LeaseError(f"lease {self.id} of {self.request!r} is released; track attempts before release")
        self._attempts.append(attempt)

    def unquiesced(self) -> int:
        return sum(1 for a in self._attempts if not a.quiesced())

    def mark_arrived(self, masks: Sequence[Any]) -> None:
        """Write leases, once: the rows True in ``masks`` (aligned with the view's groups,
        e.g. ``outcome.masks``) hold the peer's bytes. Readiness then counts them."""
        self.lender._mark_arrived(self, masks)

    def release(self) -> None:
        """End the lease (required for every lease; idempotent). Memory is unpinned once
        tracked attempts and the lender's own copies can no longer touch it."""
        self.lender.release(self)

    def __repr__(self) -> str:
        kind = "write" if self.write else "read"
        return f"<Lease {self.id} {kind} {self.request!r} [{self.tokens.start}, {self.tokens.end})>"


class Lender(abc.ABC):
    """Lends rows of one pool under leases. Subclasses decide where the rows live."""

    def __init__(self, pool: PagedKVPool) -> None:
        self.pool = pool
        # One lender per pool (AlreadyLent otherwise), until shutdown or collection.
        self._claim = claim(self, pool.slot_regions(), f"pool {pool.name!r}")
        self._leases: dict[int, Lease] = {}  # open: not released
        self._releasing: dict[int, Lease] = {}  # released, memory still held
        self._disabled: str | None = None
        self._closed = False
        if pool.reuse_was_reset:  # bytes of that pool may predate the scope change: never lend them
            self.on_reuse_reset(pool.scope)
        pool.add_listener(self)

    # --- the public surface -----------------------------------------------------------
    @property
    @abc.abstractmethod
    def regions(self) -> tuple[SlotRegion, ...]:
        """Regions to register with a backend."""

    def lend_read(self, request: str, tokens: TokenRange | tuple[int, int],
                  groups: Collection[str] | None = None) -> Lease:
        """Rows holding committed KV for the blocks of ``tokens`` (which must all be written).
        ``groups`` (names; None: all): only those layer groups' rows, as a forward that has
        written and committed some groups so far lends them (layer-wise streaming)."""
        tokens = self._open(request, tokens)
        if tokens.end > self.pool.length(request):
            raise LeaseError(f"cannot lend rows to read: {request!r} holds {self.pool.length(request)} tokens, "
                             f"[{tokens.start}, {tokens.end}) reaches past them")
        if groups is not None:
            for name in groups:
                self.pool.group(name)  # KeyError naming the groups the pool has
        parts = self._select(request, tokens, write=False, groups=groups)
        return self._start(request, tokens, parts, write=False)

    def lend_write(self, request: str, tokens: TokenRange | tuple[int, int]) -> Lease:
        """Grow ``request`` to ``tokens.end`` and lend the rows of ``tokens`` still empty."""
        tokens = self._open(request, tokens)
        self.pool.grow(request, tokens.end)
        parts = self._select(request, tokens, write=True)
        return self._start(request, tokens, parts, write=True)

    def readiness(self, request: str) -> ResumeBounds | None:
        """Where ``request`` may resume (None if the pool does not hold it)."""
        self._progress()
        if not self.pool.has(request):
            return None
        specs = self.pool.groups
        return resume_bounds(specs, {s.name: self.pool.filled(request, s.name) for s in specs})

    def release(self, lease: Lease) -> None:
        if not isinstance(lease, Lease):
            raise LeaseError(f"release takes a Lease, got {type(lease).__name__}")
        if lease.lender is not self:
            raise LeaseError(f"{lease!r} belongs to another lender; release it there")
        if lease._released:
            return
        lease._released = True
        self._leases.pop(lease.id, None)
        self._releasing[lease.id] = lease
        self._before_release(lease)
        self._progress()

    def reclaim(self) -> None:
        """Unpin released leases whose attempts have quiesced since (lending calls do this
        too; a holder that lends nothing for a while calls it to get rows back)."""
        self._progress()

    @property
    def open_leases(self) -> int:
        return len(self._leases)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} of pool {self.pool.name!r}>"

    # --- lifecycle hooks (the pool calls these) -----------------------------------------
    def on_free(self, request: str) -> None:
        """The pool frees ``request``: its leased blocks stay pinned until release; arrivals
        reported later are ignored."""
        return None

    def on_shrink(self, request: str, tokens: int) -> None:
        """The pool recorded the shrink; arrivals past ``tokens`` are void for good."""
        return None

    def on_reuse_reset(self, scope: bytes) -> None:
        self._disabled = (f"pool {self.pool.name!r} reset its reuse scope (now {scope.hex()[:16] or 'empty'}): "
                          "lending is disabled for this pool; build a new pool and lender with the new scope")

    def shutdown(self, force: bool = False) -> ShutdownReport:
        """Stop lending. Refuses (LenderBusy) while leases are open or released leases wait
        for attempts, unless ``force``: then their memory is retained for good and reported.
        The pool may then get a new lender (what was retained stays retained)."""
        self._progress()
        open_leases = list(self._leases.values())
        waiting = list(self._releasing.values())
        attempts = sum(lease.unquiesced() for lease in open_leases + waiting)
        if (open_leases or waiting) and not force:
            raise LenderBusy(f"{len(open_leases)} leases open and {len(waiting)} released leases holding memory "
                             f"({attempts} attempts not quiesced); release them, or shutdown(force=True)")
        blocks: dict[str, list[np.ndarray]] = {}
        for lease in open_leases + waiting:
            for part in lease._parts:
                blocks.setdefault(part.group, []).append(part.blocks)
        retained = {}
        for group, parts in blocks.items():
            merged = np.unique(np.concatenate(parts))
            self.pool.allocator(group).retain(merged)
            retained[group] = merged
        staging = self._retain_own(open_leases + waiting)
        self._leases.clear()
        self._releasing.clear()
        self._closed = True
        self._disabled = f"lender of pool {self.pool.name!r} is shut down"
        self.pool.remove_listener(self)
        self._claim.release()  # what it retained stays retained by the pool's allocator
        return ShutdownReport(len(open_leases), attempts, retained, staging)

    # --- for subclasses -------------------------------------------------------------------
    def _abandon(self) -> None:
        """A subclass's constructor failed after this one ran: drop the pool's listener and
        the claim, so that the pool can get a lender again."""
        self._closed = True
        self._disabled = f"lender of pool {self.pool.name!r} failed to start"
        self.pool.remove_listener(self)
        self._claim.release()

    @abc.abstractmethod
    def _make_view(self, lease: Lease) -> None:
        """Set ``lease._view`` now or later (from ``_progress``)."""

    @abc.abstractmethod
    def _arrive(self, lease: Lease, rows: dict[str, np.ndarray]) -> None:
        """Make arrived rows (per pool group: ordinal indices into the part) count."""

    def _before_release(self, lease: Lease) -> None:
        """Hook: a lease was released (cancel waiting work)."""
        return None

    def _can_unpin(self, lease: Lease) -> bool:
        """Hook: True when no copy of the lender's own can touch the lease's memory."""
        return True

    def _after_unpin(self, lease: Lease) -> None:
        """Hook: the lease's memory is free to reuse (give back staging slots)."""
        return None

    def _retain_own(self, leases: list[Lease]) -> dict[str, np.ndarray]:
        return {}

    def _progress(self) -> None:
        """Finish what can be finished: releases whose attempts and copies are done."""
        done = [lease for lease in self._releasing.values()
                if lease.unquiesced() == 0 and self._can_unpin(lease)]
        for lease in done:
            del self._releasing[lease.id]
            self._unpin(lease)
            self._after_unpin(lease)

    # --- shared machinery ---------------------------------------------------------------
    def _open(self, request: str, tokens: TokenRange | tuple[int, int]) -> TokenRange:
        if self._disabled is not None:
            raise LendingDisabled(self._disabled)
        if not isinstance(tokens, TokenRange):
            tokens = TokenRange(*tokens)
        if not self.pool.has(request):
            raise LeaseError(f"cannot lend rows of {request!r}: pool {self.pool.name!r} does not hold it "
                             "(never allocated, or freed)")
        self._progress()
        return tokens

    def _select(self, request: str, tokens: TokenRange, write: bool,
                groups: Collection[str] | None = None) -> list[_Part]:
        """The ordinals and blocks of each group this lease covers (vectorized)."""
        pool = self.pool
        parts: list[_Part] = []
        writes: list[tuple[BlockAllocator, np.ndarray]] = []
        for spec in pool.groups:
            if groups is not None and spec.name not in groups:
                continue
            table = pool.block_table(request, spec.name)
            filled = pool.filled(request, spec.name)
            alloc = pool.allocator(spec.name)
            if spec.kind is CacheKind.STATE:
                ordinals = _state_ordinals(request, spec, filled, tokens, write)
            else:
                ordinals = _paged_ordinals(request, spec, filled, tokens, write)
            blocks = table[ordinals]
            _check_lendable(request, spec.name, alloc, blocks, write)
            if write and blocks.size:
                writes.append((alloc, blocks))
            for region in pool.row_regions():
                if region.group == spec.name:
                    parts.append(_Part(region, spec.name, ordinals, blocks))
        for alloc, blocks in writes:  # only once every group passed: the peer rewrites these blocks
            alloc.claim_for_write(blocks, f"request {request!r}")
        return parts

    def _start(self, request: str, tokens: TokenRange, parts: list[_Part], write: bool) -> Lease:
        epoch = self.pool.shrink_epoch(request)
        lease = Lease(self, request, tokens, write, parts, epoch)
        seen: set[str] = set()
        for part in parts:  # one pin per block per lease, even with one region per layer
            if part.group not in seen:
                seen.add(part.group)
                self.pool.allocator(part.group).pin(part.blocks, write)
        self._leases[lease.id] = lease
        try:
            self._make_view(lease)
        except BaseException:
            self.release(lease)
            raise
        return lease

    def _unpin(self, lease: Lease) -> None:
        seen: set[str] = set()
        for part in lease._parts:
            if part.group not in seen:
                seen.add(part.group)
                self.pool.allocator(part.group).unpin(part.blocks, lease.write)

    def _rows_view(self, lease: Lease, regions: list[SlotRegion], slots: list[np.ndarray]) -> View:
        groups = tuple(
            LayerGroupRows(part.region.name, self.pool.group(part.group).kind, region, s, part.ordinals)
            for part, region, s in zip(lease._parts, regions, slots)
        )
        return View(lease.request, lease.tokens, groups, layout=self.pool.identity)

    def _mark_arrived(self, lease: Lease, masks: Sequence[Any]) -> None:
        if lease.lender is not self:
            raise LeaseError(f"{lease!r} belongs to another lender")
        check_markable(lease, write=lease.write, arrived=lease._arrived, released=lease._released,
                       disabled=self._disabled if self._closed else None)
        if lease._view is None:
            raise LeaseError(f"{lease!r} has no view yet: nothing can have arrived")
        frozen = arrival_masks(lease, lease._view, masks)
        lease._arrived = True
        # A block arrived only if it arrived in every region of its group (layer-major).
        rows: dict[str, np.ndarray] = {}
        for part, mask in zip(lease._parts, frozen):
            rows[part.group] = mask if part.group not in rows else rows[part.group] & mask
        if not self.pool.has(lease.request):
            return  # freed meanwhile: nothing to count
        self._arrive(lease, {g: np.flatnonzero(m) for g, m in rows.items()})

    def _record(self, lease: Lease, group: str, idx: np.ndarray) -> None:
        """Count rows ``idx`` of the lease's ``group`` as filled, unless voided since."""
        pool = self.pool
        if not pool.has(lease.request) or idx.size == 0:
            return
        part = next(p for p in lease._parts if p.group == group)
        ordinals, blocks = part.ordinals[idx], part.blocks[idx]
        cap = pool.shrink_cap(lease.request, lease._epoch)
        end = lease.tokens.end if cap is None else min(lease.tokens.end, cap)
        spec = pool.group(group)
        table = pool.block_table(lease.request, group)
        if spec.kind is CacheKind.STATE:
            # Same slot (not a request of the same name allocated anew), and not shrunk below.
            if table[0] == blocks[0] and (cap is None or cap >= lease.tokens.end):
                pool.record_arrival(lease.request, group, ordinals, np.full(ordinals.size, lease.tokens.end))
            return
        # Still the request's block at that ordinal (a shrink and regrow hands out new ones).
        inside = ordinals < table.size
        same = np.zeros(ordinals.size, dtype=np.bool_)
        same[inside] = table[ordinals[inside]] == blocks[inside]
        ends = np.minimum((ordinals + 1) * spec.block_tokens, end)
        keep = same & (ends > ordinals * spec.block_tokens)
        pool.record_arrival(lease.request, group, ordinals[keep], ends[keep])


def _state_ordinals(request: str, spec: LayerGroupSpec, filled: np.ndarray, tokens: TokenRange,
                    write: bool) -> np.ndarray:
    """A STATE group's one slot, if the lease covers it: a writer fills it unless it holds
    the state at ``tokens.end`` already; a reader needs it to."""
    have = int(filled[0]) == tokens.end
    if write:
        return np.zeros(0 if have else 1, dtype=np.int64)
    if have or tokens.end == 0:
        return np.zeros(1 if have else 0, dtype=np.int64)
    raise LeaseError(f"request {request!r}: STATE group {spec.name!r} holds the state at "
                     f"{int(filled[0])}, not at {tokens.end}; commit it first")


def _paged_ordinals(request: str, spec: LayerGroupSpec, filled: np.ndarray, tokens: TokenRange,
                    write: bool) -> np.ndarray:
    """A paged group's block ordinals under ``tokens``: a writer's are those not filled yet; a
    reader's must all be committed."""
    bt = spec.block_tokens
    first, last = tokens.start // bt, -(-tokens.end // bt)
    ordinals = np.arange(first, last, dtype=np.int64) if tokens.end > tokens.start else \
        np.zeros(0, dtype=np.int64)
    if spec.window is not None:
        # Resuming at tokens.end needs only the sinks and the window before it.
        low = (tokens.end - spec.window) // bt
        ordinals = ordinals[(ordinals < spec.sink_blocks) | (ordinals >= low)]
    need = np.minimum((ordinals + 1) * bt, tokens.end)
    done = filled[ordinals] >= need
    if write:
        return ordinals[~done]
    if not done.all():
        gap = int(ordinals[np.argmin(done)])
        raise LeaseError(f"request {request!r}: group {spec.name!r} block {gap} does not hold committed "
                         f"KV up to token {int(need[np.argmin(done)])}; commit before lend_read")
    return ordinals


def _check_lendable(request: str, group: str, alloc: BlockAllocator, blocks: np.ndarray, write: bool) -> None:
    """LeaseError unless ``group``'s ``blocks`` may be lent this way now."""
    if not write and blocks.size and (alloc.write_pins[blocks] > 0).any():
        # A peer is rewriting them: what a reader sent could be torn.
        raise LeaseError(f"request {request!r}: group {group!r} blocks are lent for writing; they can "
                         "be lent for reading once that lease is released")
    if not (write and blocks.size):
        return
    if (alloc.refcount[blocks] > 1).any():
        raise LeaseError(f"request {request!r}: group {group!r} would lend blocks shared with "
                         "another request for writing")
    if (alloc.write_pins[blocks] > 0).any():
        raise LeaseError(f"request {request!r}: group {group!r} blocks are already lent for writing")
    if (alloc.pins[blocks] > 0).any():
        # A peer would rewrite whole blocks that an open read lease may still be
        # sending (a shrink and regrow, or a shared prefix, under a publish).
        raise LeaseError(f"request {request!r}: group {group!r} blocks are lent for reading by an "
                         "open lease; release it before lending them for writing")
