"""What a worker's prefill and decode roles share: its config and model, the engine thread
and what only that thread touches (the pool, the lender and the backend, made when the worker
starts), the calls in progress, the set-aside rows and the meters."""

from __future__ import annotations

from typing import Protocol

from kvxfer.backends.common import RowCheck
from kvxfer.contract import Backend
from kvxfer.engine import LlamaModel, ShardedKVCache
from kvxfer.lender import Lender
from kvxfer.pool import PagedKVPool
from kvxfer.worker.config import WorkerConfig
from kvxfer.worker.engine_thread import EngineThread
from kvxfer.worker.engines import ReferenceEngine, ServingEngine
from kvxfer.worker.errors import Refused
from kvxfer.worker.inflight import InFlight
from kvxfer.worker.lease_transfers import PoolSubmitter, Submitter
from kvxfer.worker.meters import Meters
from kvxfer.worker.quarantine import Quarantine
from kvxfer.worker.ranks import GroupLender
from kvxfer.worker.store import StoreSide


class Releasable(Protocol):
    """A lease, or the leases of a request's streamed layer groups (``GroupStream``)."""

    def release(self) -> None: ...


class WorkerState:
    def __init__(self, config: WorkerConfig, model: LlamaModel | None, name: str, engine: EngineThread) -> None:
        self.config = config
        self.role = config.role
        self.model = model  # the reference engine's (None where another engine serves)
        self.name = name
        self.engine = engine
        self.meters = Meters(config.model_name, self.integrity_rows_failed, engine.clock)
        self.calls = InFlight(config.hold_s)
        self.quarantine = Quarantine(self.meters, config.reclaim_grace_s)
        # One pool and its lender; or, for a TP group (``config.engine_kv``), the group's
        # ShardedKVCache and GroupLender, which offer the same calls (kvxfer.worker.ranks).
        self.pool: PagedKVPool | ShardedKVCache | None = None
        self.lender: Lender | GroupLender | None = None
        self.backend: Backend | None = None
        self.submitter: Submitter = PoolSubmitter()
        self.store: StoreSide | None = None  # --store: prefill puts, decode looks up (kvxfer.worker.store)
        # What computes and holds KV (kvxfer.worker.engines): the reference engine over the
        # pool, or one the worker puts here (kvxfer serve --engine transformers).
        self.serving: ServingEngine = ReferenceEngine(self)
        self.closed = False

    def need(self, role: str) -> None:
        """Refused unless this worker has ``role`` and is not shutting down."""
        if self.role != role:
            raise Refused(f"this is a {self.role} worker; that endpoint belongs to a {role} worker")
        if self.closed:
            raise Refused("worker is shutting down")

    def publisher(self) -> dict[str, str] | None:
        """This worker's backend as a peer ({agent, run}): a decode worker's /reserve binds
        hint D to the prefill worker that will publish with it (the router learns it here
        and from /prefill); None before start()."""
        if self.backend is None:
            return None
        peer = self.backend.peer
        return {"agent": peer.agent, "run": peer.run}

    def integrity_rows_failed(self) -> dict[tuple[str, ...], float]:
        """Rows the integrity checks refused so far, by source (the transfer backend, the store's),
        for those whose backend checks rows. Read from any thread: each is an int that only its
        backend's thread raises."""
        out: dict[tuple[str, ...], float] = {}
        store = self.store.backend if self.store is not None else None
        for source, backend in (("transfer", self.backend), ("store", store)):
            check = getattr(backend, "integrity", None)
            if isinstance(check, RowCheck):
                out[(source,)] = float(check.rows_failed)
        return out

    # --- engine thread -------------------------------------------------------------------------
    def free(self, rid: str) -> None:
        self.serving.free(rid)

    def release_and_free(self, lease: Releasable, rid: str) -> None:
        lease.release()  # memory stays pinned until the tracked attempt is quiesced
        self.free(rid)

    def reclaim(self) -> None:
        """Rows back from the transfers that quiesced since: set-aside ones (the quarantine's
        bookkeeping) and those of leases released while their attempt still ran, which stay
        pinned until the lender looks again; on an idle worker nothing else would look."""
        self.quarantine.reclaim(self.lender)
        if self.lender is not None:
            self.lender.reclaim()
