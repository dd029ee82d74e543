"""A worker's side of a KV store (``kvxfer serve --store memory|mooncake``).

A prefill worker puts its prompt's full blocks into the store as soon as it has computed
them, each under its block name (``kvxfer.pool.block_names``: chained over the token ids,
under the pool's layout identity, so only a worker with the same model and layout ever
reads it). A decode worker, when it reserves rows for a prompt, first takes what its own
prefix cache holds, then fetches from the store the blocks that follow, as far as the store
has them; hint D then covers only the rest, so the prefill worker sends only that. A store
that lacks a block, loses it or fails is a miss, never an error: the rows come from the
prefill worker (or are recomputed) as without a store.

Only full blocks of the prompt without its last token are named, as for the prefix cache:
a request always has at least one row to move.

Every store lease is released, however its call ends (a refusal, a timeout, the caller
cancelled): one whose attempt has not quiesced (a driver call still running) is set aside
with the worker's other such rows (``Quarantine.lease``): released and tracking the
attempt, so the lender reuses its rows once the attempt quiesces, never before.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from kvxfer.backends.blob import BlobBackend, BlobDriver, MemoryDriver, MemoryStore, MooncakeDriver, ShmDriver
from kvxfer.backends.common import CorruptFn
from kvxfer.contract import Attempt, Outcome, View
from kvxfer.lender import Lease, Lender
from kvxfer.pool import PagedKVPool, block_names
from kvxfer.worker.engine_thread import EngineThread
from kvxfer.worker.meters import Meters
from kvxfer.worker.quarantine import Quarantine

log = logging.getLogger("kvxfer.worker.store")

STORES = ("memory", "mooncake")


def make_store_driver(kind: str, *, path: str = "", master: str = "", segment_bytes: int = 256 << 20,
                      shared: MemoryStore | None = None) -> BlobDriver:
    """``memory``: files in a /dev/shm directory that the host's processes share (or, given
    ``shared``, an in-process MemoryStore, for workers of one process); ``mooncake``: a
    Mooncake Store whose master is at ``master``, this worker giving it ``segment_bytes`` of
    memory (its own puts land there, and go with it; 0: they land in another client's, a
    store server's)."""
    if kind == "memory":
        if shared is not None:
            return MemoryDriver(shared)
        return ShmDriver(path) if path else ShmDriver()
    if kind == "mooncake":
        if not master:
            raise ValueError("--store mooncake needs --store-master HOST:PORT (the Mooncake master)")
        # Block names name their content: a put of a stored block keeps it, so that a lookup of
        # it never races another worker's put of the same block (MooncakeDriver keep_stored).
        return MooncakeDriver(master, segment_bytes=segment_bytes, keep_stored=True)
    raise ValueError(f"store must be one of {STORES}, got {kind!r}")


@dataclass(frozen=True)
class StoreFigures:
    """One store call's rows: asked, found (or stored), and the tokens they make up."""

    rows: int
    hits: int
    tokens: int
    seconds: float


class StoreSide:
    """Puts (prefill) and fetches (decode) through a BlobBackend, named by the prompt's tokens."""

    def __init__(self, driver: BlobDriver, pool: PagedKVPool, lender: Lender, engine: EngineThread,
                 meters: Meters, quarantine: Quarantine, timeout_s: float, name: str, integrity: bool = True,
                 corrupt_landed: CorruptFn | None = None) -> None:
        self.backend = BlobBackend(driver, name=name, namer=self.names, timeout_s=timeout_s, integrity=integrity,
                                   corrupt_landed=corrupt_landed)
        try:
            skipped = self.backend.register(lender.regions)
        except BaseException:
            self.backend.shutdown()  # its thread, and the driver it owns (nobody else will)
            raise
        if skipped:
            self.backend.shutdown()
            raise RuntimeError(f"the {driver.name} store reaches host memory only, not the pool's "
                               f"{', '.join(sorted({r.memory_kind.name for r in skipped}))} memory: serve the "
                               "pool from the CPU, or go without --store")
        self._pool = pool
        self._lender = lender
        self._engine = engine
        self._meters = meters
        self._quarantine = quarantine
        self._timeout_s = timeout_s
        self._ids: dict[str, np.ndarray] = {}  # a request's token ids, while its view is described
        self._moving: dict[object, tuple[Lease, View, Attempt]] = {}  # by _move's token, until it ends
        self._bt = pool.groups[0].block_tokens

    def names(self, view: View) -> list[list[bytes]]:
        """The Namer the backend asks at describe(): each row's block name."""
        ids = self._ids[view.request]
        identity = self._pool.identity
        out = []
        for group in view.groups:
            spec = self._pool.group(group.layer_group)
            chain = block_names(identity, group.layer_group, spec.block_tokens, ids)
            out.append([chain[o] for o in group.ordinals.tolist()])
        return out

    def _named_blocks(self, prompt: Sequence[int]) -> int:
        return (len(prompt) - 1) // self._bt

    # --- what the roles call: a store's trouble is a miss, never the request's failure -------
    async def offer(self, rid: str, prompt: Sequence[int]) -> int:
        """Prefill: put the prompt's full blocks; how many the store took."""
        try:
            return (await self.put(rid, prompt)).hits
        except Exception as exc:  # the request goes on without the store
            log.warning("store %s: putting %s failed: %s", self.backend.driver.name, rid, exc)
            self._meters.store_errors.inc(op="put")
            return 0

    async def lookup(self, rid: str, prompt: Sequence[int], reused_tokens: int) -> int:
        """Decode: fetch what the store holds past ``reused_tokens``; the tokens it gave."""
        try:
            return (await self.fetch(rid, prompt, reused_tokens)).tokens
        except Exception as exc:  # the prefill worker sends those rows instead
            log.warning("store %s: fetching %s failed: %s", self.backend.driver.name, rid, exc)
            self._meters.store_errors.inc(op="get")
            return 0

    def shutdown(self) -> int:
        """Stop the store's backend (and close its driver); attempts not proven quiesced."""
        return len(self.backend.shutdown())

    # --- prefill: put ------------------------------------------------------------------------
    async def put(self, rid: str, prompt: Sequence[int]) -> StoreFigures:
        """Put ``rid``'s full prompt blocks (computed and committed) under their names."""
        blocks = self._named_blocks(prompt)
        if blocks == 0:
            return StoreFigures(0, 0, 0, 0.0)
        return await self._move(rid, prompt, 0, blocks, put=True)

    # --- decode: fetch -----------------------------------------------------------------------
    async def fetch(self, rid: str, prompt: Sequence[int], reused_tokens: int) -> StoreFigures:
        """Fetch the prompt's named blocks past ``reused_tokens`` into ``rid``'s rows, as far as
        the store holds them; the tokens now held from the store (a prefix: after a gap, rows
        that arrived count as filled but not as usable)."""
        start, blocks = reused_tokens // self._bt, self._named_blocks(prompt)
        if start >= blocks:
            return StoreFigures(0, 0, 0, 0.0)
        return await self._move(rid, prompt, start, blocks, put=False)

    async def _move(self, rid: str, prompt: Sequence[int], start: int, end: int, *, put: bool) -> StoreFigures:
        event, wake = self._engine.waker()
        began = time.perf_counter()
        token = object()
        try:
            view, attempt = await self._engine.run_move(self._submit, token, rid, prompt, start, end, put, wake)
            outcome = await self._engine.settle(attempt, event, self._timeout_s)
            await self._engine.wait(attempt, event, 5.0, lambda a: a.quiesced())
        except BaseException:
            # Cancelled or timed out: _submit may still be running, and _finish, queued behind
            # it on the one engine thread, ends what it made (shielded, and a failure of its
            # own logged: the cancellation goes on).
            await self._engine.cleanup(self._finish, token, None)
            raise
        # Shielded: were the caller cancelled now, the job would still run.
        await asyncio.shield(self._engine.run_move(self._finish, token, None if put else outcome))
        return self._count(view, outcome, start, put, time.perf_counter() - began)

    def _submit(self, token: object, rid: str, prompt: Sequence[int], start: int, end: int, put: bool,
                wake: Callable[[], None]) -> tuple[View, Attempt]:
        tokens = (start * self._bt, end * self._bt)
        lease = self._lender.lend_read(rid, tokens) if put else self._lender.lend_write(rid, tokens)
        try:
            view = lease.view()
            if view is None:
                raise RuntimeError(f"request {rid!r}: the store's lease is not ready")
            self._ids[rid] = np.asarray(prompt[: end * self._bt], dtype=np.int64)
            try:
                hint = self.backend.describe(view)
            finally:
                del self._ids[rid]
            attempt = (self.backend.publish if put else self.backend.fetch)(view, hint, wake)
        except BaseException:
            lease.release()  # a blob backend's refusal promises nothing escaped
            raise
        lease.track(attempt)
        self._moving[token] = (lease, view, attempt)
        return view, attempt

    def _finish(self, token: object, outcome: Outcome | None) -> None:
        """End the lease ``_submit`` made under ``token`` (none if it refused or never ran):
        a fetch's rows count as arrived when ``outcome`` says so; a lease whose attempt has
        not quiesced is set aside until it does."""
        made = self._moving.pop(token, None)
        if made is None:
            return
        lease, view, attempt = made
        if not attempt.quiesced():
            attempt.cancel()  # nobody waits for it any more
            self._quarantine.lease(lease, view, attempt)
            return
        if outcome is not None:
            lease.mark_arrived(outcome.masks)
        lease.release()

    def _count(self, view: View, outcome: Outcome, start: int, put: bool, seconds: float) -> StoreFigures:
        mask = np.concatenate(outcome.masks) if outcome.masks else np.zeros(0, dtype=np.bool_)
        hits = int(mask.sum())
        op = "put" if put else "get"
        self._meters.store_rows.inc(hits, op=op, result="hit")
        self._meters.store_rows.inc(view.rows - hits, op=op, result="miss")
        whole = _whole_blocks(view, outcome, start)
        # A put's blocks every group stored; a fetch's usable prefix, up to the first block missed.
        blocks = int(whole.sum()) if put else (int(np.argmin(whole)) if not whole.all() else whole.size)
        return StoreFigures(view.rows, hits, blocks * self._bt, seconds)


def _whole_blocks(view: View, outcome: Outcome, start: int) -> np.ndarray:
    """Per block from ``start``: whether every layer group that lent it moved it (--layerwise
    cuts the pool into several groups, each row under a name of its own, so the store may hold
    a block's rows of one group and not of another: a block is of use only whole)."""
    end = max((int(g.ordinals.max()) + 1 for g in view.groups if len(g)), default=start)
    whole = np.ones(max(end - start, 0), dtype=np.bool_)
    for group, moved in zip(view.groups, outcome.masks):
        whole[group.ordinals[~np.asarray(moved, dtype=np.bool_)] - start] = False
    return whole
