"""``kvxfer pair --layerwise G`` for several group counts over rate-limited lanes (issue 42,
layer-wise streaming). A script, not a test; root only (it makes a network namespace):

    .venv/bin/python bench/layerwise_lane.py --out bench/results/YYYY-MM-DD-layerwise

For each lane rate it makes one network namespace (``kvxfer.testing.netns.Hosts``; nothing is
added to the root namespace), shapes the namespace's loopback with a token-bucket qdisc
(``tc qdisc add dev lo root tbf rate RATE``), and runs ``kvxfer pair`` inside it once per
group count, one after the other (``--passes``: again, every other pass in reverse order, so
drift in the machine's load shows), with ``UCX_TLS=tcp UCX_NET_DEVICES=lo``: the workers' NIXL
moves every KV byte over TCP through the shaped loopback (each run records lo's byte counter
beside the bytes its transfers report). Without ``UCX_TLS`` UCX would use shared memory
between the two processes and no lane would be limited: the lane ``shm`` is that, unshaped,
the fast lane.

Why tc and not nftables: an nft ``limit rate over ... drop`` rule polices (drops what is over
the rate, TCP backs off and retransmits: the rate it gives is far below the limit and
noisy); tbf shapes (queues up to its latency), which is what a slower link does. This
kernel has tbf but no netem.

Writes each run's ``kvxfer pair --json`` report as ``{rate}-g{G}-pass{N}.json`` and a summary,
``summary.json``: per rate and group count, TTFT and second-token p50/p99, transfer p50,
token-identical count, and the bytes lo carried.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
KVXFER = str(ROOT / ".venv" / "bin" / "kvxfer")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="write the reports and summary.json into this folder")
    p.add_argument("--rates", default="shm,1gbit,200mbit",
                   help="tc rates of the lanes, comma-separated; shm: no limit and no UCX_TLS (UCX's shared "
                        "memory between the processes: the fast lane)")
    p.add_argument("--groups", default="1,2,4,8", help="--layerwise values, comma-separated")
    p.add_argument("--table", action="store_true", help="print the markdown table of the finished run in --out")
    p.add_argument("--passes", type=int, default=2,
                   help="passes over the group counts per lane, every other one in reverse order (drift shows)")
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--min-len", type=int, default=512)
    p.add_argument("--max-len", type=int, default=1024)
    p.add_argument("--max-new-tokens", type=int, default=4)
    p.add_argument("--model", default="--layers 8 --hidden 128 --heads 4 --kv-heads 4 --head-dim 64 --intermediate 256",
                   help="kvxfer pair's model flags (default: a toy shape whose KV is 16 KB a token)")
    return p


def _lo_bytes(hosts: Any, host: str) -> int:
    out = hosts.run(host, ["cat", "/sys/class/net/lo/statistics/tx_bytes"]).stdout
    return int(out.strip())


def _pair(hosts: Any, host: str, args: argparse.Namespace, groups: int, report: Path) -> dict[str, Any]:
    argv = [KVXFER, "pair", "--backend", "nixl", "--mode", "push", "--requests", str(args.requests),
            "--min-len", str(args.min_len), "--max-len", str(args.max_len), "--max-new-tokens",
            str(args.max_new_tokens), "--concurrency", "1", "--warmup", "1", "--layerwise", str(groups),
            "--quiet", "--json", str(report), *args.model.split()]
    # "shm": no lane limit and UCX's own choice (shared memory between the two processes).
    env = dict(os.environ) if args.lane == "shm" else hosts.env(host, UCX_NET_DEVICES="lo")
    before = _lo_bytes(hosts, host)
    started = time.perf_counter()
    done = subprocess.run(hosts.command(host, argv), env=env, capture_output=True, text=True, timeout=900)
    if done.returncode not in (0, 1):
        raise RuntimeError(f"kvxfer pair --layerwise {groups} exited {done.returncode}: {done.stderr[-2000:]}")
    data = json.loads(report.read_text())
    return {"groups": groups, "after_first_s": _after_first(data), "argv": " ".join(argv[1:]), "seconds": time.perf_counter() - started,
            "lo_bytes": _lo_bytes(hosts, host) - before, "requests": data["requests"], "matched": data["matched"],
            "ttft_s": data["ttft_s"], "second_token_s": data["second_token_s"], "transfer_s": data["transfer_s"],
            "transfer_bytes": data["transfer_bytes"], "paths": data["paths"], "stdout": done.stdout}


def _after_first(report: dict[str, Any]) -> dict[str, float | None]:
    """Per request, the second token's time less the first's: the transfer left after the
    prefill answered, plus one decode step (p50, p99)."""
    gaps = [r["second_token_s"] - r["ttft_s"] for r in report["results"]
            if r.get("second_token_s") is not None and r.get("ttft_s") is not None]
    if not gaps:
        return {"p50": None, "p99": None}
    ordered = sorted(gaps)
    return {"p50": _quantile(ordered, 0.50), "p99": _quantile(ordered, 0.99)}


def _quantile(ordered: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    at = q * (len(ordered) - 1)
    low = int(at)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (at - low)


def table(out: Path) -> str:
    """A markdown table of a finished run's folder (its summary.json and reports)."""
    summary = json.loads((out / "summary.json").read_text())
    lines = ["| lane | pass | --layerwise | TTFT p50 / p99 (ms) | 2nd token p50 / p99 (ms) | "
             "2nd less 1st p50 / p99 (ms) | transfer p50 (ms) | identical |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for lane, runs in summary["lanes"].items():
        for run in runs:
            report = json.loads((out / f"{lane}-g{run['groups']}-pass{run['pass']}.json").read_text())
            after = _after_first(report)
            cells = [f"{run['ttft_s']['p50'] * 1e3:.0f} / {run['ttft_s']['p99'] * 1e3:.0f}",
                     f"{run['second_token_s']['p50'] * 1e3:.0f} / {run['second_token_s']['p99'] * 1e3:.0f}",
                     f"{after['p50'] * 1e3:.0f} / {after['p99'] * 1e3:.0f}" if after["p50"] is not None else "-",
                     f"{run['transfer_s']['p50'] * 1e3:.0f}", f"{run['matched']}/{run['requests']}"]
            lines.append(f"| {lane} | {run['pass']} | {run['groups']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    sys.path.insert(0, str(ROOT))
    from kvxfer.testing.netns import Hosts, namespaces_available

    args = build_parser().parse_args(argv)
    if args.table:
        print(table(args.out), end="")
        return 0
    why = namespaces_available()
    if why is not None:
        print(f"layerwise_lane: network namespaces cannot be made here: {why}", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    summary: dict[str, Any] = {"lanes": {}}
    for rate in args.rates.split(","):
        with Hosts(["pair"]) as hosts:
            args.lane = rate
            if rate != "shm":
                hosts.run("pair", ["tc", "qdisc", "add", "dev", "lo", "root", "tbf", "rate", rate, "burst", "256kb",
                                   "latency", "100ms"])
            runs = []
            counts = [int(g) for g in args.groups.split(",")]
            for n in range(args.passes):
                for groups in counts if n % 2 == 0 else counts[::-1]:
                    run = _pair(hosts, "pair", args, groups, args.out / f"{rate}-g{groups}-pass{n + 1}.json")
                    run["pass"] = n + 1
                    runs.append(run)
                    print(f"{rate} pass {n + 1} --layerwise {groups}: TTFT p50 {run['ttft_s']['p50'] * 1e3:.1f} ms, "
                          f"2nd token p50 {run['second_token_s']['p50'] * 1e3:.1f} ms "
                          f"p99 {run['second_token_s']['p99'] * 1e3:.1f} ms, transfer p50 "
                          f"{run['transfer_s']['p50'] * 1e3:.1f} ms, {run['matched']}/{run['requests']} identical, "
                          f"lo {run['lo_bytes'] / 1e6:.1f} MB for {run['transfer_bytes'] / 1e6:.1f} MB of KV",
                          flush=True)
            summary["lanes"][rate] = runs
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
