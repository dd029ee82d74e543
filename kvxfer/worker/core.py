"""A prefill or decode worker: one model, one pool, one lender, one backend.

Everything that touches the pool, the lender, the backend or the model runs on one engine
thread (``kvxfer.worker.engine_thread``); the asyncio side only waits. The worker composes
its two roles, ``kvxfer.worker.prefill`` and ``kvxfer.worker.decode`` (DESIGN.md section 5,
the router carrying the opaque hint bytes), over the state they share
(``kvxfer.worker.state``: the calls in progress, the set-aside rows of
``kvxfer.worker.quarantine``, the meters); here are its lifecycle (start, teardown), the
calls that span both roles (abort, withdraw), health and metrics.
"""

from __future__ import annotations

import asyncio
import time
import zlib
from collections.abc import AsyncGenerator, Callable
from typing import Any, TypeVar

import torch

from kvxfer.backends.blob import MemoryStore
from kvxfer.backends.common import Corruptor
from kvxfer.backends.loopback import LoopbackFabric
from kvxfer.contract import MAX_HINT_TTL_S, Backend
from kvxfer.engine import LlamaModel, ShardedKVCache
from kvxfer.lender import InPlaceLender, Lender, StagingLender
from kvxfer.pool import PagedKVPool
from kvxfer.pool.spec import Layout
from kvxfer.worker.backends import make_backend
from kvxfer.worker.calls import AbortCall, GenerateCall, PrefillCall, PublishCall, ReserveCall, WithdrawCall
from kvxfer.worker.config import ROLES, WorkerConfig, integrity_state
from kvxfer.worker.decode import DecodeRole, Reserved
from kvxfer.worker.engine_thread import EngineThread
from kvxfer.worker.errors import Aborted, Refused
from kvxfer.worker.layers import LayerSubmitter
from kvxfer.worker.lease_transfers import GroupSubmitter
from kvxfer.worker.meters import outcome_bytes, reason_label
from kvxfer.worker.prefill import Held, PrefillRole
from kvxfer.worker.ranks import GroupLender
from kvxfer.worker.state import WorkerState
from kvxfer.worker.store import StoreSide, make_store_driver

# Where callers have always found them.
__all__ = ["ROLES", "Aborted", "Refused", "Worker", "WorkerConfig", "outcome_bytes", "reason_label"]

T = TypeVar("T")


