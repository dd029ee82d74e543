"""A worker's engine thread, and the asyncio side's waiting for what it starts.

Everything that touches the pool, the lender, the backend or the model runs on one engine
thread (a single-thread executor): the pool is not thread-safe, and a backend's methods must
come from one call sequence. The asyncio side only waits: for the engine thread's jobs, and
for attempts, whose ``wake`` callbacks set asyncio events.

``EngineClock`` says where the engine thread's time goes, which is what moving requests costs
the engine's own step loop: the jobs that exist only because requests move (``run_move``:
lend, describe, submit, arrival, set-aside, adopt) run between two steps and delay the next one,
and a step that runs while a transfer is in flight shares the machine with it (cores, memory
bandwidth, the GPU).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import torch

from kvxfer.contract import Attempt, Outcome

T = TypeVar("T")
log = logging.getLogger(__name__)
GONE_POLL_S = 0.05
"""How often ``settle`` asks whether the attempt's rows are still wanted: a client that left
stops its transfer within this, not at its deadline."""
CANCEL_GRACE_S = 5.0
"""After a cancel: how long ``settle`` waits for the attempt's outcome."""


def _concluded(attempt: Attempt) -> bool:
    return attempt.poll() is not None


JOBS = ("step", "engine", "transfer")
"""The engine thread's jobs: a step of the engine's batch (``run_step``), the engine's other
work (``run``: prefill admission, allocation, freeing), and the work a move adds (``run_move``)."""


class EngineClock:
    """Seconds and jobs of the engine thread by kind (``JOBS``), and the steps' seconds by
    whether rows of this worker were lent to a transfer (an open lease: a publish or fetch that
    may be moving, a reservation a peer may be writing) when the step began. Written by the
    engine thread, read when scraped."""

    def __init__(self) -> None:
        self.seconds = dict.fromkeys(JOBS, 0.0)
        self.jobs = dict.fromkeys(JOBS, 0)
        self.step_seconds = {"in_flight": 0.0, "none": 0.0}
        self.steps = {"in_flight": 0, "none": 0}
        # Asked on the engine thread before each job (the lender is that thread's): the worker
        # sets it once its lender exists.
        self.lent: Callable[[], bool] = lambda: False
        self._lock = threading.Lock()  # a scrape reads a consistent set

    def add(self, kind: str, seconds: float, moving: bool) -> None:
        with self._lock:
            self.seconds[kind] += seconds
            self.jobs[kind] += 1
            if kind == "step":
                key = "in_flight" if moving else "none"
                self.step_seconds[key] += seconds
                self.steps[key] += 1

    def _read(self, counts: dict[str, float] | dict[str, int]) -> dict[tuple[str, ...], float]:
        with self._lock:
            return {(k,): float(v) for k, v in counts.items()}

    def by_job(self) -> dict[tuple[str, ...], float]:
        return self._read(self.seconds)

    def jobs_by_kind(self) -> dict[tuple[str, ...], float]:
        return self._read(self.jobs)

    def step_seconds_by_transfers(self) -> dict[tuple[str, ...], float]:
        return self._read(self.step_seconds)

    def steps_by_transfers(self) -> dict[tuple[str, ...], float]:
        return self._read(self.steps)


class EngineThread:
    def __init__(self, name: str, device: torch.device) -> None:
        self.name = name  # the worker's, for the refusal once it is torn down
        # CUDA's current device is per host thread, and this one builds the backend (NIXL/UCX
        # may take the current context) and runs the model: it must be the pool's GPU.
        on_gpu = functools.partial(torch.cuda.set_device, device) if device.type == "cuda" else None
        self.executor = ThreadPoolExecutor(1, thread_name_prefix=f"kvxfer-{name}-engine", initializer=on_gpu)
        self.loop: asyncio.AbstractEventLoop | None = None  # the asyncio side's, once the worker starts
        self.torn_down = False  # set on the engine thread once the lender and backend are shut down
        self.clock = EngineClock()

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn(*args)`` on the engine thread: the engine's own work (not a step)."""
        return await self._queue("engine", fn, args)

    async def run_step(self, fn: Callable[..., T], *args: Any) -> T:
        """One step of the engine's batch (a forward over the requests decoding)."""
        return await self._queue("step", fn, args)

    async def run_move(self, fn: Callable[..., T], *args: Any) -> T:
        """Work that exists because a request's KV moves: lend, describe, submit, arrival, adopt."""
        return await self._queue("transfer", fn, args)

    async def _queue(self, kind: str, fn: Callable[..., T], args: tuple[Any, ...]) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.executor, self._timed, kind, fn, args)

    def _timed(self, kind: str, fn: Callable[..., T], args: tuple[Any, ...]) -> T:
        moving = self.clock.lent()
        start = time.perf_counter()
        try:
            return self._job(fn, args)
        finally:
            self.clock.add(kind, time.perf_counter() - start, moving)

    def _job(self, fn: Callable[..., T], args: tuple[Any, ...]) -> T:
        """Run one job on the engine thread, unless the worker was torn down: streams still
        running at close queue their next decode step behind the teardown, and that step
        would write K/V into blocks the forced lender shutdown retained (a peer may still
        write them) or free and commit them after the lender stopped watching the pool."""
        if self.torn_down:
            raise RuntimeError(f"worker {self.name!r} is shut down: its pool takes no more work")
        return fn(*args)

    async def cleanup(self, fn: Callable[..., object], *args: Any) -> None:
        """Run a clean-up job while an exception (a cancellation, say) is on its way out:
        shielded, so that the job runs even if the caller is cancelled again; a failure of its
        own (the worker torn down meanwhile) is logged, never raised in place of the exception
        under way. Call it from an ``except`` block that re-raises."""
        try:
            await asyncio.shield(self.run(fn, *args))
        except Exception as exc:
            log.warning("worker %s: clean-up %s failed while a call ended: %s: %s", self.name,
                        getattr(fn, "__name__", fn), type(exc).__name__, exc)

    def shutdown(self) -> None:
        self.executor.shutdown(wait=True)

    # --- waiting for attempts ---------------------------------------------------------------
    def waker(self) -> tuple[asyncio.Event, Callable[[], None]]:
        event = asyncio.Event()
        loop = self.loop
        assert loop is not None

        def wake() -> None:
            try:
                loop.call_soon_threadsafe(event.set)
            except RuntimeError:  # loop closed during shutdown: nobody waits any more
                pass
        return event, wake

    async def wait(self, attempt: Attempt, event: asyncio.Event, timeout: float,
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

    async def settle(self, attempt: Attempt, event: asyncio.Event, timeout: float,
                     gone: Callable[[], bool] = lambda: False) -> Outcome:
        """The attempt's outcome; on timeout, or once ``gone()`` (nobody wants its rows any
        more: the client left), cancel it and wait a grace period for the end. ``gone`` is
        asked every GONE_POLL_S while the attempt runs."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if await self.wait(attempt, event, min(left, GONE_POLL_S), _concluded):
                break
            if left <= GONE_POLL_S or gone():
                await self.run_move(attempt.cancel)
                await self.wait(attempt, event, CANCEL_GRACE_S, _concluded)
                break
        outcome = attempt.poll()
        if outcome is None:
            raise RuntimeError("attempt did not conclude within its deadline and the cancel grace period")
        return outcome
