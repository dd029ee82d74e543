"""Lenders: rows of a paged pool lent under leases, so no transfer writes into reused pages.

::

    lender = InPlaceLender(pool)            # or StagingLender(pool, fetch_tokens, max_fetches, max_bytes)
    backend.register(lender.regions)
    lease = lender.lend_write(req, (0, n))  # decode side: grows req, lends its empty rows
    view = lease.view()                     # None until ready (staging reads wait for a copy)
    hint = backend.describe(view)           # ... exchange hints, fetch/publish ...
    lease.track(attempt)                    # release then waits for the attempt to quiesce
    lease.mark_arrived(outcome.masks)       # write leases, once
    lease.release()                         # every lease, idempotent
    bounds = lender.readiness(req)          # ResumeBounds(usable_until, restart_floor)

An engine's own tensors instead of a pool: ``EngineKV`` (their geometry) and ``ExternalLender``
(leases over the engine's block table, with the engine's frees going through ``free``); see
``examples/engine_kv_tour.py``. One lender per pool or engine memory: a second is refused
until the first shuts down or is collected. An engine whose layer groups share one memory
with geometries of their own (full and sliding-window attention) lends each group with its
own lender under one joint claim (``ExternalLender.for_groups``).

Errors: LeaseError (misuse), LendingDisabled (reuse scope reset or shut down), LenderBusy
(shutdown with open leases, unless forced), AlreadyLent (a second lender over the same
memory), BlocksBusy (the engine frees blocks a transfer may still touch),
InvalidSubmission (malformed masks: anything but bool arrays).
"""

from kvxfer.lender.base import Lease, Lender, ShutdownReport
from kvxfer.lender.bounds import ResumeBounds, group_interval, resume_bounds
from kvxfer.lender.engine_kv import EngineKV, kv_identity
from kvxfer.lender.errors import AlreadyLent, BlocksBusy, LeaseError, LenderBusy, LendingDisabled
from kvxfer.lender.external import ExternalLease, ExternalLender
from kvxfer.lender.inplace import InPlaceLender
from kvxfer.lender.slots import SlotRuns, SlotStats
from kvxfer.lender.staging import StagingLender, StagingStats, rows_per_fetch

__all__ = [
    "AlreadyLent", "BlocksBusy", "EngineKV", "ExternalLease", "ExternalLender", "kv_identity", "InPlaceLender", "Lease", "LeaseError", "Lender", "LenderBusy", "LendingDisabled", "ResumeBounds",
    "ShutdownReport", "SlotRuns", "SlotStats", "StagingLender", "StagingStats", "group_interval",
    "resume_bounds", "rows_per_fetch",
]
