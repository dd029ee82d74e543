"""A worker's engine thread, and the asyncio side's waiting for what it starts.

Everything that touches the pool, the lender, the backend or the model runs on one engine
thread (a single-thread executor): the pool is not thread-safe, and a backend's methods must
come from one call sequence. The asyncio side only waits: for the engine thread's jobs, and
for attempts, whose ``wake`` callbacks set asyncio events.
"""

from __future__ import annotations

import asyncio
import functools
import logging
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


class EngineThread:
    def __init__(self, name: str, device: torch.device) -> None:
        self.name = name  # the worker's, for the refusal once it is torn down
        # CUDA's current device is per host thread, and this one builds the backend (NIXL/UCX
        # may take the current context) and runs the model: it must be the pool's GPU.
        on_gpu = functools.partial(torch.cuda.set_device, device) if device.type == "cuda" else None
        self.executor = ThreadPoolExecutor(1, thread_name_prefix=f"kvxfer-{name}-engine", initializer=on_gpu)
        self.loop: asyncio.AbstractEventLoop | None = None  # the asyncio side's, once the worker starts
        self.torn_down = False  # set on the engine thread once the lender and backend are shut down

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.executor, self._job, fn, args)

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
                await self.run(attempt.cancel)
                await self.wait(attempt, event, CANCEL_GRACE_S, _concluded)
                break
        outcome = attempt.poll()
        if outcome is None:
            raise RuntimeError("attempt did not conclude within its deadline and the cancel grace period")
        return outcome
