"""Runs a config: every (mode, case, point) once per figure identity, cases one after another.

A case's runner is built once and closed when its last figure is done, so a baseline's
second process starts once per run. Requirements are checked per case; a point a case
cannot reach becomes a skipped figure; any other failure becomes an error figure with
its message, and the run goes on.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvxfer.bench import results
from kvxfer.bench.cases import (
    CaseRunner,
    CaseSpec,
    Measurement,
    Role,
    Skip,
    devices_missing,
    release_shared,
    unmet,
)
from kvxfer.bench.config import BenchConfig, ConfigError, Point, format_size
from kvxfer.bench.progress import Progress
from kvxfer.bench.registry import registry
from kvxfer.bench.results import BenchResult, Figure


@dataclass(frozen=True)
class _Item:
    mode: str
    spec: CaseSpec
    point: Point


def plan(config: BenchConfig, specs: dict[str, CaseSpec] | None = None) -> list[_Item]:
    specs = registry() if specs is None else specs
    unknown = [c for c in config.cases if c not in specs]
    if unknown:
        raise ConfigError(f"unknown case(s) {', '.join(unknown)}: known are {', '.join(specs)}")
    by_mode: list[tuple[str, list[Point]]] = [
        ("throughput", config.throughput_points()),
        ("latency", config.latency.points() if config.latency else []),
        ("overhead", config.overhead.points() if config.overhead else []),
    ]
    items = []
    for name in config.cases:
        spec = specs[name]
        for mode, points in by_mode:
            if mode not in spec.modes:
                continue
            seen = set()
            for p in points:
                k = spec.key(p)
                if k not in seen:
                    seen.add(k)
                    items.append(_Item(mode, spec, p))
    return items


def _label(item: _Item) -> str:
    p = item.point
    return (f"{item.mode} {item.spec.name} {p.direction} {p.memory} {p.slots} "
            f"{format_size(p.row_bytes)} x {p.rows}" + (f" x {p.groups} groups" if p.groups > 1 else ""))


def _measure(runner: CaseRunner, item: _Item, config: BenchConfig) -> Measurement:
    if item.mode == "throughput":
        return runner.throughput(item.point)
    if item.mode == "latency":
        assert config.latency is not None
        return runner.latency(item.point, config.latency)
    assert config.overhead is not None
    return runner.overhead(item.point, config.overhead)


def run(config: BenchConfig, progress: Progress | None = None,
        specs: dict[str, CaseSpec] | None = None, log: Callable[[str], None] | None = None,
        time_limit_s: float | None = None) -> BenchResult:
    """Every planned figure, in plan order. Past ``time_limit_s``, or on KeyboardInterrupt
    (the CLI turns SIGTERM into one), the figures not yet run are reported as skipped with
    that reason and the result is returned: a run cut short still writes what it measured."""
    started = time.monotonic()
    stop_reason: str | None = None
    load_before = _loadavg()
    items = plan(config, specs)
    progress = progress or Progress(len(items), enabled=False)
    progress.total = max(len(items), 1)
    figures: list[Figure] = []
    runners: dict[str, CaseRunner | str] = {}   # a str is why the case could not be built
    remaining = {name: sum(1 for i in items if i.spec.name == name) for name in config.cases}
    try:
        for item in items:
            spec = item.spec
            key = dict(spec.key(item.point))
            if stop_reason is None and time_limit_s is not None and time.monotonic() - started > time_limit_s:
                stop_reason = f"not run: the run's time limit of {time_limit_s:g}s was reached"
            if stop_reason is not None:
                figures.append(Figure(item.mode, spec.name, spec.role.value, key, "skipped", stop_reason))
                progress.advance()
                continue
            progress.step(_label(item))

            def figure(status: str, reason: str = "", m: Measurement | None = None, _s: CaseSpec = spec,
                       _item: _Item = item, _key: dict[str, Any] = key) -> Figure:
                return Figure(_item.mode, _s.name, _s.role.value, _key, status, reason,
                              dict(m.metrics) if m else {}, dict(m.facts) if m else {})

            why = unmet(spec)
            if why is None and item.point.memory == "device":
                placed = devices_missing(config)
                why = f"device memory: {placed}" if placed else None
            if why is not None:
                figures.append(figure("skipped", why))
            else:
                runner = runners.get(spec.name)
                if runner is None:
                    try:
                        runner = spec.factory(config)
                    except Skip as err:
                        runner = str(err)
                    except Exception as err:
                        runner = f"could not start: {type(err).__name__}: {err}"
                    runners[spec.name] = runner
                if isinstance(runner, str):
                    figures.append(figure("error" if runner.startswith("could not") else "skipped", runner))
                else:
                    try:
                        try:
                            m = _measure(runner, item, config)
                        except KeyboardInterrupt:
                            stop_reason = "not run: the run was interrupted"
                            raise Skip("interrupted while measuring") from None
                        # per figure, since other work on the machine comes and goes during a run
                        m.facts.setdefault("loadavg_1m", _loadavg())
                        figures.append(figure("ok", m=m))
                    except Skip as err:
                        figures.append(figure("skipped", str(err)))
                    except Exception as err:
                        figures.append(figure("error", f"{type(err).__name__}: {err}"))
                        if log:
                            log(f"error in {_label(item)}: {type(err).__name__}: {err}")
            progress.advance()
            remaining[spec.name] -= 1
            if remaining[spec.name] == 0:
                done = runners.pop(spec.name, None)
                if done is not None and not isinstance(done, str):
                    done.close()
        if stop_reason is None:
            _second_pass(config, items, figures, progress)
    finally:
        for runner in runners.values():
            if not isinstance(runner, str):
                runner.close()
        release_shared()
        progress.finish()
    # Other work on the machine skews figures: say how busy it was around the run.
    machine = {**results.machine(), "loadavg_1m_before": load_before, "loadavg_1m_after": _loadavg()}
    return BenchResult(results.now(), machine, results.versions(), config.to_json(), tuple(figures),
                       time.monotonic() - started)


def _second_pass(config: BenchConfig, items: list[_Item], figures: list[Figure], progress: Progress) -> None:
    """Measure the references (local copy, NIXL one descriptor) again after everything else
    and keep the faster pass: a reference taken in a moment when other work slowed the
    machine would overstate every ratio to it. Both passes' figures stay in the facts."""
    refs = [(i, n) for n, (i, f) in enumerate(zip(items, figures))
            if f.ok and i.mode == "throughput" and i.spec.role in (Role.REFERENCE, Role.CEILING)]
    progress.total += len(refs)
    runners: dict[str, CaseRunner] = {}
    try:
        for item, n in refs:
            progress.step("second pass: " + _label(item))
            try:
                runner = runners.get(item.spec.name) or item.spec.factory(config)
                runners[item.spec.name] = runner
                again = _measure(runner, item, config)
            except (Skip, Exception):  # the first pass stands; the second is only a check
                progress.advance()
                continue
            first = figures[n]
            passes = [first.metrics["seconds_best"], again.metrics["seconds_best"]]
            best = first if passes[0] <= passes[1] else Figure(
                first.mode, first.case, first.role, first.key, "ok", "", dict(again.metrics),
                {**again.facts, "loadavg_1m": _loadavg()})
            gbps = [round(first.key["total_bytes"] / s / 1e9, 3) for s in passes]
            figures[n] = dataclasses.replace(best, facts={**best.facts, "passes_gbps_best": gbps})
            progress.advance()
    finally:
        for runner in runners.values():
            runner.close()


def _loadavg() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None
