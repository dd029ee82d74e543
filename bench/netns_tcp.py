"""kvxfer's NIXL push over TCP across two network namespaces, against the same push within one
(issue 27, item 7). A script, not a test; root only (it makes network namespaces):

    .venv/bin/python bench/netns_tcp.py --out bench/results/YYYY-MM-DD-cpu-netns

Two namespaces, A and B, each with a veth on a bridge (``kvxfer.testing.netns.Hosts``; nothing
is added to the root namespace). The measuring process runs in A with ``UCX_TLS=tcp`` and
``UCX_NET_DEVICES=eth0`` (its veth) and runs ``kvxfer bench``'s ``nixl_2p`` measurement
(``kvxfer.bench.two_process.TwoProcessCase``: this process publishes, a ``SubprocessPeer``
child fetches; timed from publish() to the publisher's outcome, bytes checked after) twice, in
one run of the bench's runner:

- ``nixl_2p_tcp_one_ns``, the reference: the child in A too. TCP to A's own address never
  leaves A's stack (the kernel routes it over loopback), so the veth carries nothing.
- ``nixl_2p_tcp_two_ns``: the child in B, same settings: every byte leaves A's veth, crosses
  the bridge and enters B's.

The reference gets the bench's second pass (measured first and last, the faster kept). Each
figure's facts hold A's veth tx bytes counted across its transfers, to show where the bytes
went. Writes a ``kvxfer-bench`` JSON (``kvxfer bench --compare`` reads it) and markdown, and
prints the ratio two namespaces / one per shape.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

SCRIPT = Path(__file__).resolve()
ONE_NS = "nixl_2p_tcp_one_ns"
TWO_NS = "nixl_2p_tcp_two_ns"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, help="write the JSON and markdown into this folder")
    p.add_argument("--row-bytes", default="64K", help="row size (default 64K)")
    p.add_argument("--request-bytes", default="256M", help="bytes per transfer (default 256M)")
    p.add_argument("--slots", default="contiguous,scattered", help="contiguous,scattered")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--budget", type=float, default=4.0, help="seconds of timed runs per figure (>= 3 runs)")
    p.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)  # the run inside namespace A
    p.add_argument("--peer-ns", default="", help=argparse.SUPPRESS)
    return p


# --- outside: the namespaces ------------------------------------------------------------

def outer(args: argparse.Namespace, argv: list[str]) -> int:
    from kvxfer.testing.netns import Hosts, namespaces_available

    why = namespaces_available()
    if why is not None:
        print(f"netns_tcp: cannot run here: {why}", file=sys.stderr)
        return 2
    with Hosts(["a", "b"]) as hosts:
        command = [sys.executable, str(SCRIPT), *argv, "--inner", "--peer-ns", hosts["b"].ns]
        print(f"netns_tcp: A {hosts['a'].ns} ({hosts['a'].ip}), B {hosts['b'].ns} ({hosts['b'].ip}); "
              f"UCX_TLS=tcp UCX_NET_DEVICES=eth0", file=sys.stderr)
        proc = hosts.popen("a", command, env=hosts.env("a"))
        try:
            return proc.wait()
        except KeyboardInterrupt:  # the run in A got it too: it writes what it measured
            try:
                return proc.wait(60)
            except subprocess.TimeoutExpired:
                return 130  # Hosts' close() kills it


# --- inside namespace A -----------------------------------------------------------------

def _tx_bytes() -> int:
    """A's veth tx bytes (``ip netns exec`` mounted A's /sys)."""
    return int(Path("/sys/class/net/eth0/statistics/tx_bytes").read_text())


class _Counted:
    """A case runner whose throughput figures carry A's veth tx bytes over their transfers."""

    def __init__(self, case: Any, transfers_extra: int) -> None:
        self.case = case
        self.extra = transfers_extra  # untimed transfers per figure: warm-up and the fresh-bytes check

    def throughput(self, point: Any) -> Any:
        before = _tx_bytes()
        measured = self.case.throughput(point)
        moved = _tx_bytes() - before
        transfers = int(measured.metrics["reps"]) + self.extra
        measured.facts.update({"veth_tx_bytes": moved, "transfers": transfers,
                               "veth_tx_per_payload": round(moved / (transfers * point.total_bytes), 4)})
        return measured

    def latency(self, point: Any, sweep: Any) -> Any:
        return self.case.latency(point, sweep)

    def overhead(self, point: Any, sweep: Any) -> Any:
        return self.case.overhead(point, sweep)

    def close(self) -> None:
        self.case.close()


