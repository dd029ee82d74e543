"""A worker's KV as a tensor-parallel group: one pool per rank, moved as engine geometries.

With ``--tp`` (or a block size or layout of its own) a worker keeps its KV the way an
engine does: rank r's pool holds only its KV heads (``kvxfer.engine.tp``), in its own block
size and order. A request then moves as one transfer per *pair*: decode rank q receives
the heads it holds from the prefill rank that holds them (several pairs when its heads are
spread over several prefill ranks; for replicated heads, the first rank that holds one).
Each pair is a geometry view (``kvxfer.lender.engine_kv``) of its rank's lease narrowed
to the pair's heads, under its own request name (``rid/kv{q}-{s}``), so that both ends
name it alike and each gets its own describe(); the hints of a request travel as one
message (``kvxfer.wire.encode_hints``).

The rest of the worker sees one lender, one lease and one attempt, as with a single pool:
``GroupLender`` lends every rank's rows together, ``GroupLease`` is their leases (its view
lists every rank's groups, renamed ``r{rank}/...``), and ``GroupAttempt`` concludes when
every pair did, its masks per rank group: a block of rank q arrived only when every pair
feeding q delivered it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvxfer.contract import (
    Attempt,
    Cancelled,
    Delivered,
    Failed,
    Hint,
    InvalidSubmission,
    LayerGroupRows,
    Outcome,
    TokenRange,
    View,
)
from kvxfer.engine import ShardedKVCache, kv_head_range
from kvxfer.lender import InPlaceLender, Lease, ResumeBounds, ShutdownReport
from kvxfer.lender.engine_kv import EngineKV
from kvxfer.lender.external import GROUP


@dataclass(frozen=True)
class RankPair:
    """Decode rank ``rank`` receives heads [first, end) from prefill rank ``source``."""

    rank: int
    source: int
    heads: tuple[int, int]

    def request(self, rid: str) -> str:
        return f"{rid}/kv{self.rank}-{self.source}"


def rank_pairs(kv_heads: int, decode_tp: int, prefill_tp: int) -> tuple[RankPair, ...]:
    """Every pair of one request, decode ranks in order, each rank's heads in order."""
    sources = [kv_head_range(kv_heads, prefill_tp, s) for s in range(prefill_tp)]
    pairs = []
    for rank in range(decode_tp):
        head, end = kv_head_range(kv_heads, decode_tp, rank)
        while head < end:
            source = next(s for s, (lo, hi) in enumerate(sources) if lo <= head < hi)
            stop = min(end, sources[source][1])
            pairs.append(RankPair(rank, source, (head, stop)))
            head = stop
    return tuple(pairs)


class GroupLease:
    """One request's leases, one per rank; the interface of a single ``Lease``."""

    def __init__(self, request: str, tokens: TokenRange, leases: list[Lease]) -> None:
        self.request = request
        self.tokens = tokens
        self.leases = leases

    def rank_views(self) -> list[View]:
        views = [lease.view() for lease in self.leases]
        if any(v is None for v in views):
            raise InvalidSubmission(f"request {self.request!r}: a rank's lease is not ready")
        return views  # type: ignore[return-value]

    def view(self) -> View | None:
        """Every rank's groups as one view (renamed ``r{rank}/{group}``), for counting rows
        and bytes and for marking arrivals."""
        groups = []
        for rank, view in enumerate(self.rank_views()):
            groups += [LayerGroupRows(f"r{rank}/{g.layer_group}", g.kind, g.region, g.slots, g.ordinals)
                       for g in view.groups]
        return View(self.request, self.tokens, tuple(groups), b"tp-group")

    def track(self, attempt: Attempt) -> None:
        for lease in self.leases:
            lease.track(attempt)

    def unquiesced(self) -> int:
        return max(lease.unquiesced() for lease in self.leases)

    def mark_arrived(self, masks: Sequence[Any]) -> None:
        """``masks`` aligned with ``view()``'s groups: each rank gets its own."""
        at = 0
        for lease, view in zip(self.leases, self.rank_views()):
            n = len(view.groups)
            lease.mark_arrived(list(masks[at: at + n]))
            at += n

    def release(self) -> None:
        for lease in self.leases:
            lease.release()


