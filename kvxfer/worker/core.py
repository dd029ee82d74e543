"""A prefill or decode worker: one model, one pool, one lender, one backend.

Everything that touches the pool, the lender, the backend or the model runs on one
engine thread (a single-thread executor): the pool is not thread-safe, and a backend's
methods must come from one call sequence. The asyncio side only waits: for the engine
thread's jobs, and for attempts, whose ``wake`` callbacks set asyncio events.

Flows (DESIGN.md section 5), the router carrying the opaque hint bytes:

- decode ``reserve``: allocate, ``lend_write`` the prompt's rows, ``describe`` -> hint D.
- prefill ``prefill``: allocate, run the prompt, keep its K/V, answer the first token.
- prefill ``publish``: ``lend_read``, ``describe`` -> hint P (streamed at once), then
  ``publish(view_P, hint_D)``, stream the outcome, release, free.
- decode ``generate``: ``fetch(view_D, hint_P)``, ``mark_arrived(masks)``, release, then
  ``readiness()``: resume at ``usable_until`` and recompute the rest (policy recompute) or
  refuse (policy fail); then decode token by token, streaming.

A reservation whose rows a peer may still write (no hint P came, and the prefill worker
is not known dead) is quarantined: its lease stays open, so its blocks are not reused,
until the publisher proves it can reach them no more (its /withdraw; the router then aborts
here with rows_safe). Without that proof they stay out of use for good: the only safe
answer when nobody can prove the peer stopped. Rows whose attempt exists come back when it
quiesces; those of a submission that raised, once the backend's shutdown proves nothing can
touch them (rule 3 of the contract).
"""

from __future__ import annotations

import asyncio
import base64
import functools
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncGenerator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from kvxfer import wire
from kvxfer.backends.loopback import LoopbackFabric
from kvxfer.backends.transfers import MAX_HINT_TTL_S, put_bounded
from kvxfer.contract import (
    Attempt,
    Backend,
    Cancelled,
    Delivered,
    Failed,
    InvalidSubmission,
    KvxferError,
    Outcome,
    Peer,
    SubmissionRejected,
    TransferMode,
    View,
)
from kvxfer.engine import LlamaModel, ModelConfig, tokens_needed
from kvxfer.lender import InPlaceLender, Lease, Lender, StagingLender
from kvxfer.pool import PagedKVPool
from kvxfer.serving.metrics import Registry
from kvxfer.worker.backends import make_backend
from kvxfer.worker.calls import (
    AbortCall,
    GenerateCall,
    PrefillCall,
    PublishCall,
    ReserveCall,
    WithdrawCall,
)

log = logging.getLogger(__name__)
_EARLY_ABORTS_KEPT = 4096  # aborts of ids not seen yet: bounded, whoever sends them
T = TypeVar("T")
ROLES = ("prefill", "decode")


@dataclass(frozen=True)
class WorkerConfig:
    role: str
    model: ModelConfig = field(default_factory=ModelConfig)
    num_blocks: int = 2048
    backend: str = "nixl"
    mode: TransferMode = TransferMode.PUSH
    lender: str = "inplace"
    transfer_timeout_s: float = 30.0
    hold_s: float = 120.0
    prefix_cache: bool = True
    name: str = ""
    chunk_bytes: int | None = None  # nixl: bytes per submission chunk (None: the backend's default)
    chunk_pause_s: float = 0.0      # nixl: pause between chunk posts (fault-injection tests)
    device: str = "cpu"             # where the pool lives (the model must be on the same device)
    busy_poll: bool = False         # ipc: spin while transfers wait, and offer a doorbell (make_backend)
    arena_bytes: int | None = None  # nixl: the packed path's bounce arena (None: the backend's default, 0: none)

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        if self.lender not in ("inplace", "staging"):
            raise ValueError(f"lender must be 'inplace' or 'staging', got {self.lender!r}")
        if self.busy_poll and self.backend != "ipc":
            raise ValueError(f"busy_poll applies to the ipc backend only, not {self.backend!r}")
        if self.arena_bytes is not None and (self.backend != "nixl" or self.arena_bytes < 0):
            raise ValueError(f"arena_bytes applies to the nixl backend only and is >= 0, got {self.arena_bytes} "
                             f"with {self.backend!r}")


class Refused(KvxferError):
    """The worker refuses this call as it stands: the wrong role, an id already in use here, no
    such held prefill or reservation, a completion past the model's positions, or shutting
    down. Nothing was made or submitted (the HTTP API answers 400)."""


class Aborted(KvxferError):
    """A /prefill or /reserve whose request was aborted while it ran: what it made is dropped
    and nothing was submitted (the HTTP API answers 409)."""


