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
from collections.abc import Sequence
from pathlib import Path

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
from kvxfer.bench.targets import evaluate


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvxfer bench", description=__doc__,
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
    o.add_argument("--out", type=Path, help="write JSON, markdown and plots into this folder, named after the machine")
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


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    """The preset, with whatever the flags override; every value is validated here."""
    cfg = preset(args.preset)
    if args.cases:
        cfg = cfg.with_cases(parse_list(args.cases, "--cases"))
    memory = tuple(parse_list(args.memory, "--memory")) if args.memory else None
    custom = [args.row_sizes, args.rows, args.request_bytes, args.groups, args.directions, args.memory, args.slots]
    if any(v is not None for v in custom):
        base = cfg.throughput[0] if cfg.throughput else ThroughputSweep(row_bytes=(64 << 10,))
        cfg = dataclasses.replace(cfg, throughput=(ThroughputSweep(
            row_bytes=parse_sizes(args.row_sizes, "--row-sizes") if args.row_sizes else base.row_bytes,
            rows=parse_ints(args.rows, "--rows") if args.rows else None,
            request_bytes=parse_size(args.request_bytes, "--request-bytes") if args.request_bytes
            else base.request_bytes,
            groups=parse_ints(args.groups, "--groups") if args.groups else base.groups,
            directions=tuple(parse_list(args.directions, "--directions")) if args.directions else base.directions,
            memory=memory or base.memory,
            slots=tuple(parse_list(args.slots, "--slots")) if args.slots else base.slots,
        ),))
    if args.no_throughput:
        cfg = dataclasses.replace(cfg, throughput=())
    if args.no_latency:
        cfg = dataclasses.replace(cfg, latency=None)
    elif args.latency_rows or args.latency_samples or args.latency_settle_us is not None:
        lat = cfg.latency or LatencySweep()
        cfg = dataclasses.replace(cfg, latency=dataclasses.replace(
            lat, rows=parse_ints(args.latency_rows, "--latency-rows") if args.latency_rows else lat.rows,
            samples=args.latency_samples or lat.samples,
            settle_us=lat.settle_us if args.latency_settle_us is None else args.latency_settle_us))
    if memory and cfg.latency is not None:
        # Asked for device memory only, a user does not want the latency sweep's host points
        # (they used to run, or be reported skipped, beside the device ones).
        cfg = dataclasses.replace(cfg, latency=dataclasses.replace(cfg.latency, memory=memory))
    if args.no_overhead:
        cfg = dataclasses.replace(cfg, overhead=None)
    elif args.overhead_rows:
        cfg = dataclasses.replace(cfg, overhead=dataclasses.replace(
            cfg.overhead or OverheadSweep(), rows=parse_ints(args.overhead_rows, "--overhead-rows")))
    if args.warmup is not None or args.reps is not None or args.budget is not None:
        r = cfg.repetition
        cfg = dataclasses.replace(cfg, repetition=Repetition(
            warmup=r.warmup if args.warmup is None else args.warmup, reps=r.reps if args.reps is None else args.reps,
            budget_s=r.budget_s if args.budget is None else args.budget))
    if args.devices is not None:
        cfg = dataclasses.replace(cfg, devices=parse_devices(args.devices))
    if args.layers is not None:
        cfg = dataclasses.replace(cfg, layers=args.layers)
    if args.max_descriptors is not None:
        cfg = dataclasses.replace(cfg, max_descriptors=args.max_descriptors)
    return cfg


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


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        if args.compare:
            return _compare(args)
        if args.list_cases:
            return _list_cases()
        cfg = config_from_args(args)
        items = runner.plan(cfg)
        placed = devices_missing(cfg)
        if placed and requirement_missing(Requirement.CUDA) is None and any(i.point.memory == "device" for i in items):
            raise ConfigError(placed)  # a GPU is here, but not the ones asked for: a usage error
    except (ConfigError, results.ResultError, ValueError) as err:
        print(f"kvxfer bench: {err}", file=sys.stderr)
        return 2
    progress = Progress(len(items), enabled=not args.no_progress)
    # SIGTERM (a `timeout`, a job scheduler) ends the run like Ctrl-C: outputs are still written.
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        result = runner.run(cfg, progress, log=lambda line: print(f"kvxfer bench: {line}", file=sys.stderr),
                            time_limit_s=args.time_limit)
    finally:
        signal.signal(signal.SIGTERM, previous)
    targets = evaluate(result)
    target_json = [t.to_json() for t in targets]
    print(report.render_text(result, targets), end="")

    stem = f"{cfg.name}-{socket.gethostname()}-{result.created[:10]}"
    json_path = args.json or (args.out / f"{stem}.json" if args.out else None)
    md_path = args.markdown or (args.out / f"{stem}.md" if args.out else None)
    plot_dir = args.plots or args.out
    if json_path:
        results.write(result, json_path, target_json)
        print(f"wrote {json_path}", file=sys.stderr)
    if md_path:
        md_path.parent.mkdir(parents=True, exist_ok=True)
        md_path.write_text(report.render_markdown(result, targets, json_path.name if json_path else None))
        print(f"wrote {md_path}", file=sys.stderr)
    if plot_dir:
        if plots.available():
            for path in plots.plot(result, plot_dir, stem):
                print(f"wrote {path}", file=sys.stderr)
        else:
            print(f"kvxfer bench: {plots.MISSING}", file=sys.stderr)
    return 1 if any(f.status == "error" for f in result.figures) else 0


if __name__ == "__main__":
    sys.exit(main())
