"""Experiment 2: serving under worker kills. 2 prefill + 2 decode worker processes (NIXL over
host memory), an in-process Router with ``on_failure="recompute"``, requests at concurrency 4.

Every ``requests / (kills + 1)`` completed requests one worker is SIGKILLed, round-robin
over prefill0, decode0, prefill1, decode1. A worker of the same role and name is started
at once on a fresh port; while it starts, the router keeps the dead URL (it marks it down
and routes around it), and a kill of the other worker of that role waits: at most one
worker of each role is down at a time. Once the new worker is ready, a new Router is built
over the current URL set and takes every later request; requests already running finish
on the router they started on. That is what a deployment does when a supervisor restarts
a worker and the router's worker list is reloaded.

Every completion is checked token for token against colocated generation.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from pathlib import Path

from kvxfer.engine import ModelConfig, synthetic_prompts
from kvxfer.router import Completion, Router
from kvxfer.testing.reliability.common import (
    READY_TIMEOUT_S,
    Progress,
    WorkerLeftovers,
    max_ms,
    ms,
    start_workers,
    worker_argv,
    worker_leftovers,
)
from kvxfer.testing.reliability.oracle import expected_outputs
from kvxfer.worker.procs import Child, ProcessGroup

VICTIMS = ("prefill0", "decode0", "prefill1", "decode1")
ROUTER_TIMEOUT_S = 20.0


@dataclass(frozen=True)
class KillEvent:
    worker: str
    after_completed: int
    at_s: float                    # since the workload started
    in_flight: int                 # requests submitted before the kill and finished after it
    in_flight_done_s: float | None  # kill -> the last of those finished (ok or not)
    restarted_after_s: float | None  # kill -> replacement ready
    restart_error: str
    recovery_s: float | None       # kill -> first request submitted after it that completed ok


@dataclass(frozen=True)
class ChaosSummary:
    requests: int
    ok: int
    failures: int                  # completion.error set (or the router raised)
    wrong: int                     # ok, but tokens differ from colocated generation
    recovered_paths: dict[str, int]  # completions by path ("disaggregated", "resumed", "local")
    kills_asked: int
    kills: int                     # fewer than asked when the requests ran out while a victim restarted
    recovery_p50_ms: float | None
    recovery_max_ms: float | None
    not_recovered: int             # kills after which no later-submitted request completed ok
    seconds: float
    kill_events: tuple[KillEvent, ...]
    failure_samples: tuple[str, ...]
    workers_after: tuple[WorkerLeftovers, ...]  # the live workers at the end: held, reserved, leases


@dataclass
class _Done:
    index: int
    submitted: float
    finished: float
    completion: Completion | None
    error: str | None


@dataclass
class _Kill:
    worker: str
    after_completed: int
    at: float
    restarted_after_s: float | None = None
    restart_error: str = ""


async def _workload(group: ProcessGroup, live: dict[str, Child], prompts: list[list[int]], max_new: int,
                    kill_at: list[int], concurrency: int, shown: Progress
                    ) -> tuple[list[_Done], list[_Kill]]:
    routers = [Router([live["prefill0"].url, live["prefill1"].url], [live["decode0"].url, live["decode1"].url],
                      on_failure="recompute", timeout_s=ROUTER_TIMEOUT_S)]
    start = time.perf_counter()
    results: list[_Done] = []
    kills: list[_Kill] = []
    restarts: set[asyncio.Task[None]] = set()
    down: set[str] = set()  # roles with a victim being replaced
    in_flight: dict[int, int] = {}  # requests running, by index into routers
    pending = iter(range(len(prompts)))

    async def restart(name: str, event: _Kill) -> None:
        child = group.start(name, worker_argv(_role(name), name))
        try:
            await asyncio.to_thread(child.wait_ready, READY_TIMEOUT_S)  # requests go on meanwhile
        except asyncio.CancelledError:
            child.kill()  # its wait_ready (in a thread) then ends at once, and asyncio.run can return
            raise
        except Exception as exc:  # reported; the router goes on with the workers it has
            event.restart_error = f"{type(exc).__name__}: {exc}"[:300]
            return
        live[name] = child
        event.restarted_after_s = time.perf_counter() - event.at
        routers.append(Router([live["prefill0"].url, live["prefill1"].url],
                              [live["decode0"].url, live["decode1"].url],
                              on_failure="recompute", timeout_s=ROUTER_TIMEOUT_S))

    def kill_next() -> None:
        name = VICTIMS[len(kills) % len(VICTIMS)]
        event = _Kill(name, len(results), time.perf_counter())
        live[name].kill()
        kills.append(event)
        shown.note(f"killed {name} after {len(results)} completions")
        task = asyncio.create_task(restart(name, event))
        restarts.add(task)
        down.add(_role(name))

        def replaced(t: asyncio.Task[None]) -> None:
            restarts.discard(t)
            down.discard(_role(name))
        task.add_done_callback(replaced)

    async def lane() -> None:
        for i in pending:
            which = len(routers) - 1  # the newest URL set
            in_flight[which] = in_flight.get(which, 0) + 1
            submitted = time.perf_counter()
            try:
                done: Completion | None = await routers[which].generate(prompts[i], max_new, request=f"chaos-{i}")
                error = done.error if done is not None else None
            except Exception as exc:  # a router that raises is a failure to report, not to hide
                done, error = None, f"router raised {type(exc).__name__}: {exc}"
            finally:
                in_flight[which] -= 1
            results.append(_Done(i, submitted, time.perf_counter(), done, error))
            shown.tick(len(results), f"{sum(r.error is not None for r in results)} failed")
            # At most one worker of a role down, as every request in flight sees it: a kill
            # that falls due while the last victim of its role is being replaced, or while
            # requests still run on a router older than the replacement (they know only the
            # dead URL), waits. Requests finish in tens of ms here, faster than a worker
            # starts; with both workers of a role dead to a router, nothing it runs can finish,
            # which says nothing about recovery.
            stale = any(n for r, n in in_flight.items() if r < len(routers) - 1)
            if kill_at and len(results) >= kill_at[0] and not stale \
                    and _role(VICTIMS[len(kills) % len(VICTIMS)]) not in down:
                kill_at.pop(0)
                kill_next()

    try:
        await asyncio.gather(*(lane() for _ in range(concurrency)))
        if restarts:
            await asyncio.wait(set(restarts))
    finally:
        for task in list(restarts):
            task.cancel()
        await asyncio.gather(*restarts, return_exceptions=True)
        for router in routers:
            await router.close()
    for event in kills:
        event.at -= start
    for r in results:
        r.submitted -= start
        r.finished -= start
    return results, kills


def run_chaos(requests: int, kills: int, *, max_new: int = 8, concurrency: int = 4, seed: int = 11,
              log_dir: Path, progress: bool = True) -> ChaosSummary:
    config = ModelConfig()
    prompts = synthetic_prompts(requests, 4, 48, config.vocab_size, seed=seed)
    shown = Progress("chaos", requests, enabled=progress)
    expected = expected_outputs(config, prompts, [max_new] * len(prompts))
    kill_at = [round(requests * (k + 1) / (kills + 1)) for k in range(kills)]
    started = time.perf_counter()
    with ProcessGroup(log_dir) as group:
        names = [("prefill", "prefill0"), ("prefill", "prefill1"), ("decode", "decode0"), ("decode", "decode1")]
        live = {c.name: c for c in start_workers(group, names)}
        shown.note("4 workers ready")
        results, events = asyncio.run(_workload(group, live, prompts, max_new, kill_at, concurrency, shown))
        after = tuple(asyncio.run(_leftovers(list(live.values()))))
    seconds = time.perf_counter() - started
    summary = _summary(results, events, expected, kills, seconds, after)
    shown.finish(f"{summary.ok}/{summary.requests} ok, {summary.failures} failed, {summary.wrong} wrong")
    return summary


def _summary(results: list[_Done], events: list[_Kill], expected: list[list[int]], kills_asked: int,
             seconds: float, after: tuple[WorkerLeftovers, ...]) -> ChaosSummary:
    failures = [r for r in results if r.error is not None]
    wrong = [r for r in results if r.error is None and r.completion is not None
             and list(r.completion.tokens) != expected[r.index]]
    kill_events = [_kill_event(e, results) for e in events]
    recoveries = [k.recovery_s for k in kill_events if k.recovery_s is not None]
    return ChaosSummary(
        requests=len(results), ok=len(results) - len(failures), failures=len(failures), wrong=len(wrong),
        recovered_paths=_paths(results), kills_asked=kills_asked, kills=len(kill_events),
        recovery_p50_ms=ms(recoveries, 50),
        recovery_max_ms=max_ms(recoveries), not_recovered=sum(k.recovery_s is None for k in kill_events),
        seconds=round(seconds, 2), kill_events=tuple(kill_events),
        failure_samples=tuple(sorted({str(r.error)[:300] for r in failures}))[:10], workers_after=after)


def _paths(results: list[_Done]) -> dict[str, int]:
    """Completions that succeeded, by the path they took."""
    paths: dict[str, int] = {}
    for r in results:
        if r.completion is not None and r.error is None:
            paths[r.completion.path] = paths.get(r.completion.path, 0) + 1
    return paths


def _kill_event(e: _Kill, results: list[_Done]) -> KillEvent:
    """A kill as the requests around it saw it: those it caught running, and the first
    submitted after it that completed (its recovery)."""
    later = [r.finished for r in results if r.submitted > e.at and r.error is None]
    caught = [r.finished - e.at for r in results if r.submitted < e.at < r.finished]
    return KillEvent(
        e.worker, e.after_completed, round(e.at, 3), len(caught), round(max(caught), 3) if caught else None,
        None if e.restarted_after_s is None else round(e.restarted_after_s, 3), e.restart_error,
        round(min(later) - e.at, 3) if later else None)


def _role(name: str) -> str:
    return name.rstrip("0123456789")


async def _leftovers(children: list[Child]) -> list[WorkerLeftovers]:
    return [await worker_leftovers(c) for c in children]