def _specs(peer_ns: str, extra: int) -> dict[str, Any]:
    from kvxfer.bench import two_process
    from kvxfer.bench.cases import CaseSpec, Requirement, Role
    from kvxfer.testing.subprocess_peer import SubprocessPeer

    base = two_process._nixl_kind("auto")  # nixl_2p's own: the same backends, rows and child
    assert base.rebuild_args is not None
    tcp = {"UCX_TLS": os.environ.get("UCX_TLS"), "UCX_NET_DEVICES": os.environ.get("UCX_NET_DEVICES")}

    def kind(prefix: list[str], where: str) -> Any:
        def peer(mode: Any, geometry: Any, memory: str, device: int) -> Any:
            assert base.rebuild_args is not None
            return SubprocessPeer("kvxfer.testing.nixl_pairs:child_backend",
                                  base.rebuild_args(mode, geometry, memory, device), prefix=prefix)

        return dataclasses.replace(base, peer=peer, facts={**base.facts, **tcp, "peer": where})

    needs = frozenset({Requirement.NIXL, Requirement.KVXFER_NIXL, Requirement.SUBPROCESS_PEER})
    one = kind([], "the same namespace (TCP through its own stack)")
    two = kind(["ip", "netns", "exec", peer_ns], f"namespace {peer_ns} (TCP across veth, bridge, veth)")
    return {
        ONE_NS: CaseSpec(ONE_NS, "kvxfer NIXL push over TCP, both processes in one namespace", Role.REFERENCE, needs,
                         two_process._ALL, frozenset({"throughput"}),
                         lambda config: _Counted(two_process.TwoProcessCase(config, one), extra)),
        TWO_NS: CaseSpec(TWO_NS, "kvxfer NIXL push over TCP, the fetcher in another namespace", Role.BACKEND, needs,
                         two_process._ALL, frozenset({"throughput"}),
                         lambda config: _Counted(two_process.TwoProcessCase(config, two), extra)),
    }


def ratios(result: Any) -> list[dict[str, Any]]:
    """Per shape: both figures (GB/s best and median) and two namespaces / one."""
    out = []
    for f in result.figures:
        if f.case != TWO_NS or not f.ok:
            continue
        ref = next((r for r in result.figures if r.case == ONE_NS and r.ok and r.key == f.key), None)
        if ref is None:
            continue
        out.append({"slots": f.key["slots"], "row_bytes": f.key["row_bytes"], "total_bytes": f.key["total_bytes"],
                    "one_ns_gbps_best": round(ref.get("gbps_best") or 0, 3),
                    "two_ns_gbps_best": round(f.get("gbps_best") or 0, 3),
                    "one_ns_gbps_median": round(ref.get("gbps_median") or 0, 3),
                    "two_ns_gbps_median": round(f.get("gbps_median") or 0, 3),
                    "ratio_best": round((f.get("gbps_best") or 0) / (ref.get("gbps_best") or 1), 3),
                    "ratio_median": round((f.get("gbps_median") or 0) / (ref.get("gbps_median") or 1), 3),
                    "one_ns_veth_tx_per_payload": ref.facts.get("veth_tx_per_payload"),
                    "two_ns_veth_tx_per_payload": f.facts.get("veth_tx_per_payload")})
    return out


def _ratio_lines(rows: list[dict[str, Any]]) -> list[str]:
    return [f"{r['slots']:>10} {r['row_bytes'] >> 10} KiB rows, {r['total_bytes'] >> 20} MiB: two namespaces "
            f"{r['two_ns_gbps_best']:.2f} GB/s best ({r['two_ns_gbps_median']:.2f} median), one namespace "
            f"{r['one_ns_gbps_best']:.2f} ({r['one_ns_gbps_median']:.2f}): ratio {r['ratio_best']:.2f} best, "
            f"{r['ratio_median']:.2f} median; veth tx / payload {r['two_ns_veth_tx_per_payload']} vs "
            f"{r['one_ns_veth_tx_per_payload']}" for r in rows]


def inner(args: argparse.Namespace) -> int:
    from kvxfer.bench import report, runner
    from kvxfer.bench.config import (
        BenchConfig,
        Repetition,
        ThroughputSweep,
        parse_list,
        parse_size,
    )
    from kvxfer.bench.progress import Progress

    rep = Repetition(warmup=args.warmup, reps=args.reps, budget_s=args.budget)
    config = BenchConfig(
        name="netns-tcp", cases=(ONE_NS, TWO_NS),
        throughput=(ThroughputSweep(row_bytes=(parse_size(args.row_bytes, "--row-bytes"),),
                                    request_bytes=parse_size(args.request_bytes, "--request-bytes"),
                                    slots=tuple(parse_list(args.slots, "--slots"))),),
        repetition=rep)
    specs = _specs(args.peer_ns, rep.warmup + 1)
    items = runner.plan(config, specs)
    result = runner.run(config, Progress(len(items)), specs=specs,
                        log=lambda line: print(f"netns_tcp: {line}", file=sys.stderr))
    rows = ratios(result)
    text = report.render_text(result, [])
    text = text.split("Targets (docs/performance.md)")[0].rstrip() + "\n"  # no target is set for these cases
    print(text + "\nTwo namespaces against one (same run):\n" + "\n".join(_ratio_lines(rows)))
    if args.out:
        stem = f"netns-tcp-{socket.gethostname()}-{result.created[:10]}"
        json_path = args.out / f"{stem}.json"
        data = result.to_json([])
        data["ratios"] = rows
        args.out.mkdir(parents=True, exist_ok=True)

        json_path.write_text(json.dumps(data, indent=1) + "\n")
        md = report.render_markdown(result, [], json_path.name).split("## Targets (docs/performance.md)")[0]
        md = md.replace("# kvxfer bench: netns-tcp preset", "# kvxfer bench: bench/netns_tcp.py")
        md += "\n## Two namespaces against one (same run)\n\n" + "\n".join(f"- {line.strip()}" for line in
                                                                        _ratio_lines(rows)) + "\n"
        (args.out / f"{stem}.md").write_text(md)
        print(f"wrote {json_path} and {stem}.md", file=sys.stderr)
    return 0 if rows and all(f.ok for f in result.figures) else 1


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    return inner(args) if args.inner else outer(args, argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