def reason_label(outcome: Outcome | None, reason: str = "") -> str:
    """A short, bounded label for metrics (the full reason goes to logs and responses)."""
    if isinstance(outcome, Cancelled):
        return "cancelled_by_peer" if outcome.by_peer else "cancelled"
    text = (reason or (outcome.reason if isinstance(outcome, Failed) else "")).lower()
    for words, label in ((("dead", "disconnect", "gone", "unreachable"), "peer_gone"),
                         (("deadline", "timeout", "timed out"), "timeout"), (("inject",), "injected")):
        if any(w in text for w in words):
            return label
    return "transfer_error"


def outcome_bytes(view: View, outcome: Outcome) -> int:
    return sum(int(m.sum()) * g.region.slot_bytes for g, m in zip(view.groups, outcome.masks))


def _status(outcome: Outcome) -> str:
    return {Delivered: "delivered", Failed: "failed", Cancelled: "cancelled"}[type(outcome)]


@dataclass(eq=False)
class _Held:
    """A prefill request whose K/V waits for a publish."""

    prompt: list[int]
    first: int
    since: float
    busy: bool = False


@dataclass(eq=False)
class _Reserved:
    """A decode reservation: its write lease and the view behind hint D."""

    prompt: list[int]
    max_new: int
    lease: Lease
    view: View
    since: float
    busy: bool = False


