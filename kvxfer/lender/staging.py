"""StagingLender: rows lent out of bounded host staging, copied to and from the pool.

For peers that cannot reach the pool's memory (or a host-only transport). One staging
region per pool row region (pinned host memory when the pool is on CUDA), sized for
``max_fetches`` concurrent leases of up to ``fetch_tokens`` tokens within ``max_bytes``.

- A lease gets one contiguous run of slots per region, all regions or none, strictly in
  FIFO order: a head that does not fit blocks the queue (a waiting lease that is released
  is cancelled and stops blocking). ``view()`` is None while waiting.
- Read leases copy device pages into their slots on a stream the lender owns; the view
  appears once the copy's event completes. Write leases lend empty slots at once;
  ``mark_arrived`` copies only the marked rows to device pages, in one batch, and
  readiness counts them once that copy completes.
- A copy whose completion cannot be established (it raised, or its event did) sets
  ``lease.failure`` and quarantines its slots (the staging memory is then kept even after
  the lender is gone); on CUDA the device pages it touched are retained too. They come back
  as soon as nothing of the copy can still run: at once on the host, where copies run on the
  calling thread, and on CUDA once the lender's copy stream synchronizes (never, if the
  device context is broken). ``stats()`` shows capacity, free, quarantined and reclaimed slots.

Progress is driven by the lender's calls (``view``, ``readiness``, ``release``, lends).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from kvxfer.contract import CacheKind, MemoryKind, SlotRegion
from kvxfer.lender.base import Lease, LeaseError, Lender
from kvxfer.lender.slots import SlotRuns, SlotStats
from kvxfer.pool import LayerGroupSpec, PagedKVPool

# Buffers holding quarantined slots (a copy of unknown completion, or a forced shutdown
# with leases open) may still be touched: kept here, never freed, whatever becomes of the
# lender.
_RETAINED: list[Any] = []


@dataclass(frozen=True)
class StagingStats:
    regions: dict[str, SlotStats]
    waiting: int
    copies_in_flight: int
    fetches: int  # concurrent full-size leases the capacity was sized for
    reclaimed: int = 0  # slots quarantined after a failed copy and given back since
    quarantined_total: int = 0  # slots ever quarantined after a failed copy


@dataclass(eq=False)
class _Copy:
    lease: Lease
    event: Any  # torch.cuda.Event, or None when the copy was synchronous
    arrived: dict[str, np.ndarray] | None = None  # write copies: rows to count when done
    keep: list[torch.Tensor] = field(default_factory=list)  # temporaries the copy reads


def rows_per_fetch(spec: LayerGroupSpec, fetch_tokens: int) -> int:
    """Most rows of one group a lease of up to ``fetch_tokens`` tokens can need."""
    if spec.kind is CacheKind.STATE:
        return 1
    bt = spec.block_tokens
    rows = 1 + -(-(fetch_tokens - 1) // bt) if fetch_tokens > 0 else 0  # any start offset
    if spec.window is not None:
        rows = min(rows, spec.sink_blocks + 1 + -(-(spec.window - 1) // bt))
    return rows


class StagingLender(Lender):
    """Leases over bounded host staging slots, granted FIFO in contiguous runs."""

    def __init__(self, pool: PagedKVPool, fetch_tokens: int, max_fetches: int, max_bytes: int) -> None:
        sizes = (fetch_tokens, max_fetches, max_bytes)
        if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in sizes):
            raise ValueError("fetch_tokens, max_fetches and max_bytes must be positive ints, got "
                             f"{fetch_tokens!r}, {max_fetches!r}, {max_bytes!r}")
        per_region = {r.name: rows_per_fetch(pool.group(r.group), fetch_tokens) for r in pool.row_regions()}
        per_fetch = sum(per_region[r.name] * r.slot_bytes for r in pool.row_regions())
        fetches = min(max_fetches, max_bytes // per_fetch)
        if fetches < 1:
            raise ValueError(f"one fetch of {fetch_tokens} tokens needs {per_fetch} staging bytes; "
                             f"max_bytes is {max_bytes}")
        super().__init__(pool)
        self.fetch_tokens = fetch_tokens
        self.fetches = fetches
        self._cuda = pool.device.type == "cuda"
        self._buffers: dict[str, torch.Tensor] = {}
        self._slots: dict[str, SlotRuns] = {}
        regions = []
        try:
            self._stream = torch.cuda.Stream(device=pool.device) if self._cuda else None
            for r in pool.row_regions():
                n = per_region[r.name] * fetches
                buf = torch.empty((n, *r.rows.shape[1:]), dtype=r.rows.dtype, pin_memory=self._cuda)
                self._buffers[r.name] = buf
                self._slots[r.name] = SlotRuns(r.name, n)
                regions.append(SlotRegion(f"{pool.name}/staging/{r.name}", int(buf.data_ptr()), r.slot_bytes, n,
                                          MemoryKind.HOST))
        except BaseException:
            self._abandon()  # the pool may get a lender again
            raise
        self._regions = tuple(regions)
        self._region_of = {r.name: reg for r, reg in zip(pool.row_regions(), regions)}
        self._queue: deque[Lease] = deque()
        self._grants: dict[int, list[int]] = {}  # lease id -> run start per part
        self._copies: dict[int, _Copy] = {}
        self._quarantined: set[int] = set()  # lease ids whose runs are quarantined
        self._unsettled: dict[int, tuple[Lease, list[int]]] = {}  # failed copies not yet proven ended
        self._broken = False  # the copy stream failed to synchronize: nothing more can be proven
        self._reclaimed = 0
        self._quarantined_total = 0
        self._faults = 0
        self._faults_end_unknown = False

    @property
    def regions(self) -> tuple[SlotRegion, ...]:
        return self._regions

    def stats(self) -> StagingStats:
        return StagingStats({n: s.stats() for n, s in self._slots.items()}, len(self._queue),
                            len(self._copies), self.fetches, self._reclaimed, self._quarantined_total)

    def inject_copy_faults(self, count: int, *, end_unknown: bool = False) -> None:
        """Fault injection (tests, chaos): the next ``count`` copies raise mid-issue.
        ``end_unknown``: and their end cannot be proven either (as with a broken device
        context), so their slots stay quarantined."""
        self._faults = count
        self._faults_end_unknown = end_unknown

    # --- granting -------------------------------------------------------------------------
    def _make_view(self, lease: Lease) -> None:
        for part in lease._parts:
            cap = self._slots[part.region.name].capacity
            if part.blocks.size > cap:
                raise LeaseError(f"{lease!r} needs {part.blocks.size} rows of {part.region.name!r}; staging holds "
                                 f"{cap} (sized for {self.fetch_tokens} tokens a fetch)")
        unfit = self._never_fits(lease)
        if unfit:
            raise LeaseError(unfit)
        self._queue.append(lease)
        self._pump()

    def _never_fits(self, lease: Lease) -> str | None:
        """Why ``lease`` can never be granted, now that copy faults quarantined slots; None if it can."""
        for part in lease._parts:
            usable = self._slots[part.region.name].usable_run()
            if part.blocks.size > usable:
                return (f"{lease!r} needs {part.blocks.size} rows of {part.region.name!r}; after copy faults the "
                        f"longest run of staging slots left is {usable}")
        return None

    def _pump(self) -> None:
        while self._queue:
            head = self._queue[0]
            unfit = self._never_fits(head)
            if unfit:  # a quarantine since it queued: it would hold up everyone behind it for good
                head.failure = unfit
                self._queue.popleft()
                continue
            starts = [self._slots[p.region.name].find(p.blocks.size) for p in head._parts]
            if any(s is None for s in starts):
                return  # strictly FIFO: nobody passes a head that does not fit
            for part, start in zip(head._parts, starts):
                self._slots[part.region.name].take(int(start), part.blocks.size)  # type: ignore[arg-type]
            self._queue.popleft()
            self._grants[head.id] = [int(s) for s in starts]  # type: ignore[arg-type]
            if head.write:
                head._view = self._staging_view(head)
            else:
                self._copy(head, to_device=False)

    def _staging_view(self, lease: Lease) -> Any:
        starts = self._grants[lease.id]
        regions = [self._region_of[p.region.name] for p in lease._parts]
        slots = [s + np.arange(p.blocks.size, dtype=np.int64) for p, s in zip(lease._parts, starts)]
        return self._rows_view(lease, regions, slots)

    # --- copies ---------------------------------------------------------------------------
    def _copy(self, lease: Lease, to_device: bool, arrived: dict[str, np.ndarray] | None = None) -> None:
        """Issue one batch of copies for the lease (all its parts), then track completion."""
        starts = self._grants[lease.id]
        record = _Copy(lease, None, arrived)
        try:
            if self._faults > 0:
                self._faults -= 1
                if self._faults_end_unknown:
                    self._broken = True
                raise RuntimeError("injected staging copy fault")
            if self._cuda:
                assert self._stream is not None
                self._stream.wait_stream(torch.cuda.current_stream(self.pool.device))
                with torch.cuda.stream(self._stream):
                    self._issue(lease, starts, to_device, arrived, record)
                    event = torch.cuda.Event()
                    event.record(self._stream)
                record.event = event
            else:
                self._issue(lease, starts, to_device, arrived, record)
        except Exception as exc:  # completion cannot be established
            self._copy_failed(lease, f"staging copy {'to device' if to_device else 'from device'} failed: {exc}")
            return
        self._copies[lease.id] = record
        self._poll_copies()

    def _issue(self, lease: Lease, starts: list[int], to_device: bool, arrived: dict[str, np.ndarray] | None,
               record: _Copy) -> None:
        for part, start in zip(lease._parts, starts):
            buf = self._buffers[part.region.name][start: start + part.blocks.size]
            rows = part.region.rows
            if not to_device:
                idx = torch.from_numpy(part.blocks).to(rows.device)
                if self._cuda:
                    tmp = rows.index_select(0, idx)
                    buf.copy_(tmp, non_blocking=True)
                    record.keep.append(tmp)
                else:
                    torch.index_select(rows, 0, idx, out=buf)
                continue
            assert arrived is not None
            sel = arrived.get(part.group)
            if sel is None or sel.size == 0:
                continue
            dst = torch.from_numpy(part.blocks[sel]).to(rows.device)
            src_rows = torch.from_numpy(sel).to(rows.device)
            if self._cuda:
                up = buf.to(rows.device, non_blocking=True)
                rows.index_copy_(0, dst, up.index_select(0, src_rows))
                record.keep.append(up)
            else:
                rows.index_copy_(0, dst, buf.index_select(0, src_rows))

    def _poll_copies(self) -> None:
        for lease_id, record in list(self._copies.items()):
            try:
                done = record.event is None or bool(record.event.query())
            except Exception as exc:
                del self._copies[lease_id]
                self._copy_failed(record.lease, f"staging copy completion unknown: {exc}")
                continue
            if not done:
                continue
            del self._copies[lease_id]
            lease = record.lease
            if record.arrived is None:
                lease._view = self._staging_view(lease)
            else:
                for group, idx in record.arrived.items():
                    self._record(lease, group, idx)

    def _copy_failed(self, lease: Lease, reason: str) -> None:
        lease.failure = reason
        self._quarantined.add(lease.id)
        self._unsettled[lease.id] = (lease, list(self._grants[lease.id]))
        for part, start in zip(lease._parts, self._grants[lease.id]):
            self._slots[part.region.name].quarantine(start, part.blocks.size)
            self._quarantined_total += part.blocks.size
        self._retain_buffers()
        if self._cuda:  # the device side of the copy may still run: keep its pages too
            for part in lease._parts:
                self.pool.allocator(part.group).retain(part.blocks)

    # --- lease life -------------------------------------------------------------------------
    def _arrive(self, lease: Lease, rows: dict[str, np.ndarray]) -> None:
        if lease.failure is not None:
            raise LeaseError(f"{lease!r} failed ({lease.failure}); its rows cannot be copied")
        self._copy(lease, to_device=True, arrived=rows)

    def _progress(self) -> None:
        self._poll_copies()
        self._settle_failed()
        super()._progress()
        self._pump()

    def _settle_failed(self) -> None:
        """Give back the slots (and device pages) of failed copies once nothing of them can
        still run."""
        if not self._unsettled or not self._copies_ended():
            return
        for lease_id, (lease, starts) in list(self._unsettled.items()):
            del self._unsettled[lease_id]
            self._quarantined.discard(lease_id)
            granted = lease_id in self._grants  # else the lease was unpinned while quarantined
            for part, start in zip(lease._parts, starts):
                self._slots[part.region.name].unquarantine(start, part.blocks.size, granted)
                self._reclaimed += part.blocks.size
                if self._cuda:
                    self.pool.allocator(part.group).unretain(part.blocks)

    def _copies_ended(self) -> bool:
        """True once no copy issued so far can run: host copies run on the calling thread, so
        one that raised has stopped; device copies have once the copy stream synchronizes."""
        if self._broken:
            return False
        if self._stream is None:
            return True
        try:
            self._stream.synchronize()
        except Exception:  # a broken context: no proof now or later
            self._broken = True
            return False
        return True

    def _before_release(self, lease: Lease) -> None:
        if lease in self._queue:
            self._queue.remove(lease)  # cancelled while waiting: stops blocking the queue
        return None

    def _can_unpin(self, lease: Lease) -> bool:
        return lease.id not in self._copies

    def _after_unpin(self, lease: Lease) -> None:
        starts = self._grants.pop(lease.id, None)
        if starts is None or lease.id in self._quarantined:
            self._quarantined.discard(lease.id)
            return None
        for part, start in zip(lease._parts, starts):
            self._slots[part.region.name].give(start, part.blocks.size)
        return None

    def _retain_own(self, leases: list[Lease]) -> dict[str, np.ndarray]:
        kept: dict[str, list[np.ndarray]] = {}
        self._unsettled.clear()  # shutdown's own _progress settled what it could: the rest stays
        for lease in leases:
            if lease in self._queue:
                self._queue.remove(lease)
            starts = self._grants.pop(lease.id, None)
            # A copy still in flight is not waited for: its slots and pages are kept for good.
            self._copies.pop(lease.id, None)
            if starts is None:
                continue
            for part, start in zip(lease._parts, starts):
                self._slots[part.region.name].quarantine(start, part.blocks.size)
                kept.setdefault(part.region.name, []).append(start + np.arange(part.blocks.size, dtype=np.int64))
        if kept:
            self._retain_buffers()
        return {name: np.concatenate(parts) for name, parts in kept.items()}

    def _retain_buffers(self) -> None:
        """Quarantined slots must outlive this lender: freeing the buffer would hand live
        storage back to the (pinned) host allocator."""
        if not any(buffers is self._buffers for buffers in _RETAINED):
            _RETAINED.append(self._buffers)