class Worker:
    def __init__(self, config: WorkerConfig, *, model: Any = None,
                 fabric: LoopbackFabric | None = None, shared_store: MemoryStore | None = None) -> None:
        """``model``: a ``LlamaModel`` (None: made from ``config.model``), or under
        ``config.engine == "transformers"`` the model transformers loaded. ``fabric``: the
        loopback backend's, for workers of one process; ``shared_store``: an in-process store
        that ``store="memory"`` uses instead of /dev/shm (tests)."""
        self.config = config
        self.role = config.role
        # Bare "cuda" means the caller's current device, pinned here: the engine thread that
        # makes the pool has a current device of its own.
        device = _pinned(torch.device(config.device))
        hf_model = None
        self._hf: Any = None  # the transformers engine's driver (TransformersServing), if that engine serves
        if config.engine == "transformers":  # ``model`` is transformers' own (kvxfer.worker.hf_engine)
            if model is None:
                raise ValueError(f"worker {config.name!r}: the transformers engine needs the model transformers loaded")
            hf_model, model = model, None
        elif model is None:
            model = LlamaModel(config.model, device=device)
        if model is not None and _pinned(model.device) != device:
            raise ValueError(f"worker {config.name!r}: model on {model.device}, pool on {config.device}")
        self.device = str(device)  # where the pool lives (announced by ``kvxfer serve``)
        self.name = config.name or f"{config.role}"
        self._fabric = fabric
        self._shared_store = shared_store
        # Fault injection (--inject-corruption): one corruptor for this worker's fetching backends.
        self._corruptor = (Corruptor(seed=zlib.crc32(self.name.encode()), p_bit=config.inject_corruption / 2,
                                     p_row=config.inject_corruption / 2) if config.inject_corruption else None)
        self._engine = EngineThread(self.name, device)
        self._state = WorkerState(config, model, self.name, self._engine)
        if hf_model is not None:
            from kvxfer.worker.hf_engine import TransformersServing  # noqa: PLC0415 - imports transformers

            self._state.serving = self._hf = TransformersServing(hf_model, self._engine, num_blocks=config.num_blocks,
                                                                 model_name=config.model_name, name=f"{self.name}-kv",
                                                                 shape=config.model, device=self.device,
                                                                 layer_groups=config.layerwise)
        self._prefill = PrefillRole(self._state)
        self._decode = DecodeRole(self._state)
        self._sweeper: asyncio.Task[None] | None = None
        self.metrics = self._state.meters.registry  # a CollectorRegistry: an embedder may register it in theirs
        self.m_requests = self._state.meters.requests  # the HTTP adapter counts its calls here

    @property
    def model(self) -> LlamaModel | None:
        return self._state.model

    @model.setter
    def model(self, model: LlamaModel) -> None:  # both roles run the one the worker has now
        self._state.model = model

    # What only the engine thread may use (the pool is not thread-safe), made by start().
    @property
    def pool(self) -> PagedKVPool | None:
        return self._state.pool

    @property
    def lender(self) -> Lender | None:
        return self._state.lender

    @property
    def backend(self) -> Backend | None:
        return self._state.backend

    # --- lifecycle ------------------------------------------------------------------------
    async def start(self) -> None:
        self._engine.loop = asyncio.get_running_loop()
        await self._run(self._build)
        state = self._state
        self._engine.clock.lent = lambda: state.lender is not None and state.lender.open_leases > 0
        if self._hf is not None:
            self._hf.start()
        self._sweeper = asyncio.create_task(self._sweep())

    def _build(self) -> None:
        cfg, s = self.config, self._state
        if self._hf is not None:  # transformers' cache, lent in place: no pool
            self._hf.build()
            s.lender = self._hf.lender
            if self._hf.grouped:  # a lease, view and hint per layer group, each its own geometry
                s.submitter = LayerSubmitter()
            self._make_backend(0)
            return
        if cfg.engine_kv:
            self._build_group()
            return
        s.pool = pool = cfg.model.make_pool(cfg.num_blocks, device=self.device, name=f"{self.name}-kv",
                                            groups=cfg.layerwise)
        if cfg.layerwise > 1:
            s.submitter = LayerSubmitter()
        if cfg.lender == "staging":
            row = cfg.model.group_spec().row_bytes
            s.lender = StagingLender(pool, fetch_tokens=cfg.model.max_positions, max_fetches=8,
                                     max_bytes=max(cfg.num_blocks // 2, 1) * row)
        else:
            s.lender = InPlaceLender(pool)
        self._make_backend(_cuda_index(pool))
        if cfg.store:
            driver = make_store_driver(cfg.store, path=cfg.store_path, master=cfg.store_master,
                                       segment_bytes=cfg.store_segment_mib << 20, shared=self._shared_store)
            s.store = StoreSide(driver, pool, s.lender, self._engine, s.meters, s.quarantine,
                                cfg.transfer_timeout_s, f"{self.name}-store", cfg.integrity, self._corruptor)

    def _build_group(self) -> None:
        """A TP group of pools, one per rank, lent in place and moved as engine geometries."""
        cfg, s = self.config, self._state
        layout = Layout.LAYER_MAJOR if cfg.layout == "layer_major" else Layout.BLOCK_MAJOR
        cache = ShardedKVCache.create(cfg.model, cfg.tp, cfg.num_blocks, block_tokens=cfg.block_tokens,
                                      layout=layout, device=self.device, name=f"{self.name}-kv")
        s.pool = cache
        s.lender = lender = GroupLender(cache, cfg.model.kv_heads)
        s.submitter = GroupSubmitter(lender, cfg.model.kv_heads, cfg.peer_tp)
        self._make_backend(_cuda_index(cache.pool(0)))

    def _make_backend(self, device: int) -> None:
        cfg, s = self.config, self._state
        assert s.lender is not None
        backend_name = f"kvxfer-{self.name}" if cfg.backend != "nixl" else ""
        s.backend = make_backend(cfg.backend, cfg.mode, name=backend_name or _nixl_name(self.name),
                                 deadline_s=cfg.transfer_timeout_s, fabric=self._fabric,
                                 chunk_bytes=cfg.chunk_bytes, chunk_pause_s=cfg.chunk_pause_s,
                                 busy_poll=cfg.busy_poll, device=device,
                                 arena_bytes=cfg.arena_bytes, hint_ttl_s=min(cfg.hold_s, MAX_HINT_TTL_S),
                                 etcd_endpoints=cfg.etcd_endpoints, etcd_namespace=cfg.etcd_namespace,
                                 etcd_ttl_s=cfg.etcd_ttl_s, integrity=cfg.integrity,
                                 corrupt_landed=self._corruptor)
        skipped = s.backend.register(s.lender.regions)
        if skipped:
            raise RuntimeError(f"backend {cfg.backend!r} cannot reach the pool's "
                               f"{', '.join(sorted({r.memory_kind.name for r in skipped}))} memory "
                               f"({', '.join(r.name for r in skipped)}): use --lender staging or another backend")

    async def close(self) -> dict[str, int]:
        """Stop: release what is safe, shut the backend and lender down, stop the engine thread."""
        if self._state.closed:
            return {}
        self._state.closed = True
        if self._sweeper is not None:
            self._sweeper.cancel()
            await asyncio.gather(self._sweeper, return_exceptions=True)
        if self._hf is not None:
            await self._hf.stop()  # no step after this: the teardown retains what a peer may touch
        report = await self._run(self._teardown)
        self._engine.shutdown()
        return report

    def _teardown(self) -> dict[str, int]:
        s = self._state
        self._decode.quarantine_all()  # a peer may hold hint D: never reuse
        self._prefill.held.clear()
        self._engine.torn_down = True  # from here on no job touches the pool (see EngineThread)
        unquiesced = len(s.backend.shutdown()) if s.backend is not None else 0
        if s.store is not None:
            unquiesced += s.store.shutdown()
        if unquiesced == 0:
            s.quarantine.release_proven()  # rule 3: the backend proved nothing it submitted can touch memory
        s.reclaim()
        retained = 0
        if s.lender is not None:
            report = s.lender.shutdown(force=True)
            retained = sum(int(b.size) for b in report.retained_blocks.values())
        if self._hf is not None:
            self._hf.shutdown()
        return {"unquiesced_attempts": unquiesced, "retained_blocks": retained}

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        return await self._engine.run(fn, *args)

    async def _sweep(self) -> None:
        """Drop prefills never published and reservations never generated, after hold_s."""
        while True:
            await asyncio.sleep(min(5.0, self.config.hold_s / 4))
            await self._run(self._state.reclaim)
            await self._run(self._state.serving.reclaim)
            now = time.monotonic()
            await self._prefill.expire(now)
            await self._decode.expire(now)

    # --- the calls --------------------------------------------------------------------------
    def need(self, role: str) -> None:
        """Refused unless this worker has ``role`` and is not shutting down."""
        self._state.need(role)

    async def prefill(self, call: PrefillCall) -> dict[str, Any]:
        return await self._prefill.prefill(call)

    async def publish(self, call: PublishCall) -> AsyncGenerator[dict[str, Any], None]:
        return await self._prefill.publish(call)

    async def reserve(self, call: ReserveCall) -> dict[str, Any]:
        return await self._decode.reserve(call)

    async def generate(self, call: GenerateCall, gone: Callable[[], bool] = lambda: False
                       ) -> AsyncGenerator[dict[str, Any], None]:
        """A decode call's event stream; ``gone``: whether its client has left (then a fetch
        under way is cancelled and the stream ends without decoding)."""
        return await self._decode.generate(call, gone)

    async def abort(self, call: AbortCall) -> dict[str, Any]:
        """Drop a held prefill or a decode reservation. ``rows_safe`` (decode): the prefill
        worker cannot write into the reserved rows (it never received hint D, refused it
        before submitting, or is dead), so they can be reused; otherwise they are quarantined."""
        rid, rows_safe, calls = call.request, call.rows_safe, self._state.calls
        # Each check below runs before any await (a drop that finds nothing awaits nothing):
        # the tables stay as seen.
        if await self._prefill.drop(rid):
            return {"request": rid, "dropped": "held"}
        if await self._decode.drop(rid, rows_safe):
            return {"request": rid, "dropped": "reserved"}
        if calls.starting.get(rid) in ("prefill", "reserve"):
            # Its call is still running here (queued behind the engine thread, say) and goes
            # on after its caller gave up on it: the caller will never use what it makes.
            calls.aborted.add(rid)
            return {"request": rid, "dropped": "starting"}
        if rows_safe and rid in self._state.quarantine.exposed:
            await self._run(self._state.quarantine.release_exposed, rid)
            return {"request": rid, "dropped": "quarantined"}
        calls.abort_early(rid)
        return {"request": rid, "dropped": None}

    async def withdraw(self, call: WithdrawCall) -> dict[str, Any]:
        """Take back a decode worker's hint D here (``Backend.withdraw``): ``withdrawn`` true
        means this worker can reach those rows through it no more, now or later, so the
        decode worker may reuse them (the router then aborts there with rows_safe)."""
        backend = self._state.backend
        if backend is None or self._state.closed:
            raise Refused("worker is shutting down")
        # Every hint of a TP group's set is withdrawn (no short cut): the rows are safe only
        # when none of them can reach them.
        answers = [await self._run(backend.withdraw, h) for h in call.hint]
        return {"withdrawn": all(answers)}

    # --- health and metrics ----------------------------------------------------------------
    def health(self) -> dict[str, Any]:
        return {"status": "ok" if not self._state.closed else "closing", "role": self.role, "name": self.name,
                "engine": self._state.serving.name,
                "backend": self.config.backend, "mode": self.config.mode.value, "layerwise": self.config.layerwise,
                "integrity": integrity_state(self.config.backend, self.config.integrity),
                "scope": self.config.model.scope().hex()[:24], "active": self._active,
                "held": len(self._held), "reserved": len(self._reserved), "publisher": self.publisher(),
                "model": self.config.model_name, "limits": {"vocab_size": self.config.model.vocab_size,
                           "max_positions": self.config.model.max_positions}}

    def publisher(self) -> dict[str, str] | None:
        """This worker's backend as a peer ({agent, run}): a decode worker's /reserve binds
        hint D to the prefill worker that will publish with it (the router learns it here
        and from /prefill); None before start()."""
        return self._state.publisher()

    async def refresh_metrics(self) -> None:
        """Set the gauges (open leases, set-aside rows, pool blocks, active streams, held requests) from
        what they count now: read on the engine thread (lender and pool are not thread-safe).
        An embedder that scrapes ``metrics`` itself calls this first."""
        if not self._state.closed:
            snapshot = await self._run(self._gauges)
            for key, value in snapshot.items():
                gauge, labels = key
                gauge.set(value, **dict(labels))
        m = self._state.meters
        m.active.set(float(self._active))
        for table, count in (("prefill", len(self._held)), ("reservation", len(self._reserved)),
                             ("starting", len(self._starting))):
            m.held.set(float(count), table=table)

    async def metrics_text(self) -> str:
        """The Prometheus text of ``metrics`` (a prometheus_client CollectorRegistry of this
        worker's own), its gauges refreshed first."""
        await self.refresh_metrics()
        return self.metrics.render()

    def _gauges(self) -> dict[tuple[Any, tuple[tuple[str, str], ...]], float]:
        s, m = self._state, self._state.meters
        out: dict[tuple[Any, tuple[tuple[str, str], ...]], float] = {}
        lender = s.lender
        out[(m.open_leases, ())] = float(lender.open_leases if lender is not None else 0)
        s.reclaim()
        out[(m.quarantined_now, ())] = float(s.quarantine.rows(lender))
        s.serving.reclaim()  # blocks whose attempts quiesced since the last pass are not in use
        for group, stats in s.serving.block_stats().items():  # the pool, or transformers' cache
            for state, value in stats.items():
                out[(m.blocks, (("group", group), ("state", state)))] = float(value)
            if "blocks" in stats:  # a hybrid transformers cache's groups have no total: reusable only
                # Held by a request (or retained for a peer): neither free nor cached for reuse.
                in_use = stats["blocks"] - stats["free"] - stats["cached"]
                out[(m.blocks, (("group", group), ("state", "in_use")))] = float(in_use)
        return out

    # --- the tables the tests and health read (each has one owner) --------------------------
    @property
    def _held(self) -> dict[str, Held]:
        return self._prefill.held

    @property
    def _reserved(self) -> dict[str, Reserved]:
        return self._decode.reserved

    @property
    def _starting(self) -> dict[str, str]:
        return self._state.calls.starting

    @property
    def _aborted(self) -> set[str]:
        return self._state.calls.aborted

    @property
    def _aborted_early(self) -> dict[str, float]:
        return self._state.calls.aborted_early

    @property
    def _active(self) -> int:
        return self._state.calls.streams

    @property
    def _quarantined(self) -> list[Any]:
        return self._state.quarantine.quarantined

    @property
    def _exec(self) -> Any:
        return self._engine.executor


def _pinned(device: torch.device) -> torch.device:
    """A CUDA device with its index (bare "cuda" means the current device), or cpu (one memory)."""
    if device.type != "cuda":
        return torch.device(device.type)
    return device if device.index is not None else torch.device("cuda", torch.cuda.current_device())


def _cuda_index(pool: PagedKVPool) -> int:
    """The GPU the pool's rows are on, from its storage: an IPC backend serves one device and
    refuses regions on another. A host pool answers 0, which no CUDA backend accepts anyway."""
    rows = pool.storage(pool.groups[0].name)
    return int(rows.device.index) if rows.is_cuda else 0


def _nixl_name(role: str) -> str:
    from kvxfer.backends.nixl import unique_agent_name  # noqa: PLC0415

    return unique_agent_name(f"kvxfer-{role}")
