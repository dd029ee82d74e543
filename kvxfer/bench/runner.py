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
from kvxfer.bench.children import running_children, stop_leftovers
from kvxfer.bench.config import BenchConfig, ConfigError, Point, format_size
from kvxfer.bench.pace import Pace, Work
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


def _point(item: _Item) -> str:
    """The figure's mode and point, its case aside: what figures of several cases have in common."""
    p = item.point
    return (f"{item.mode} {p.direction} {p.memory} {p.slots} {format_size(p.row_bytes)} x {p.rows}"
            + (f" x {p.groups} groups" if p.groups > 1 else ""))


def _label(item: _Item) -> str:
    mode, _, point = _point(item).partition(" ")
    return f"{mode} {item.spec.name} {point}"


def _measure(runner: CaseRunner, item: _Item, config: BenchConfig) -> Measurement:
    if item.mode == "throughput":
        return runner.throughput(item.point)
    if item.mode == "latency":
        assert config.latency is not None
        return runner.latency(item.point, config.latency)
    assert config.overhead is not None
    return runner.overhead(item.point, config.overhead)


INTERRUPTED = "not run: the run was interrupted"


def run(config: BenchConfig, progress: Progress | None = None,
        specs: dict[str, CaseSpec] | None = None, log: Callable[[str], None] | None = None,
        time_limit_s: float | None = None) -> BenchResult:
    """Every planned figure, in plan order. Past ``time_limit_s``, or on KeyboardInterrupt
    (the CLI turns SIGTERM into one), the figures not yet run are reported as skipped with
    that reason and the result is returned: a run cut short still writes what it measured.
    Every child process the cases started is ended by the time it returns."""
    started = time.monotonic()
    load_before = _loadavg()
    children_before = running_children()
    items = plan(config, specs)
    progress = progress or Progress(len(items), enabled=False)
    progress.total = max(len(items), 1)
    progress.pace = Pace(_work(config, items))
    cases = _Cases(config, items)
    first = _FirstPass(config, cases, progress, log, _Deadline(started, time_limit_s))
    interrupted = False
    try:
        for item in items:
            first.take(item)
        interrupted = first.stop_reason == INTERRUPTED
        if first.stop_reason is None:
            interrupted = _second_pass(config, items, first.figures, progress)
    finally:
        cases.close()
        release_shared()
        stop_leftovers(children_before)
        progress.finish()
    # Other work on the machine skews figures: say how busy it was around the run.
    machine = {**results.machine(), "loadavg_1m_before": load_before, "loadavg_1m_after": _loadavg()}
    return BenchResult(results.now(), machine, results.versions(), config.to_json(), tuple(first.figures),
                       time.monotonic() - started, interrupted=interrupted)


def unmet_here(config: BenchConfig, item: _Item) -> str | None:
    """Why ``item`` is skipped on this machine before it runs (a requirement, device memory), or None."""
    why = unmet(item.spec)
    if why is None and item.point.memory == "device":
        placed = devices_missing(config)
        why = f"device memory: {placed}" if placed else None
    return why


def _work(config: BenchConfig, items: list[_Item]) -> list[Work]:
    """The figures that will run here, each marked when it is its case's first, then the
    references' second pass (see ``_second_pass``): what the run's time left is made of."""
    runs = [i for i in items if unmet_here(config, i) is None]
    begun: set[str] = set()
    work = []
    for item in runs:
        work.append(Work(item.spec.name, item.spec.name not in begun, _point(item)))
        begun.add(item.spec.name)
    return work + [Work(i.spec.name, False, _point(i)) for i in runs if _is_reference(i)]


def _is_reference(item: _Item) -> bool:
    return item.mode == "throughput" and item.spec.role in (Role.REFERENCE, Role.CEILING)


def _figure(item: _Item, status: str, reason: str = "", m: Measurement | None = None) -> Figure:
    spec = item.spec
    return Figure(item.mode, spec.name, spec.role.value, dict(spec.key(item.point)), status, reason,
                  dict(m.metrics) if m else {}, dict(m.facts) if m else {})


@dataclass(frozen=True)
class _Deadline:
    started: float
    limit_s: float | None

    def passed(self) -> bool:
        return self.limit_s is not None and time.monotonic() - self.started > self.limit_s


class _Cases:
    """Each case's runner, built at its first figure and closed after its last."""

    def __init__(self, config: BenchConfig, items: list[_Item]) -> None:
        self._config = config
        self._runners: dict[str, CaseRunner | str] = {}   # a str is why the case could not be built
        self._remaining = {name: sum(1 for i in items if i.spec.name == name) for name in config.cases}

    def runner(self, spec: CaseSpec) -> CaseRunner | str:
        runner = self._runners.get(spec.name)
        if runner is None:
            try:
                runner = spec.factory(self._config)
            except Skip as err:
                runner = str(err)
            except Exception as err:
                runner = f"could not start: {type(err).__name__}: {err}"
            self._runners[spec.name] = runner
        return runner

    def figure_done(self, spec: CaseSpec) -> None:
        self._remaining[spec.name] -= 1
        if self._remaining[spec.name] == 0:
            done = self._runners.pop(spec.name, None)
            if done is not None and not isinstance(done, str):
                done.close()

    def close(self) -> None:
        for runner in self._runners.values():
            if not isinstance(runner, str):
                runner.close()