class Worker:
    def __init__(self, config: WorkerConfig, *, model: LlamaModel | None = None,
                 fabric: LoopbackFabric | None = None) -> None:
        self.config = config
        self.role = config.role
        # Bare "cuda" means the caller's current device, pinned here: the engine thread that
        # makes the pool has a current device of its own.
        device = _pinned(torch.device(config.device))
        self.model = model if model is not None else LlamaModel(config.model, device=device)
        if _pinned(self.model.device) != device:
            raise ValueError(f"worker {config.name!r}: model on {self.model.device}, pool on {config.device}")
        self.device = str(device)  # where the pool lives (announced by ``kvxfer serve``)
        self.name = config.name or f"{config.role}"
        self._fabric = fabric
        # CUDA's current device is per host thread, and this one builds the backend (NIXL/UCX
        # may take the current context) and runs the model: it must be the pool's GPU.
        on_gpu = functools.partial(torch.cuda.set_device, device) if device.type == "cuda" else None
        self._exec = ThreadPoolExecutor(1, thread_name_prefix=f"kvxfer-{self.name}-engine", initializer=on_gpu)
        self.pool: PagedKVPool | None = None
        self.lender: Lender | None = None
        self.backend: Backend | None = None
        self._held: dict[str, _Held] = {}
        self._reserved: dict[str, _Reserved] = {}
        # Ids whose prefill, reservation or local generation is being set up (across awaits),
        # and which of the three: a second call with one of them is refused at once instead
        # of failing in the pool, and an abort can reach a prefill or reservation being made.
        self._starting: dict[str, str] = {}
        # Ids aborted while their /prefill or /reserve ran: dropped as soon as it is made.
        # Each entry goes when its call ends, so the set holds only calls in progress.
        self._aborted: set[str] = set()
        # Ids aborted before their /prefill or /reserve arrived here (the router's timer fired
        # while the call waited to be read): that call, if it comes within hold_s, is refused
        # at once, as it would otherwise hold what it makes until hold_s and then quarantine it.
        self._aborted_early: OrderedDict[str, float] = OrderedDict()
        # Rows set aside because a peer may still touch them: leases kept open (no attempt can
        # tell when access ends, until the backend's shutdown proves it), and released leases
        # whose attempt has not quiesced yet (the lender reuses their rows once it does).
        self._quarantined: list[tuple[Lease, int]] = []
        # Of those, reservations whose hint D went out, by request id: an /abort with
        # rows_safe (the router's proof, from the publisher's /withdraw) gives them back.
        self._exposed: dict[str, tuple[Lease, int]] = {}
        self._settling: list[tuple[Attempt, int]] = []
        self._staging_seen = (0, 0)  # the staging lender's quarantined and reclaimed totals, counted
        self._active = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._sweeper: asyncio.Task[None] | None = None
        self._closed = False
        self._torn_down = False  # set on the engine thread once the lender and backend are shut down
        self._metrics()

    # --- lifecycle ------------------------------------------------------------------------
    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        await self._run(self._build)
        self._sweeper = asyncio.create_task(self._sweep())

    def _build(self) -> None:
        cfg = self.config
        self.pool = cfg.model.make_pool(cfg.num_blocks, device=self.device, name=f"{self.name}-kv")
        if cfg.lender == "staging":
            row = cfg.model.group_spec().row_bytes
            self.lender = StagingLender(self.pool, fetch_tokens=cfg.model.max_positions, max_fetches=8,
                                        max_bytes=max(cfg.num_blocks // 2, 1) * row)
        else:
            self.lender = InPlaceLender(self.pool)
        backend_name = f"kvxfer-{self.name}" if cfg.backend != "nixl" else ""
        self.backend = make_backend(cfg.backend, cfg.mode, name=backend_name or _nixl_name(self.name),
                                    deadline_s=cfg.transfer_timeout_s, fabric=self._fabric,
                                    chunk_bytes=cfg.chunk_bytes, chunk_pause_s=cfg.chunk_pause_s,
                                    busy_poll=cfg.busy_poll, device=_cuda_index(self.pool),
                                    arena_bytes=cfg.arena_bytes, hint_ttl_s=min(cfg.hold_s, MAX_HINT_TTL_S))
        skipped = self.backend.register(self.lender.regions)
        if skipped:
            raise RuntimeError(f"backend {cfg.backend!r} cannot reach the pool's "
                               f"{', '.join(sorted({r.memory_kind.name for r in skipped}))} memory "
                               f"({', '.join(r.name for r in skipped)}): use --lender staging or another backend")

    async def close(self) -> dict[str, int]:
        """Stop: release what is safe, shut the backend and lender down, stop the engine thread."""
        if self._closed:
            return {}
        self._closed = True
        if self._sweeper is not None:
            self._sweeper.cancel()
            await asyncio.gather(self._sweeper, return_exceptions=True)
        report = await self._run(self._teardown)
        self._exec.shutdown(wait=True)
        return report

    def _teardown(self) -> dict[str, int]:
        for r in list(self._reserved.values()):
            self._quarantine(r)  # a peer may hold hint D: never reuse
        self._reserved.clear()
        self._held.clear()
        self._torn_down = True  # from here on no job touches the pool (see _engine)
        unquiesced = len(self.backend.shutdown()) if self.backend is not None else 0
        if unquiesced == 0:
            # Rule 3: the backend proved that nothing it submitted can touch memory any more.
            # Not the reservations whose hint D is out: a peer may still use that (over IPC
            # a publisher maps our memory itself); they stay retained.
            exposed = {id(lease) for lease, _ in self._exposed.values()}
            for lease, rows in self._quarantined:
                if id(lease) not in exposed:
                    lease.release()
                    self.m_reclaimed.inc(rows)
            self._quarantined = [(lease, rows) for lease, rows in self._quarantined if id(lease) in exposed]
        self._reclaim()
        retained = 0
        if self.lender is not None:
            report = self.lender.shutdown(force=True)
            retained = sum(int(b.size) for b in report.retained_blocks.values())
        return {"unquiesced_attempts": unquiesced, "retained_blocks": retained}

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._exec, self._engine, fn, args)

    def _engine(self, fn: Callable[..., T], args: tuple[Any, ...]) -> T:
        """Run one job on the engine thread, unless the worker was torn down: streams still
        running at close queue their next decode step behind the teardown, and that step
        would write K/V into blocks the forced lender shutdown retained (a peer may still
        write them) or free and commit them after the lender stopped watching the pool."""
        if self._torn_down:
            raise RuntimeError(f"worker {self.name!r} is shut down: its pool takes no more work")
        return fn(*args)

    # --- waiting for attempts ---------------------------------------------------------------
    def _waker(self) -> tuple[asyncio.Event, Callable[[], None]]:
        event = asyncio.Event()
        loop = self._loop
        assert loop is not None

        def wake() -> None:
            try:
                loop.call_soon_threadsafe(event.set)
            except RuntimeError:  # loop closed during shutdown: nobody waits any more
                pass
        return event, wake

    async def _await(self, attempt: Attempt, event: asyncio.Event, timeout: float,
                     done: Callable[[Attempt], bool]) -> bool:
        deadline = time.monotonic() + timeout
        while not done(attempt):
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            event.clear()
            if done(attempt):
                break
            try:
                # Wake-ups are the fast path; the short poll bounds a missed one.
                await asyncio.wait_for(event.wait(), min(left, 0.05))
            except asyncio.TimeoutError:
                pass
        return True

    async def _settle(self, attempt: Attempt, event: asyncio.Event, timeout: float) -> Outcome:
        """The attempt's outcome; on timeout cancel it and wait a grace period for the end."""
        if not await self._await(attempt, event, timeout, lambda a: a.poll() is not None):
            await self._run(attempt.cancel)
            await self._await(attempt, event, 5.0, lambda a: a.poll() is not None)
        outcome = attempt.poll()
        if outcome is None:
            raise RuntimeError("attempt did not conclude within its deadline and the cancel grace period")
        return outcome

    # --- health and metrics ----------------------------------------------------------------
    def health(self) -> dict[str, Any]:
        return {"status": "ok" if not self._closed else "closing", "role": self.role, "name": self.name,
                "backend": self.config.backend, "mode": self.config.mode.value,
                "scope": self.config.model.scope().hex()[:24], "active": self._active,
                "held": len(self._held), "reserved": len(self._reserved), "publisher": self.publisher(),
                "limits": {"vocab_size": self.config.model.vocab_size,
                           "max_positions": self.config.model.max_positions}}

    def publisher(self) -> dict[str, str] | None:
        """This worker's backend as a peer ({agent, run}): a decode worker's /reserve binds
        hint D to the prefill worker that will publish with it (the router learns it here
        and from /prefill); None before start()."""
        if self.backend is None:
            return None
        peer = self.backend.peer
        return {"agent": peer.agent, "run": peer.run}

    def _metrics(self) -> None:
        r = self.metrics = Registry()
        self.m_requests = r.counter("kvxfer_worker_requests_total", "Control API calls, by endpoint and result.")
        self.m_transfers = r.counter("kvxfer_transfers_total", "Transfers concluded, by status.")
        self.m_bytes = r.counter("kvxfer_transfer_bytes_total", "Bytes delivered by transfers.")
        self.m_rows = r.counter("kvxfer_transfer_rows_total", "Rows delivered by transfers.")
        self.m_failures = r.counter("kvxfer_transfer_failures_total", "Transfers that failed, by reason.")
        self.m_recomputed = r.counter("kvxfer_recomputed_tokens_total", "Prompt tokens recomputed after a transfer.")
        self.m_tokens = r.counter("kvxfer_generated_tokens_total", "Tokens produced by this worker.")
        self.m_latency = r.histogram("kvxfer_transfer_seconds", "Submission to outcome, per transfer.")
        self.m_prefill = r.histogram("kvxfer_prefill_seconds", "Prompt forward pass time.")
        self.m_step = r.histogram("kvxfer_decode_step_seconds", "One decode step.")
        self.g_leases = r.gauge("kvxfer_open_leases", "Leases not yet released.")
        self.g_quarantined = r.gauge("kvxfer_quarantined_slots",
                                     "Rows set aside now because a peer may still touch them.")
        self.m_quarantined = r.counter("kvxfer_quarantined_slots_total",
                                       "Rows set aside because a peer may still touch them.")
        self.m_reclaimed = r.counter("kvxfer_reclaimed_slots_total",
                                     "Set-aside rows given back once no peer could touch them.")
        self.g_blocks = r.gauge("kvxfer_pool_blocks", "Pool blocks by state.")
        self.g_active = r.gauge("kvxfer_worker_active_streams", "Publish or generate streams in progress.")

    async def metrics_text(self) -> str:
        """Gauges are read on the engine thread (lender and pool are not thread-safe)."""
        if not self._closed:
            snapshot = await self._run(self._gauges)
            for key, value in snapshot.items():
                gauge, labels = key
                gauge.set(value, **dict(labels))
        self.g_active.set(float(self._active))
        return self.metrics.render()

    def _gauges(self) -> dict[tuple[Any, tuple[tuple[str, str], ...]], float]:
        out: dict[tuple[Any, tuple[tuple[str, str], ...]], float] = {}
        lender = self.lender
        out[(self.g_leases, ())] = float(lender.open_leases if lender is not None else 0)
        self._reclaim()
        rows = sum(n for _, n in self._quarantined) + sum(n for _, n in self._settling)
        if isinstance(lender, StagingLender):
            rows += sum(s.quarantined for s in lender.stats().regions.values())
        out[(self.g_quarantined, ())] = float(rows)
        if self.pool is not None:
            for group, stats in self.pool.stats().items():
                for state, value in stats.items():
                    out[(self.g_blocks, (("group", group), ("state", state)))] = float(value)
        return out

    def _quarantine(self, reserved: _Reserved, attempt: Attempt | None = None, rid: str | None = None) -> None:
        """A reservation's rows: with ``rid``, its hint D went out to a publisher that may
        still use it, and an /abort of ``rid`` with rows_safe gives them back."""
        self._quarantine_lease(reserved.lease, reserved.view, attempt)
        if rid is not None and attempt is None:
            self._exposed[rid] = (reserved.lease, reserved.view.rows)

    def _release_exposed(self, rid: str) -> bool:
        """The publisher proved that hint D of ``rid`` can reach our rows no more. Engine thread."""
        found = self._exposed.pop(rid, None)
        if found is None:
            return False
        lease, rows = found
        self._quarantined = [(q, n) for q, n in self._quarantined if q is not lease]
        lease.release()
        self.m_reclaimed.inc(rows)
        return True

    def _quarantine_lease(self, lease: Lease, view: View, attempt: Attempt | None = None) -> None:
        """Set the lease's rows aside: with the ``attempt`` that touches them, until it
        quiesces (the lease is released and tracks it); without one, until the backend's
        shutdown proves that nothing can touch them (rule 3). Engine thread with an attempt
        (the lender is called)."""
        self.m_quarantined.inc(view.rows)
        if attempt is None:
            self._quarantined.append((lease, view.rows))
            return
        lease.release()  # the lease tracks the attempt (submitters track what they submit)
        self._settling.append((attempt, view.rows))

    def _reclaim(self) -> None:
        """Count the set-aside rows whose attempts quiesced as given back (the lender
        unpins them: ``Lender.reclaim``), and the staging slots a failed copy held until it
        surely ended. Engine thread."""
        if isinstance(self.lender, StagingLender):
            stats = self.lender.stats()
            seen = (stats.quarantined_total, stats.reclaimed)
            self.m_quarantined.inc(seen[0] - self._staging_seen[0])
            self.m_reclaimed.inc(seen[1] - self._staging_seen[1])
            self._staging_seen = seen
        if not self._settling:
            return
        settled = [(a, n) for a, n in self._settling if a.quiesced()]
        if settled:
            self._settling = [(a, n) for a, n in self._settling if not a.quiesced()]
            self.m_reclaimed.inc(sum(n for _, n in settled))
            if self.lender is not None:
                self.lender.reclaim()

    def _count_transfer(self, view: View, outcome: Outcome, seconds: float) -> dict[str, Any]:
        status = _status(outcome)
        self.m_transfers.inc(status=status)
        nbytes = outcome_bytes(view, outcome)
        self.m_bytes.inc(nbytes)
        self.m_rows.inc(outcome.rows_delivered)
        self.m_latency.observe(seconds)
        reason = outcome.reason if isinstance(outcome, Failed) else ""
        if not isinstance(outcome, Delivered):
            self.m_failures.inc(reason=reason_label(outcome))
        return {"status": status, "reason": reason, "rows": view.rows, "rows_delivered": outcome.rows_delivered,
                "bytes": nbytes, "seconds": seconds}

    # --- prefill -----------------------------------------------------------------------------
    def need(self, role: str) -> None:
        """Refused unless this worker has ``role`` and is not shutting down."""
        if self.role != role:
            raise Refused(f"this is a {self.role} worker; that endpoint belongs to a {role} worker")
        if self._closed:
            raise Refused("worker is shutting down")

    async def prefill(self, call: PrefillCall) -> dict[str, Any]:
        self.need("prefill")
        rid, prompt = call.request, call.prompt
        if rid in self._held or rid in self._starting:
            raise Refused(f"request {rid!r} is already held here")
        self._refuse_if_aborted_early(rid)
        start = time.perf_counter()
        self._starting[rid] = "prefill"
        try:
            first = await self._run(self._prefill_sync, rid, prompt)
        finally:
            aborted = self._end_start(rid)
        if aborted:
            await self._run(self._free, rid)
            raise Aborted(f"request {rid!r} was aborted while it was prefilled; its blocks are freed")
        seconds = time.perf_counter() - start
        self.m_prefill.observe(seconds)
        self.m_tokens.inc()
        self._held[rid] = _Held(prompt, first, time.monotonic())
        return {"request": rid, "token": first, "compute_s": seconds, "prompt_tokens": len(prompt),
                "publisher": self.publisher()}

    def _prefill_sync(self, rid: str, prompt: list[int]) -> int:
        assert self.pool is not None
        self.pool.allocate(rid, len(prompt))
        try:
            return self.model.next_token(self.pool, rid, prompt, 0)
        except BaseException:
            self.pool.free(rid)
            raise

    async def publish(self, call: PublishCall) -> AsyncGenerator[dict[str, Any], None]:
        self.need("prefill")
        rid = call.request
        held = self._held.get(rid)
        if held is None or held.busy:
            raise Refused(f"request {rid!r} is not held here (never prefilled, already published, or expired)")
        decode_hint = call.decode_hint
        held.busy = True
        event, wake = self._waker()
        try:
            lease, view, prefill_hint, attempt, submitted = await self._run(self._publish_sync, rid, len(held.prompt),
                                                                      decode_hint, wake)
        except BaseException:
            self._held.pop(rid, None)
            await self._run(self._free, rid)
            raise
        return self._publish_events(rid, lease, view, prefill_hint, attempt, submitted, event)

    def _publish_sync(self, rid: str, n: int, decode_hint: Any, wake: Callable[[], None]
                      ) -> tuple[Lease, View, bytes, Attempt, float]:
        assert self.lender is not None and self.backend is not None
        lease = self.lender.lend_read(rid, (0, n))
        try:
            view = lease.view()
            if view is None:
                raise RuntimeError(f"read lease of {rid!r} is not ready (staging copy pending)")
            # Bound to the decode end that sent hint D: in pull mode hint P lets it READ these rows.
            prefill_hint = wire.encode_hint(self.backend.describe(view, decode_hint.peer))
            submitted = time.perf_counter()
        except BaseException:
            lease.release()
            raise
        try:
            attempt = self.backend.publish(view, decode_hint, wake)
        except (InvalidSubmission, SubmissionRejected):
            lease.release()  # the backend promises that nothing escaped
            raise
        except BaseException:
            # Rule 3: any other raise means memory access may have escaped (a peer may be
            # reading these rows) and no attempt tells when it stops: never reuse them.
            self._quarantine_lease(lease, view)
            raise
        lease.track(attempt)
        return lease, view, prefill_hint, attempt, submitted

    async def _publish_events(self, rid: str, lease: Lease, view: View, prefill_hint: bytes, attempt: Attempt,
                              submitted: float, event: asyncio.Event) -> AsyncGenerator[dict[str, Any], None]:
        self._active += 1
        try:
            yield {"event": "published", "hint": base64.b64encode(prefill_hint).decode(), "rows": view.rows}
            outcome = await self._settle(attempt, event, self.config.transfer_timeout_s)
            figures = self._count_transfer(view, outcome, time.perf_counter() - submitted)
            yield {"event": "transfer", "final": True, **figures}
        finally:
            try:
                self._held.pop(rid, None)
                if attempt.poll() is None:  # the router went away mid-transfer
                    await self._run(attempt.cancel)
                await self._run(self._release_and_free, lease, rid)
            finally:
                self._active -= 1  # last: "no active stream" means its clean-up is done

    def _release_and_free(self, lease: Lease, rid: str) -> None:
        lease.release()  # memory stays pinned until the tracked attempt is quiesced
        self._free(rid)

    def _free(self, rid: str) -> None:
        assert self.pool is not None
        if self.pool.has(rid):
            self.pool.free(rid)

    # --- decode ------------------------------------------------------------------------------
    async def reserve(self, call: ReserveCall) -> dict[str, Any]:
        self.need("decode")
        rid, prompt, max_new, publisher = call.request, call.prompt, call.max_new_tokens, call.publisher
        if rid in self._reserved or rid in self._starting:
            raise Refused(f"request {rid!r} is already reserved here")
        self._refuse_if_aborted_early(rid)
        self._starting[rid] = "reserve"
        try:
            hint, lease, view, reused = await self._run(self._reserve_sync, rid, prompt, max_new, publisher)
        finally:
            aborted = self._end_start(rid)
        if aborted:
            # Hint D would be in this answer, which a 409 replaces: it is never sent, so no
            # peer can write these rows.
            await self._run(self._release_and_free, lease, rid)
            raise Aborted(f"request {rid!r} was aborted while it was reserved; its rows are released")
        self._reserved[rid] = _Reserved(prompt, max_new, lease, view, time.monotonic())
        return {"request": rid, "hint": base64.b64encode(hint).decode(), "rows": view.rows, "reused_tokens": reused}

    def _reserve_sync(self, rid: str, prompt: list[int], max_new: int, publisher: Peer
                      ) -> tuple[bytes, Lease, View, int]:
        assert self.pool is not None and self.lender is not None and self.backend is not None
        need = tokens_needed(len(prompt), max_new)
        if need > self.config.model.max_positions:
            raise Refused(f"prompt plus completion is {need} tokens, over max_positions "
                             f"{self.config.model.max_positions}")
        # Share cached full blocks of the prompt except its last token: at least one row
        # always moves, so every request has a transfer whose outcome says it is complete.
        ids = prompt[:-1] if self.config.prefix_cache else None
        reused = self.pool.allocate(rid, need, token_ids=ids)
        lease = None
        try:
            lease = self.lender.lend_write(rid, (0, len(prompt)))
            view = lease.view()
            if view is None:
                raise Refused("no staging slots free for this reservation now; retry later")
            # Bound to one publisher: in push mode hint D lets its holder WRITE into these rows,
            # which later hold a cached prefix; no other worker, nor a restart of this one, may.
            hint = wire.encode_hint(self.backend.describe(view, publisher))
        except BaseException:
            if lease is not None:
                lease.release()  # no hint went out: nothing can touch these rows
            self.pool.free(rid)
            raise
        return hint, lease, view, reused

    async def abort(self, call: AbortCall) -> dict[str, Any]:
        """Drop a held prefill or a decode reservation. ``rows_safe`` (decode): the prefill
        worker cannot write into the reserved rows (it never received hint D, refused it
        before submitting, or is dead), so they can be reused; otherwise they are quarantined."""
        rid, rows_safe = call.request, call.rows_safe
        if self._held.pop(rid, None) is not None:
            await self._run(self._free, rid)
            return {"request": rid, "dropped": "held"}
        reserved = self._reserved.get(rid)
        if reserved is not None and not reserved.busy:
            del self._reserved[rid]
            await self._run(self._drop_reservation, rid, reserved, rows_safe)
            return {"request": rid, "dropped": "reserved"}
        if self._starting.get(rid) in ("prefill", "reserve"):
            # Its call is still running here (queued behind the engine thread, say) and goes
            # on after its caller gave up on it: the caller will never use what it makes.
            self._aborted.add(rid)
            return {"request": rid, "dropped": "starting"}
        if rows_safe and rid in self._exposed:  # checked before any await: the tables above stay as seen
            await self._run(self._release_exposed, rid)
            return {"request": rid, "dropped": "quarantined"}
        put_bounded(self._aborted_early, rid, time.monotonic(), _EARLY_ABORTS_KEPT)
        return {"request": rid, "dropped": None}

    async def withdraw(self, call: WithdrawCall) -> dict[str, Any]:
        """Take back a decode worker's hint D here (``Backend.withdraw``): ``withdrawn`` true
        means this worker can reach those rows through it no more, now or later, so the
        decode worker may reuse them (the router then aborts there with rows_safe)."""
        if self.backend is None or self._closed:
            raise Refused("worker is shutting down")
        return {"withdrawn": await self._run(self.backend.withdraw, call.hint)}

    def _refuse_if_aborted_early(self, rid: str) -> None:
        since = self._aborted_early.pop(rid, None)
        if since is not None and time.monotonic() - since <= self.config.hold_s:
            raise Aborted(f"request {rid!r} was aborted before this call arrived; nothing is made")

    def _end_start(self, rid: str) -> bool:
        """End a /prefill's or /reserve's set-up of ``rid``: whether an abort came meanwhile
        (then what it made is dropped by the caller), forgetting the abort either way."""
        self._starting.pop(rid, None)
        aborted = rid in self._aborted
        self._aborted.discard(rid)
        return aborted

    def _drop_reservation(self, rid: str, reserved: _Reserved, rows_safe: bool) -> None:
        if rows_safe:
            reserved.lease.release()
        else:
            self._quarantine(reserved, rid=rid)
        self._free(rid)

    async def generate(self, call: GenerateCall) -> AsyncGenerator[dict[str, Any], None]:
        self.need("decode")
        rid, policy, rows_safe = call.request, call.on_failure, call.rows_safe
        timeout = call.timeout_s if call.timeout_s is not None else self.config.transfer_timeout_s
        reserved = self._reserved.get(rid)
        if reserved is not None:
            if reserved.busy:
                raise Refused(f"request {rid!r} is already generating")
            reserved.busy = True  # only once the call is known to be well formed
            return self._decode_events(rid, reserved.prompt, reserved.max_new, reserved, call.prefill_hint,
                                       call.first_token, policy, timeout, rows_safe)
        if call.prefill_hint is not None:
            raise Refused(f"request {rid!r} has no reservation here: reserve before generating with a hint")
        if call.prompt is None or call.max_new_tokens is None:
            raise Refused(f"request {rid!r} has no reservation here: generating without one needs 'prompt' and "
                          "'max_new_tokens'")
        prompt, max_new = call.prompt, call.max_new_tokens
        need = tokens_needed(len(prompt), max_new)
        if need > self.config.model.max_positions:
            raise Refused(f"prompt plus completion is {need} tokens, over max_positions "
                          f"{self.config.model.max_positions}")
        assert self.pool is not None
        if rid in self._starting or self.pool.has(rid):
            raise Refused(f"request {rid!r} is already in use here")
        return self._decode_events(rid, prompt, max_new, None, None, None, policy, timeout, True)

    async def _decode_events(self, rid: str, prompt: list[int], max_new: int, reserved: _Reserved | None,
                             prefill_hint: Any, first: int | None, policy: str, timeout: float,
                             rows_safe: bool) -> AsyncGenerator[dict[str, Any], None]:
        self._active += 1
        n = len(prompt)
        name = rid
        own = reserved  # the reservation this stream took over; others under this id are not ours
        suspect = False  # the delivered rows proved wrong: freed, not kept for prefix reuse
        owned = reserved is not None  # the pool request ``name`` is ours to finish
        if reserved is None:
            self._starting[rid] = "generate"
        try:
            transfer: dict[str, Any] | None = None
            if reserved is not None and prefill_hint is not None:
                try:
                    transfer = await self._fetch(rid, reserved, prefill_hint, timeout)
                except (KvxferError, RuntimeError) as exc:
                    # The fetch was refused or never settled; its rows stay out of use (see
                    # _fetch). Policy recompute: prefill the whole prompt in fresh blocks.
                    if policy == "fail":
                        raise
                    self.m_failures.inc(reason=reason_label(None, str(exc)))
                    transfer = {"status": "failed", "reason": f"{type(exc).__name__}: {exc}",
                                "rows": reserved.view.rows, "rows_delivered": 0, "bytes": 0, "seconds": 0.0}
                    owned = False
                    await self._run(self._free, rid)
                    name, reserved = f"{rid}#local", None
            elif reserved is not None:
                # No hint P: the prefill side failed before publishing. Unless the router
                # knows it cannot write into our rows, quarantine them and start afresh.
                owned = False
                await self._run(self._drop_reservation, rid, reserved, rows_safe)
                name = f"{rid}#local"
                reserved = None
                first = None
            if reserved is None:
                await self._run(self._allocate_local, name, prompt, max_new)
                owned = True
            self._starting.pop(rid, None)
            position = await self._run(self._usable, name, n)
            if position < n and transfer is not None and policy == "fail":
                yield {"event": "error", "final": True, "transfer": transfer,
                       "error": f"transfer {transfer['status']}: {transfer['rows_delivered']} of {transfer['rows']} "
                                f"rows arrived ({transfer['reason'] or 'incomplete'}); policy is fail"}
                return
            yield {"event": "resume", "position": position, "recompute_tokens": n - position, "transfer": transfer}
            index = 0
            if position < n or first is None:
                start = time.perf_counter()
                local = await self._run(self.model.next_token, self.pool, name, prompt[position:], position)
                self.m_prefill.observe(time.perf_counter() - start)
                self.m_recomputed.inc(n - position)
                self.m_tokens.inc()
                if first is not None and local != first:
                    # The rows that arrived are suspect: never name them for reuse (_finish).
                    suspect = True
                    yield {"event": "error", "final": True,
                           "error": f"recomputed first token {local} differs from the prefill worker's {first}"}
                    return
                first = local
                yield {"event": "token", "index": 0, "token": first}
            token = first
            for index in range(1, max_new):
                start = time.perf_counter()
                token = await self._run(self.model.next_token, self.pool, name, [token], n + index - 1)
                self.m_step.observe(time.perf_counter() - start)
                self.m_tokens.inc()
                yield {"event": "token", "index": index, "token": token}
            yield {"event": "done", "final": True, "tokens": max_new}
        finally:
            try:
                if own is None:
                    self._starting.pop(rid, None)
                elif self._reserved.get(rid) is own:
                    del self._reserved[rid]
                if owned:
                    await self._run(self._finish, name, prompt, not suspect)
            finally:
                self._active -= 1  # last: "no active stream" means its clean-up is done

    async def _fetch(self, rid: str, reserved: _Reserved, prefill_hint: Any, timeout: float) -> dict[str, Any]:
        event, wake = self._waker()
        submitted = time.perf_counter()
        try:
            attempt = await self._run(self._fetch_sync, reserved, prefill_hint, wake)
        except BaseException:
            # Refused (e.g. a layout mismatch): no attempt watches the peer that holds hint D,
            # so nobody can prove it never writes here. Never reuse these rows.
            self._quarantine(reserved)
            raise
        try:
            outcome = await self._settle(attempt, event, timeout)
        except RuntimeError:
            # Never concluded: its rows stay out of use until the attempt quiesces (a late
            # confirmation, the peer proven dead); recompute elsewhere in the pool.
            await self._run(self._quarantine, reserved, attempt)
            raise
        figures = self._count_transfer(reserved.view, outcome, time.perf_counter() - submitted)
        await self._run(self._arrive, reserved, outcome)
        # Decoding writes into the prompt's last block, which the lease pins until the
        # attempt is quiesced: wait for that (the backend wakes us) before going on.
        if not await self._await(attempt, event, 10.0, lambda a: a.quiesced()):
            raise RuntimeError(f"request {rid!r}: the fetch attempt concluded but did not quiesce within 10s")
        return figures

    def _fetch_sync(self, reserved: _Reserved, prefill_hint: Any, wake: Callable[[], None]) -> Attempt:
        assert self.backend is not None
        attempt = self.backend.fetch(reserved.view, prefill_hint, wake)
        reserved.lease.track(attempt)
        return attempt

    def _arrive(self, reserved: _Reserved, outcome: Outcome) -> None:
        reserved.lease.mark_arrived(outcome.masks)
        reserved.lease.release()

    def _allocate_local(self, name: str, prompt: list[int], max_new: int) -> None:
        assert self.pool is not None
        self.pool.allocate(name, tokens_needed(len(prompt), max_new),
                           token_ids=prompt[:-1] if self.config.prefix_cache else None)

    def _usable(self, name: str, n: int) -> int:
        assert self.lender is not None
        bounds = self.lender.readiness(name)
        return min(bounds.usable_until, n) if bounds is not None else 0

    def _finish(self, name: str, prompt: list[int], shareable: bool = True) -> None:
        """Free the request; with the prefix cache on and ``shareable``, its full prompt
        blocks stay named for later requests with that prefix."""
        assert self.pool is not None
        if not self.pool.has(name):
            return
        if shareable and self.config.prefix_cache and self._usable(name, len(prompt)) >= len(prompt):
            self.pool.commit(name, len(prompt), token_ids=prompt)  # full prompt blocks become shareable
        self.pool.free(name)

    # --- housekeeping ------------------------------------------------------------------------
    async def _sweep(self) -> None:
        """Drop prefills never published and reservations never generated, after hold_s."""
        while True:
            await asyncio.sleep(min(5.0, self.config.hold_s / 4))
            await self._run(self._reclaim)
            now = time.monotonic()
            for rid, held in list(self._held.items()):
                if not held.busy and now - held.since > self.config.hold_s:
                    self._held.pop(rid, None)
                    await self._run(self._free, rid)
            for rid, reserved in list(self._reserved.items()):
                if not reserved.busy and now - reserved.since > self.config.hold_s:
                    self._reserved.pop(rid, None)
                    await self._run(self._drop_reservation, rid, reserved, False)


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
