"""``python -m kvxfer.testing.reliability``: run the experiments, print a short report on
stdout (progress goes to stderr), write the JSON, exit 1 when a finding was made."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path

from kvxfer.serving.command import CommandParser
from kvxfer.testing.reliability import QUICK, Config, Report, run


def _row(name: str, value: object) -> str:
    return f"  {name:<34} {value}"


def render(report: Report) -> str:
    lines = [f"kvxfer reliability ({report.machine.get('nproc')} cores, Python {report.machine.get('python')}, "
             f"commit {report.machine.get('git_commit') or '?'}): {report.seconds}"]
    if (k := report.kills) is not None:
        lines += ["kills mid-transfer (NIXL peer SIGKILLed)",
                  _row("rounds (measured)", f"{k.rounds} ({k.rounds_measured})"),
                  _row("rows claimed / checked / wrong", f"{k.rows_claimed} / {k.rows_checked} / {k.rows_wrong}"),
                  _row("kill -> concluded+quiesced", f"p50 {k.detection_p50_ms} ms, max {k.detection_max_ms} ms"),
                  _row("not concluded / left unquiesced", f"{k.not_concluded} / {k.unquiesced_at_shutdown}")]
    if (c := report.chaos) is not None:
        lines += ["serving chaos (2P+2D, recompute)",
                  _row("requests / ok / failed / wrong", f"{c.requests} / {c.ok} / {c.failures} / {c.wrong}"),
                  _row("kills (asked)", f"{c.kills} ({c.kills_asked}), paths {c.recovered_paths}"),
                  _row("kill -> next new request ok", f"p50 {c.recovery_p50_ms} ms, max {c.recovery_max_ms} ms")]
    if (s := report.soak) is not None:
        lines += ["soak (1P+1D)",
                  _row("requests / ok / failed / wrong", f"{s.requests} / {s.ok} / {s.failures} / {s.wrong}"),
                  _row("throughput", f"{s.requests_per_s} req/s, {s.tokens_per_s} tokens/s"),
                  _row("latency", f"p50 {s.latency_p50_ms} ms, p99 {s.latency_p99_ms} ms")]
        for g in s.growth:
            lines.append(_row(f"{g.worker} RSS/threads/fds", f"{g.rss_kib_start}->{g.rss_kib_end} KiB, "
                              f"{g.threads_start}->{g.threads_end}, {g.fds_start}->{g.fds_end}"))
    if (w := report.wire_fuzz) is not None:
        for name, t in (("hints", w.hints), ("completion records", w.completions)):
            lines.append(_row(f"fuzz {name}: ok / WireError / other", f"{t.decoded_ok} / {t.wire_error} / {t.other}"))
    if (h := report.http_fuzz) is not None:
        lines += [_row("fuzz HTTP: statuses", h.statuses),
                  _row("fuzz HTTP: 500 / dropped / hung / cut", f"{h.server_errors} / {h.dropped} / {h.hangs} / "
                                                                f"{h.streams_cut}")]
    findings = report.findings()
    lines.append("findings: " + ("none" if not findings else ""))
    lines += [f"  - {f}" for f in findings]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = CommandParser(prog="python -m kvxfer.testing.reliability", description=__doc__)
    p.add_argument("--kills", type=int, help=f"kill rounds (default {Config.kills}; 0 skips)")
    p.add_argument("--chaos", type=int, help=f"serving-chaos requests (default {Config.chaos}; 0 skips)")
    p.add_argument("--chaos-kills", type=int, help=f"worker kills during them (default {Config.chaos_kills})")
    p.add_argument("--soak", type=int, help=f"soak requests (default {Config.soak}; 0 skips)")
    p.add_argument("--fuzz", type=int, help=f"fuzz cases (default {Config.fuzz}; 0 skips)")
    p.add_argument("--quick", action="store_true", help="the short form CI runs (flags above still apply)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--logs", default="", help="keep worker logs in this folder")
    p.add_argument("--json", default="", metavar="PATH", help="write the full report as JSON")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    config = QUICK if args.quick else Config()
    given = {k: v for k, v in (("kills", args.kills), ("chaos", args.chaos), ("chaos_kills", args.chaos_kills),
                               ("soak", args.soak), ("fuzz", args.fuzz)) if v is not None}
    for name, value in given.items():
        if value < 0:
            p.error(f"--{name.replace('_', '-')} must be 0 or more, got {value}")
    config = dataclasses.replace(config, **given, seed=args.seed, log_dir=args.logs, progress=not args.no_progress)
    # NIXL's Python logger and UCX write on stdout, where the report goes (UCX logs the
    # refused connections to killed peers, which the experiments cause). Both read these when
    # NIXL is first imported, inside run(); the peers' child processes inherit them.
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    os.environ.setdefault("UCX_LOG_FILE", "stderr")
    try:
        report = run(config)
    except KeyboardInterrupt:
        print("interrupted: every process and thread the run started has been stopped", file=sys.stderr)
        return 130
    print(render(report))
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report.to_json(), indent=1, default=str) + "\n")
    return 1 if report.findings() else 0


if __name__ == "__main__":
    sys.exit(main())