class GroupLender:
    """In-place lenders over every rank's pool, lending together; the geometries they expose."""

    def __init__(self, cache: ShardedKVCache, kv_heads: int) -> None:
        self.cache = cache
        self.lenders = [InPlaceLender(pool) for pool in cache.pools]
        self.kv = [EngineKV.from_pool(pool, heads=_span(cache, rank), kv_heads=kv_heads)
                   for rank, pool in enumerate(cache.pools)]

    @property
    def regions(self) -> tuple:  # type: ignore[type-arg]
        """What the backend registers: each rank's pool tensor, as its geometry names it."""
        return tuple(region for kv in self.kv for region in kv.regions)

    def lend_write(self, request: str, tokens: TokenRange | tuple[int, int]) -> GroupLease:
        return self._lend(request, tokens, write=True)

    def lend_read(self, request: str, tokens: TokenRange | tuple[int, int]) -> GroupLease:
        return self._lend(request, tokens, write=False)

    def _lend(self, request: str, tokens: TokenRange | tuple[int, int], *, write: bool) -> GroupLease:
        span = tokens if isinstance(tokens, TokenRange) else TokenRange(*tokens)
        leases: list[Lease] = []
        try:
            for lender in self.lenders:
                leases.append(lender.lend_write(request, span) if write else lender.lend_read(request, span))
        except BaseException:
            for lease in leases:
                lease.release()  # nothing was described yet: nothing can touch them
            raise
        return GroupLease(request, span, leases)

    def readiness(self, request: str) -> ResumeBounds | None:
        """Usable up to where every rank is usable."""
        bounds = [lender.readiness(request) for lender in self.lenders]
        if any(b is None for b in bounds):
            return None
        usable = min(b.usable_until for b in bounds)  # type: ignore[union-attr]
        return ResumeBounds(usable, min(max(b.restart_floor for b in bounds), usable))  # type: ignore[union-attr]

    def reclaim(self) -> None:
        for lender in self.lenders:
            lender.reclaim()

    @property
    def open_leases(self) -> int:
        return sum(lender.open_leases for lender in self.lenders)

    def shutdown(self, force: bool = False) -> ShutdownReport:
        reports = [lender.shutdown(force=force) for lender in self.lenders]
        blocks = {f"r{rank}/{g}": b for rank, r in enumerate(reports) for g, b in r.retained_blocks.items()}
        return ShutdownReport(sum(r.open_leases for r in reports), sum(r.unquiesced_attempts for r in reports),
                              blocks, {})

    # --- the pairs' views ------------------------------------------------------------------------
    def pair_view(self, lease: GroupLease, pair: RankPair, rank: int) -> View:
        """Rank ``rank``'s rows of ``lease`` as a geometry view holding the pair's heads."""
        view = lease.rank_views()[rank]
        rows = view.groups[0]
        geometry = self.kv[rank].geometry.narrowed(*pair.heads)
        group = LayerGroupRows(GROUP, rows.kind, geometry.regions[0], rows.slots, rows.ordinals)
        return View(pair.request(lease.request), view.tokens, (group,), self.kv[rank].layout, geometry)

    def source_rank(self, heads: tuple[int, int]) -> int:
        """The first rank of this (prefill) group holding every head of ``heads``."""
        for rank in range(self.cache.tp):
            lo, hi = _span(self.cache, rank)
            if lo <= heads[0] and heads[1] <= hi:
                return rank
        raise InvalidSubmission(f"no rank of this TP {self.cache.tp} group holds heads [{heads[0]}, {heads[1]})")


class GroupAttempt(Attempt):
    """The attempts of one request's pairs, as one: concluded when all are, quiesced when all
    are; its masks are per group of the ``GroupLease`` view (``rank_groups[q]`` groups for
    rank q), True where every pair feeding that rank delivered the block."""

    def __init__(self, attempts: list[Attempt], pairs: Sequence[RankPair], rank_groups: Sequence[int],
                 rows: Sequence[int], fetching: bool) -> None:
        self.attempts = attempts
        self.pairs = tuple(pairs)
        self._rank_groups = tuple(rank_groups)
        self._rows = tuple(rows)
        self._fetching = fetching
        self._outcome: Outcome | None = None

    def poll(self) -> Outcome | None:
        if self._outcome is not None:
            return self._outcome
        outcomes = [a.poll() for a in self.attempts]
        if any(o is None for o in outcomes):
            return None
        self._outcome = self._combine(outcomes)  # type: ignore[arg-type]
        return self._outcome

    def _combine(self, outcomes: list[Outcome]) -> Outcome:
        ranks = len(self._rank_groups)
        per_rank = [np.ones(self._rows[q], dtype=np.bool_) for q in range(ranks)]
        involved = np.zeros(ranks, dtype=np.bool_)
        for pair, outcome in zip(self.pairs, outcomes):
            # A fetch's masks are the decode rank's rows; a publish's, its source rank's.
            rank = pair.rank if self._fetching else pair.source
            per_rank[rank] &= np.asarray(outcome.masks[0], dtype=np.bool_)
            involved[rank] = True
        for q in np.flatnonzero(~involved):
            per_rank[q][:] = False  # a rank no pair used (a replica) moved nothing
        masks = [per_rank[q] for q in range(ranks) for _ in range(self._rank_groups[q])]
        failed = [o for o in outcomes if isinstance(o, Failed)]
        if failed:
            return Failed(f"{len(failed)} of {len(outcomes)} rank transfers failed: {failed[0].reason}", masks)
        cancelled = [o for o in outcomes if isinstance(o, Cancelled)]
        if cancelled:
            return Cancelled(any(o.by_peer for o in cancelled), masks)
        return Delivered(tuple(masks))

    def quiesced(self) -> bool:
        return all(a.quiesced() for a in self.attempts)

    def cancel(self) -> None:
        for attempt in self.attempts:
            attempt.cancel()


def hints_for(hints: tuple[Hint, ...], pairs: Sequence[RankPair], rid: str) -> list[Hint]:
    """The peer's hints in ``pairs`` order, matched by request name; InvalidSubmission when
    one is missing or extra (the two ends disagree on their TP groups)."""
    by_request = {h.request: h for h in hints}
    wanted = [pair.request(rid) for pair in pairs]
    if sorted(by_request) != sorted(wanted):
        raise InvalidSubmission(f"request {rid!r}: the peer sent hints for {sorted(by_request)}, this end's TP "
                                f"group moves {sorted(wanted)}: the two ends disagree on their TP groups")
    return [by_request[name] for name in wanted]


def _span(cache: ShardedKVCache, rank: int) -> tuple[int, int]:
    shard = cache.shard(rank)
    return shard.start, shard.end
