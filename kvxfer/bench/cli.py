"""``kvxfer bench``: run a preset or a custom sweep, print tables, write JSON/markdown/plots.

``kvxfer bench --compare OLD.json NEW.json`` compares two results instead and exits 1 on
a regression beyond ``--threshold``.
"""

from __future__ import annotations

import argparse
import dataclasses
import signal
import socket
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

from kvxfer.bench import plots, report, results, runner
from kvxfer.bench.cases import Requirement, devices_missing, requirement_missing, unmet
from kvxfer.bench.compare import compare, regressions, render
from kvxfer.bench.config import (
    PRESETS,
    BenchConfig,
    ConfigError,
    LatencySweep,
    OverheadSweep,
    Repetition,
    ThroughputSweep,
    parse_devices,
    parse_ints,
    parse_list,
    parse_size,
    parse_sizes,
    preset,
)
from kvxfer.bench.progress import Progress
from kvxfer.bench.registry import registry
from kvxfer.bench.targets import TargetRow, evaluate
from kvxfer.serving.command import CommandParser

T = TypeVar("T")
D = TypeVar("D")


def build_parser() -> argparse.ArgumentParser:
    p = CommandParser(prog="kvxfer bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="cpu", choices=PRESETS, help="figure set (default: cpu)")
    p.add_argument("--cases", help="comma list of cases to run (default: the preset's); see --list-cases")
    p.add_argument("--list-cases", action="store_true", help="list cases and whether this machine can run them")
    s = p.add_argument_group("custom throughput sweep (any of these replaces the preset's throughput sweeps)")
    s.add_argument("--row-sizes", help="e.g. 4K,64K,1M")
    s.add_argument("--rows", help="rows per request per group, e.g. 32,256 (default: --request-bytes / row size)")
    s.add_argument("--request-bytes", help="bytes per request when --rows is not given (default 64M)")
    s.add_argument("--groups", help="layer groups per request, e.g. 1,4")
    s.add_argument("--directions", help="push,pull")
    s.add_argument("--memory", help="host,device (the latency sweep's memory kinds too)")
    s.add_argument("--slots", help="contiguous,scattered")
    s.add_argument("--no-throughput", action="store_true", help="skip the throughput sweeps")
    p.add_argument("--devices", metavar="P,D",
                   help="CUDA devices of the prefill and decode ends for device memory, e.g. 0,1 (default: "
                        "the preset's; 0,0 except gpu2); two devices make local_copy the peer copy between them")
    m = p.add_argument_group("latency and host overhead")
    m.add_argument("--latency-rows", help="rows per small request, e.g. 1,32")
    m.add_argument("--latency-samples", type=int, help="timed samples per latency figure")
    m.add_argument("--latency-settle-us", type=int,
                   help="two-process latency: µs to sleep between the decode end's fetch registration and "
                        "each publish (default 0: a ping's round trip)")
    m.add_argument("--no-latency", action="store_true")
    m.add_argument("--overhead-rows", help="rows per submission, e.g. 1k,10k,100k")
    m.add_argument("--no-overhead", action="store_true")
    t = p.add_argument_group("timing")
    t.add_argument("--warmup", type=int)
    t.add_argument("--reps", type=int)
    t.add_argument("--budget", type=float, help="seconds of timed runs per figure before stopping early (>= 3 runs)")
    t.add_argument("--layers", type=int, help="layers per row for the layer-major peer-practice baseline")
    t.add_argument("--max-descriptors", type=int, help="skip raw NIXL figures that would post more descriptors")
    o = p.add_argument_group("output")
    o.add_argument("--json", type=Path, help="write the versioned JSON result here")
    o.add_argument("--markdown", type=Path, help="write the markdown tables here")
    o.add_argument("--plots", type=Path, help="write PNG plots into this folder (needs matplotlib)")
    o.add_argument("--out", type=Path, help="write JSON, markdown and (with matplotlib) plots into this folder, named after the machine")
    o.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    o.add_argument("--time-limit", type=float,
                   help="seconds after which no new figure starts; the rest are reported skipped and outputs written")
    c = p.add_argument_group("compare")
    c.add_argument("--compare", nargs=2, metavar=("OLD", "NEW"), type=Path, help="compare two JSON results")
    c.add_argument("--threshold", type=float, default=0.10, help="relative change that counts (default 0.10)")
    c.add_argument("--all", action="store_true", help="with --compare, list unchanged figures too")
    c.add_argument("--relative", action="store_true",
                   help="with --compare, compare throughput as a fraction of each run's own local copy")
    return p


_THROUGHPUT_FLAGS = ("row_sizes", "rows", "request_bytes", "groups", "directions", "memory", "slots")


def _parsed(raw: str | None, parse: Callable[[str, str], T], flag: str, default: D) -> T | D:
    """``parse(raw, flag)`` where the flag was given (and not empty), else ``default``."""
    return parse(raw, flag) if raw else default


def _parse_tuple(text: str, flag: str) -> tuple[str, ...]:
    return tuple(parse_list(text, flag))


def _with_throughput(cfg: BenchConfig, args: argparse.Namespace, memory: tuple[str, ...] | None) -> BenchConfig:
    """Any custom-sweep flag replaces the preset's throughput sweeps by one built on its first."""
    if all(getattr(args, flag) is None for flag in _THROUGHPUT_FLAGS):
        return cfg
    base = cfg.throughput[0] if cfg.throughput else ThroughputSweep(row_bytes=(64 << 10,))
    return dataclasses.replace(cfg, throughput=(ThroughputSweep(
        row_bytes=_parsed(args.row_sizes, parse_sizes, "--row-sizes", base.row_bytes),
        rows=_parsed(args.rows, parse_ints, "--rows", None),
        request_bytes=_parsed(args.request_bytes, parse_size, "--request-bytes", base.request_bytes),
        groups=_parsed(args.groups, parse_ints, "--groups", base.groups),
        directions=_parsed(args.directions, _parse_tuple, "--directions", base.directions),
        memory=memory or base.memory,
        slots=_parsed(args.slots, _parse_tuple, "--slots", base.slots),
    ),))


def _with_latency(cfg: BenchConfig, args: argparse.Namespace, memory: tuple[str, ...] | None) -> BenchConfig:
    if args.no_latency:
        cfg = dataclasses.replace(cfg, latency=None)
    elif args.latency_rows or args.latency_samples or args.latency_settle_us is not None:
        lat = cfg.latency or LatencySweep()
        cfg = dataclasses.replace(cfg, latency=dataclasses.replace(
            lat, rows=_parsed(args.latency_rows, parse_ints, "--latency-rows", lat.rows),
            samples=args.latency_samples or lat.samples,
            settle_us=lat.settle_us if args.latency_settle_us is None else args.latency_settle_us))
    if memory and cfg.latency is not None:
        # Asked for device memory only, a user does not want the latency sweep's host points
        # (they used to run, or be reported skipped, beside the device ones).
        cfg = dataclasses.replace(cfg, latency=dataclasses.replace(cfg.latency, memory=memory))
    return cfg


def _with_overhead(cfg: BenchConfig, args: argparse.Namespace) -> BenchConfig:
    if args.no_overhead:
        return dataclasses.replace(cfg, overhead=None)
    if args.overhead_rows:
        return dataclasses.replace(cfg, overhead=dataclasses.replace(
            cfg.overhead or OverheadSweep(), rows=parse_ints(args.overhead_rows, "--overhead-rows")))
    return cfg


def _with_repetition(cfg: BenchConfig, args: argparse.Namespace) -> BenchConfig:
    if args.warmup is None and args.reps is None and args.budget is None:
        return cfg
    r = cfg.repetition
    return dataclasses.replace(cfg, repetition=Repetition(
        warmup=r.warmup if args.warmup is None else args.warmup, reps=r.reps if args.reps is None else args.reps,
        budget_s=r.budget_s if args.budget is None else args.budget))


def _with_placement(cfg: BenchConfig, args: argparse.Namespace) -> BenchConfig:
    """Devices, layers and the descriptor cap: each replaces the preset's where given."""
    if args.devices is not None:
        cfg = dataclasses.replace(cfg, devices=parse_devices(args.devices))
    if args.layers is not None:
        cfg = dataclasses.replace(cfg, layers=args.layers)
    if args.max_descriptors is not None:
        cfg = dataclasses.replace(cfg, max_descriptors=args.max_descriptors)
    return cfg


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    """The preset, with whatever the flags override; every value is validated here."""
    cfg = preset(args.preset)
    if args.cases:
        cfg = cfg.with_cases(parse_list(args.cases, "--cases"))
    memory = _parsed(args.memory, _parse_tuple, "--memory", None)
    cfg = _with_throughput(cfg, args, memory)
    if args.no_throughput:
        cfg = dataclasses.replace(cfg, throughput=())
    cfg = _with_latency(cfg, args, memory)
    cfg = _with_overhead(cfg, args)
    cfg = _with_repetition(cfg, args)
    return _with_placement(cfg, args)


def _list_cases() -> int:
    for name, spec in registry().items():
        why = unmet(spec)
        print(f"{name:<14} {spec.role.value:<9} {'ready' if why is None else 'skipped: ' + why}  ({spec.title})")
    return 0


def _compare(args: argparse.Namespace) -> int:
    old, new = results.load(args.compare[0]), results.load(args.compare[1])
    changes = compare(old, new, args.threshold, relative=args.relative)
    print(render(changes, args.threshold, args.all), end="")
    return 1 if regressions(changes) else 0


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def _planned(args: argparse.Namespace) -> tuple[BenchConfig, int]:
    """The configuration and how many figures it plans; raises ConfigError on a usage error."""
    cfg = config_from_args(args)
    items = runner.plan(cfg)
    placed = devices_missing(cfg)
    if placed and requirement_missing(Requirement.CUDA) is None and any(i.point.memory == "device" for i in items):
        raise ConfigError(placed)  # a GPU is here, but not the ones asked for: a usage error
    return cfg, len(items)


def _measure(cfg: BenchConfig, args: argparse.Namespace, figures: int) -> results.BenchResult:
    progress = Progress(figures, enabled=not args.no_progress)
    # SIGTERM (a `timeout`, a job scheduler) ends the run like Ctrl-C: outputs are still written.
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        return runner.run(cfg, progress, log=lambda line: print(f"kvxfer bench: {line}", file=sys.stderr),
                          time_limit_s=args.time_limit)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _write_outputs(args: argparse.Namespace, cfg: BenchConfig, result: results.BenchResult,
                   targets: list[TargetRow]) -> None:
    """JSON, markdown and plots where the flags ask for them (``--out``: all three, named after the machine)."""
    stem = f"{cfg.name}-{socket.gethostname()}-{result.created[:10]}"
    json_path = args.json or (args.out / f"{stem}.json" if args.out else None)
    md_path = args.markdown or (args.out / f"{stem}.md" if args.out else None)
    plot_dir = args.plots or args.out
    if json_path:
        results.write(result, json_path, [t.to_json() for t in targets])
        print(f"wrote {json_path}", file=sys.stderr)
    if md_path:
        md_path.parent.mkdir(parents=True, exist_ok=True)
        md_path.write_text(report.render_markdown(result, targets, json_path.name if json_path else None))
        print(f"wrote {md_path}", file=sys.stderr)
    if plot_dir:
        _write_plots(result, plot_dir, stem)


def _write_plots(result: results.BenchResult, plot_dir: Path, stem: str) -> None:
    if not plots.available():
        print(f"kvxfer bench: {plots.MISSING}", file=sys.stderr)
        return
    for path in plots.plot(result, plot_dir, stem):
        print(f"wrote {path}", file=sys.stderr)


GPU_PRESETS = ("gpu", "gpu2")


def _refuse_unrunnable(args: argparse.Namespace) -> None:
    """What the run could not deliver, refused before it starts (ConfigError: exit 2)."""
    if args.plots and not plots.available():
        raise ConfigError("--plots needs matplotlib, which is not installed: pip install 'kvxfer[bench]' "
                          "(or pip install matplotlib), or drop --plots")
    if args.preset in GPU_PRESETS and not args.cases and requirement_missing(Requirement.CUDA) is not None:
        raise ConfigError(f"--preset {args.preset} measures device memory, and this machine has "
                          f"{requirement_missing(Requirement.CUDA)}: --preset cpu runs here")


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        if args.compare:
            return _compare(args)
        if args.list_cases:
            return _list_cases()
        _refuse_unrunnable(args)
        cfg, figures = _planned(args)
    except (ConfigError, results.ResultError, ValueError) as err:
        print(f"kvxfer bench: {err}", file=sys.stderr)
        return 2
    try:
        result = _measure(cfg, args, figures)
    except KeyboardInterrupt:  # before any figure could be kept (a case being built)
        print("\nkvxfer bench: interrupted; nothing measured", file=sys.stderr)
        return 130
    targets = evaluate(result)
    print(report.render_text(result, targets), end="")
    _write_outputs(args, cfg, result, targets)
    if result.interrupted or any(f.reason == runner.INTERRUPTED for f in result.figures):
        print("kvxfer bench: interrupted; the figures measured before it are written", file=sys.stderr)
        return 130
    return 1 if any(f.status == "error" for f in result.figures) else 0


if __name__ == "__main__":
    sys.exit(main())