class _FirstPass:
    """Measures each planned figure once; after a stop (time limit, interrupt) the rest are
    skipped with the stop's reason."""

    def __init__(self, config: BenchConfig, cases: _Cases, progress: Progress,
                 log: Callable[[str], None] | None, deadline: _Deadline) -> None:
        self._config = config
        self._cases = cases
        self._progress = progress
        self._log = log
        self._deadline = deadline
        self.figures: list[Figure] = []
        self.stop_reason: str | None = None

    def take(self, item: _Item) -> None:
        if self.stop_reason is None and self._deadline.passed():
            self.stop_reason = f"not run: the run's time limit of {self._deadline.limit_s:g}s was reached"
        if self.stop_reason is not None:
            self.figures.append(_figure(item, "skipped", self.stop_reason))
            self._progress.advance()
            return
        why = unmet_here(self._config, item)
        began = time.monotonic()
        try:
            self._progress.step(_label(item))
            figure = _figure(item, "skipped", why) if why is not None else self._figure_of(item)
        except KeyboardInterrupt:  # wherever it comes: building the case, measuring, drawing the line
            self.stop_reason = INTERRUPTED
            figure = _figure(item, "skipped", "interrupted while measuring")
        self.figures.append(figure)
        if why is None and self._progress.pace is not None:
            self._progress.pace.ran(item.spec.name, time.monotonic() - began)
        self._progress.advance()
        try:
            self._cases.figure_done(item.spec)  # the case's last figure closes its runner (its children)
        except KeyboardInterrupt:  # the figure stands; what the close left, the run's end stops
            self.stop_reason = INTERRUPTED

    def _figure_of(self, item: _Item) -> Figure:
        runner = self._cases.runner(item.spec)
        if isinstance(runner, str):
            return _figure(item, "error" if runner.startswith("could not") else "skipped", runner)
        try:
            m = _measure(runner, item, self._config)
            # per figure, since other work on the machine comes and goes during a run
            m.facts.setdefault("loadavg_1m", _loadavg())
            return _figure(item, "ok", m=m)
        except Skip as err:
            return _figure(item, "skipped", str(err))
        except Exception as err:
            failed = _figure(item, "error", f"{type(err).__name__}: {err}")
            if self._log:
                self._log(f"error in {_label(item)}: {type(err).__name__}: {err}")
            return failed


def _second_pass(config: BenchConfig, items: list[_Item], figures: list[Figure], progress: Progress) -> bool:
    """Measure the references (local copy, NIXL one descriptor) again after everything else
    and keep the faster pass: a reference taken in a moment when other work slowed the
    machine would overstate every ratio to it. Both passes' figures stay in the facts.
    True when a KeyboardInterrupt ended it: the first pass's figures then stand."""
    refs = [(i, n) for n, (i, f) in enumerate(zip(items, figures)) if f.ok and _is_reference(i)]
    progress.total += len(refs)
    if progress.pace is not None:
        progress.pace.expect([Work(i.spec.name, False, _point(i)) for i, _ in refs])
    runners: dict[str, CaseRunner] = {}
    try:
        for item, n in refs:
            began = time.monotonic()
            progress.step("second pass: " + _label(item))
            figures[n] = _again(config, item, figures[n], runners)
            if progress.pace is not None:
                progress.pace.ran(item.spec.name, time.monotonic() - began)
            progress.advance()
    except KeyboardInterrupt:
        return True
    finally:
        for runner in runners.values():
            runner.close()
    return False


def _again(config: BenchConfig, item: _Item, first: Figure, runners: dict[str, CaseRunner]) -> Figure:
    """``first`` with a second measurement of its point: the faster pass, both passes in its facts."""
    try:
        runner = runners.get(item.spec.name) or item.spec.factory(config)
        runners[item.spec.name] = runner
        again = _measure(runner, item, config)
    except (Skip, Exception):  # the first pass stands; the second is only a check
        return first
    passes = [first.metrics["seconds_best"], again.metrics["seconds_best"]]
    best = first if passes[0] <= passes[1] else Figure(
        first.mode, first.case, first.role, first.key, "ok", "", dict(again.metrics),
        {**again.facts, "loadavg_1m": _loadavg()})
    gbps = [round(first.key["total_bytes"] / s / 1e9, 3) for s in passes]
    return dataclasses.replace(best, facts={**best.facts, "passes_gbps_best": gbps})


def _loadavg() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None
