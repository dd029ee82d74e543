"""``kvxfer doctor``: which transport really carries the bytes, and how fast.

It reports NIXL's and UCX's versions, then for host memory (and device memory when CUDA
is present) runs two processes (``kvxfer.doctor.probe``): a target that registers a
buffer and an initiator that WRITEs (the push lane) and READs (the pull lane) at a few
sizes, and moves 64 KiB rows with per-row, prepared and coalesced descriptors. Both run
with ``UCX_PROTO_INFO=y``, so UCX prints the protocol it selected for each operation and
memory type; the doctor reads the transports from those tables (``cma``, ``tcp``,
``cuda_ipc``, ``rc_mlx5``...). A lane that falls back to TCP gets a loud warning with the
remedy: run that pair in push mode, or use the same-node ``ipc`` backend.

It also says who computes row digests on this host (``kvxfer serve --integrity``, on by
default): the compiled core, or numpy where ``kvxfer._native`` lacks it (several times slower);
with ``--peer``, whether that worker checks them (its ``/health``).

``--devices I,T`` puts the device-memory initiator on CUDA device I and the target on T: UCX
picks lanes by placement (between the two H200s of one host READ went over cuda_ipc at 382
GB/s; on a one-H200 machine, both ends on its GPU, it fell back to TCP at 0.5 GB/s), so ask
about the placement your workers have.

``--peer URL`` measures the lanes to a running worker, on this host or another: the worker
opens a probe target of its own (``kvxfer.worker.probe``: a NIXL agent apart from its
backend's, a buffer of at most 256 MiB, one probe at a time) and this host runs the initiator
against it, so push is this host WRITEing into the worker and pull READing from it. The
probe is renewed while it is measured and freed after (the worker frees one nobody renews
within a minute). A URL that does not answer, is no kvxfer worker, or a worker without the
probe route is one line, exit status 2.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import select
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kvxfer.backends.common.devices import cuda_device_count, cuda_present
from kvxfer.doctor import peer as doctor_peer
from kvxfer.doctor import ucx as doctor_ucx
from kvxfer.doctor.probe import ROW
from kvxfer.serving.command import CommandParser
from kvxfer.serving.keys import BearerKey, add_key_args, keys_from_args
from kvxfer.serving.urls import check_url
from kvxfer.ucx_env import net_devices_problem
from kvxfer.worker.probe import MAX_BYTES as PEER_BYTES
from kvxfer.worker.probe import nixl_versions

_CELL_TRANSPORT = re.compile(r"([a-z][a-z0-9_]*)/([A-Za-z0-9_:.\-]+)")
_OPS = {"remote memory write by": "write", "remote memory read by": "read"}
LANE_OP = {"push": "write", "pull": "read"}
REMEDY = {
    "pull": ("use push mode (TransferMode.PUSH: the publisher WRITEs) for this pair, "
             "or the same-node ipc backend (kvxfer.backends.ipc) when both ends share a node"),
    "push": ("use the same-node ipc backend (kvxfer.backends.ipc) when both ends share a node; across nodes, "
             "give UCX a faster transport (check UCX_TLS and the network devices NIXL can use)"),
}


TICK_S = 2.0
"""With --peer: the longest the doctor waits for its initiator without renewing the worker's probe."""


def _say(message: str) -> None:
    print(f"[doctor] {message}", file=sys.stderr, flush=True)


def versions() -> dict[str, str]:
    """NIXL's package version and the version of the UCX library NIXL loaded."""
    return nixl_versions()


def parse_proto_info(text: str) -> list[dict[str, Any]]:
    """The put/get protocol tables UCX printed: one entry per (endpoint config, op, memory)."""
    tables: list[dict[str, Any]] = []
    previous = ""
    current: dict[str, Any] | None = None
    for raw in text.splitlines():
        if "|" not in raw:
            continue
        line = raw[raw.index("|"):].strip().strip("|").strip()
        op = next((v for k, v in _OPS.items() if k in line), None)
        if op is not None:
            memory = _lane_memory(op, line)
            current = {"op": op, "memory": memory, "endpoint": previous, "what": line, "transports": []}
            tables.append(current)
        elif " by ucp_" in line:  # another operation's table (active messages, ...): not a lane
            current = None
        elif current is not None:
            cells = [c.strip() for c in line.split("|")]
            if len(cells) >= 3 and re.match(r"^[0-9.]+[KMGT]?(\.\.[0-9a-zA-Z]+)?$", cells[0]):
                for name, device in _CELL_TRANSPORT.findall(cells[-1]):
                    entry = f"{name}/{device}"
                    if entry not in current["transports"]:
                        current["transports"].append(entry)
        previous = line
    # "self" endpoints are an agent's connection to itself; lanes between processes are the rest.
    return [t for t in tables if " self " not in f" {t['endpoint']} "]


_ENDS = {"write": re.compile(r" from (\S+)(?: memory)? to (\S+)"),
         "read": re.compile(r" into (\S+)(?: memory)? from (\S+)")}


def _lane_memory(op: str, line: str) -> str:
    """"device" when both the initiator's buffer and the remote one are GPU memory, "host"
    when neither is, "mixed" otherwise. A mixed table (UCX prints "from host memory to
    cuda/dev[3]" beside "from cuda/GPU0 to cuda/dev[3]" between two GPUs) is not the lane the
    rows take, and counting it made a device lane look like TCP."""
    ends = _ENDS[op].search(line)
    if ends is None:  # another wording: any GPU memory named makes it a device table
        return "device" if "cuda" in line or "rocm" in line else "host"
    gpu = [any(k in end for k in ("cuda", "rocm")) for end in ends.groups()]
    return "device" if all(gpu) else "host" if not any(gpu) else "mixed"


def lanes_from_tables(tables: list[dict[str, Any]], memory: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for lane, op in LANE_OP.items():
        found: list[str] = []
        for t in tables:
            if t["op"] == op and t["memory"] == memory:
                found += [x for x in t["transports"] if x not in found]
        out[lane] = found
    return out


def _spawn(role: str, fd: int, memory: str, nbytes: int, reps: int, log: Path,
           cuda_device: int = -1) -> subprocess.Popen[bytes]:
    env = {**os.environ, "UCX_PROTO_INFO": "y", "NIXL_LOG_LEVEL": "WARN"}
    with open(log, "wb") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "kvxfer.doctor.probe", role, str(fd), memory, str(nbytes), str(reps),
             str(cuda_device)],
            pass_fds=[fd], env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)


def _recv(sock: socket.socket, timeout: float) -> dict[str, Any]:
    sock.settimeout(timeout)
    header = b""
    while len(header) < 8:
        part = sock.recv(8 - len(header))
        if not part:
            raise EOFError("probe process closed its connection")
        header += part
    size, body = int.from_bytes(header, "little"), b""
    while len(body) < size:
        part = sock.recv(size - len(body))
        if not part:
            raise EOFError("probe process closed its connection")
        body += part
    return dict(json.loads(body))


def _next(sock: socket.socket, timeout: float, tick: Callable[[], None] | None) -> dict[str, Any]:
    """The initiator's next message; ``tick`` is called at least every few seconds meanwhile
    (``--peer``: it renews the worker's probe, which would expire without a word)."""
    if tick is None:
        return _recv(sock, timeout)
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"no word from the initiator process within {timeout:g}s")
        # poll, not select: select refuses a descriptor past 1023, which a busy process has
        poller = select.poll()
        poller.register(sock, select.POLLIN)
        ready = poller.poll(min(left, TICK_S) * 1000)
        tick()
        if ready:
            return _recv(sock, timeout)


def _measure(memory: str, nbytes: int, reps: int, timeout: float, target: dict[str, Any], work: Path,
             cuda_device: int = -1, tick: Callable[[], None] | None = None) -> dict[str, Any]:
    """Run the initiator against ``target`` (its agent metadata, buffer address and device:
    a local target process's, or a worker's probe); figures, transports, and the raw tables."""
    i_parent, i_child = socket.socketpair()
    proc: subprocess.Popen[bytes] | None = None
    try:
        proc = _spawn("initiator", i_child.fileno(), memory, nbytes, reps, work / "initiator.log", cuda_device)
        i_child.close()
        blob = json.dumps(target).encode()
        i_parent.sendall(len(blob).to_bytes(8, "little") + blob)
        while True:
            message = _next(i_parent, timeout, tick)
            if "progress" in message:
                _say(f"{memory}: {message['progress']}")
                continue
            break
        proc.wait(timeout=timeout)
    except BaseException as exc:
        # The probes' own output says why (a crash, a hang): the folder stays, named here.
        if hasattr(exc, "add_note"):
            exc.add_note(f"kvxfer doctor: the {memory} probe's logs are in {work}")
        raise
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        i_parent.close()
        i_child.close()
    text = (work / "initiator.log").read_text(errors="replace")
    tables = parse_proto_info(text)
    if "error" in message:
        raise RuntimeError(f"{memory} probe failed: {message['error']} (log: {work / 'initiator.log'})")
    # The report carries the tables parsed from the logs; the logs stay only where a probe
    # failed (named in its error), so that repeated runs leave nothing behind in /tmp.
    shutil.rmtree(work, ignore_errors=True)
    return {"figures": message["results"], "lanes": lanes_from_tables(tables, memory), "tables": tables}


def probe(memory: str, nbytes: int, reps: int, timeout: float,
          devices: tuple[int, int] = (-1, -1)) -> dict[str, Any]:
    """Run target and initiator for one memory kind; figures, transports, and the raw tables.
    ``devices``: the initiator's and the target's CUDA devices for device memory (-1: the
    current one), since UCX picks another lane between two GPUs than within one."""
    work = Path(tempfile.mkdtemp(prefix="kvxfer-doctor-"))
    t_parent, t_child = socket.socketpair()
    target: subprocess.Popen[bytes] | None = None
    try:
        target = _spawn("target", t_child.fileno(), memory, nbytes, reps, work / "target.log", devices[1])
        t_child.close()
        try:
            info = _recv(t_parent, timeout)
        except BaseException as exc:
            if hasattr(exc, "add_note"):
                exc.add_note(f"kvxfer doctor: the {memory} probe's logs are in {work}")
            raise
        result = _measure(memory, nbytes, reps, timeout, info, work, devices[0])
        t_parent.sendall((1).to_bytes(8, "little") + b"x")
        target.wait(timeout=timeout)
        return result
    finally:
        if target is not None and target.poll() is None:
            target.kill()
            target.wait(timeout=10)
        t_parent.close()
        t_child.close()


def probe_peer(url: str, memory: str, nbytes: int, reps: int, timeout: float,
               key: BearerKey | None = None) -> dict[str, Any]:
    """``--peer``: the target is a probe the worker at ``url`` opens (``kvxfer.worker.probe``);
    the initiator runs here. The probe is renewed while it is measured and freed after;
    ``key``: the workers' cluster key, if they want one."""
    http_s = min(timeout, 30.0)
    target = doctor_peer.open_target(url, nbytes, memory, http_s, key)
    every, renewed = max(1.0, float(target.get("idle_s", 60.0)) / 6), time.monotonic()

    def renew() -> None:
        nonlocal renewed
        if time.monotonic() - renewed >= every:
            doctor_peer.renew(url, target["id"], http_s, key)
            renewed = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="kvxfer-doctor-peer-"))
    try:
        info = {k: target[k] for k in ("metadata", "address", "device")}
        result = _measure(memory, nbytes, reps, timeout, info, work, -1, renew)
    finally:
        problem = doctor_peer.free(url, target["id"], http_s, key)
        if problem:
            _say(f"could not free the worker's probe {target['id']} ({problem}); the worker frees it by itself "
                 f"{target.get('idle_s', 60)}s after this doctor's last word")
    result["target"] = {k: target.get(k) for k in ("id", "memory", "bytes", "device", "agent")}
    result["worker"] = {"host": target.get("host"), "versions": target.get("versions", {})}
    return result


def _warnings(report: dict[str, Any]) -> list[str]:
    out = []
    ucx = report.get("ucx", {})
    if any(t.startswith("tcp") for t in ucx.get("transports", [])):
        fast = ", ".join(ucx.get("without_error_handling", {}).get("transports", [])) or "unknown"
        out.append(f"!!! UCX BACKEND (ucxx, UCX {ucx.get('ucx', '?')}) tag lane falls back to TCP: with peer error "
                   f"handling this UCX leaves out shared memory between processes. Remedy on one host: "
                   f"UcxBackend(error_handling=False) (lane: {fast}; a dead peer is then seen only at the deadline), "
                   "or the nixl or ipc backend.")
    for memory, result in report["memory"].items():
        slow = {lane for lane, ts in result["lanes"].items() if any(t.startswith("tcp") for t in ts)}
        for lane, transports in result["lanes"].items():
            if not transports:
                out.append(f"{memory} {lane} lane: UCX printed no protocol table; transport unknown")
            elif lane in slow:
                # Push is no way out of a TCP pull when push is TCP as well: then both need the push remedy.
                remedy = REMEDY["push"] if "push" in slow else REMEDY.get(lane, REMEDY["push"])
                both = " (push is TCP too: switching to push mode does not help)" if lane == "pull" and \
                    "push" in slow else ""
                out.append(f"!!! {memory.upper()} {lane.upper()} lane falls back to TCP ({', '.join(transports)}): "
                           f"expect TCP speed{both}. Remedy: {remedy}.")
    return out


def integrity_report() -> dict[str, Any]:
    """Who computes the row digests here (``kvxfer serve --integrity``, on by default)."""
    from kvxfer import native  # noqa: PLC0415 - the compiled module loads only for a run

    state = native.info()
    if state.digest:
        return {"digests": "native", "detail": "the compiled core (kvxfer._native), rows read in place"}
    return {"digests": "numpy", "detail": f"numpy, several times slower: {state.reason or 'kvxfer._native lacks it'}"}


def _print(report: dict[str, Any]) -> None:
    v = report["versions"]
    print(f"NIXL {v.get('nixl', '?')} ({v.get('nixl_module', '?')}), UCX {v.get('ucx', '?')}")
    integrity = report.get("integrity")
    if integrity:
        print(f"row integrity (kvxfer serve --integrity, on by default): digests by {integrity['detail']}")
    peer = report.get("peer")
    if peer:
        pv = peer.get("versions") or {}
        print(f"peer: {peer.get('role')} worker {peer.get('name')!r} at {peer['url']} on host {peer.get('host')}, "
              f"pool on {peer.get('device')}, integrity {peer.get('integrity') or 'unknown (an older worker)'}: "
              f"NIXL {pv.get('nixl', '?')}, UCX {pv.get('ucx', '?')}")
        if (pv.get("nixl"), pv.get("ucx")) != (v.get("nixl"), v.get("ucx")):
            print("  (its NIXL or UCX differs from this host's: UCX picks lanes from what both ends offer)")
    for memory, result in report["memory"].items():
        placed = ""
        if "devices" in result:
            initiator, target = result["devices"]
            placed = f" (initiator on cuda:{initiator}, target on cuda:{target})"
        if peer:
            print(f"\n{memory} memory, this host ({report['host']}) with the worker on {peer.get('host')} "
                  f"(push: this host WRITEs into the worker; pull: it READs from the worker):")
        else:
            print(f"\n{memory} memory, two processes on this node{placed}:")
        for lane, transports in result["lanes"].items():
            print(f"  {lane:<4} ({LANE_OP[lane]}) lane: {', '.join(transports) or 'unknown'}")
        for lane, by_size in result["figures"]["lanes"].items():
            cells = ", ".join(f"{int(s) >> 10} KiB {f['best_gbps']:.2f}" for s, f in by_size.items())
            print(f"  {lane} GB/s (best): {cells}")
        rows = result["figures"]["rows"]
        print(f"  {rows['rows']} x 64 KiB rows, GB/s best (median):")
        for label, f in rows.items():
            if isinstance(f, dict):
                print(f"    {label:<36} {f['best_gbps']:6.2f} ({f['median_gbps']:.2f})")
    _print_ucx(report.get("ucx"))
    for warning in report["warnings"]:
        print(f"\n{warning}")


def _print_ucx(ucx: dict[str, Any] | None) -> None:
    if ucx is None:
        return
    if "skipped" in ucx:
        print(f"\nucx backend: skipped ({ucx['skipped']})")
        return
    print(f"\nucx backend ({ucx['ucxx']}, UCX {ucx['ucx']}), tag messages between two processes:")
    for label, lane in (("error handling on (default)", ucx), ("error handling off", ucx.get("without_error_handling"))):
        if lane:
            cells = ", ".join(f"{int(size) >> 10} KiB {gbps:.2f}" for size, gbps in lane.get("gbps", {}).items())
            print(f"  {label:<28} lane: {', '.join(lane.get('transports', [])) or 'unknown'}; GB/s: {cells}")


def _devices(parser: argparse.ArgumentParser, text: str | None, no_device: bool) -> tuple[int, int] | None:
    """``--devices`` read and checked before any process starts; a usage error naming it."""
    if text is None:
        return None
    from kvxfer.bench.config import ConfigError, parse_devices  # the bench's and the CLI's grammar

    try:
        devices = parse_devices(text)
    except ConfigError as exc:
        parser.error(f"{exc} (the initiator's and the target's)")
    if no_device:
        parser.error("--devices places the device-memory probe; it cannot go with --no-device")
    count = cuda_device_count()
    if count == 0:
        parser.error(f"--devices {text}: no CUDA device is visible, so there is no device memory to probe")
    absent = [d for d in devices if d >= count]
    if absent:
        parser.error(f"--devices {text}: cuda:{absent[0]} is not visible (this process sees {count} CUDA "
                     f"device{'' if count == 1 else 's'}: cuda:0..cuda:{count - 1})")
    return devices


def _parser() -> argparse.ArgumentParser:
    parser = CommandParser(prog="kvxfer doctor", description=__doc__.splitlines()[0])
    parser.add_argument("--json", metavar="PATH", help="write the report as JSON to PATH")
    parser.add_argument("--bytes", type=int, default=None,
                        help=f"buffer size per process (default 512 MiB; with --peer {PEER_BYTES >> 20} MiB, "
                             "the most a worker lends a probe)")
    parser.add_argument("--reps", type=int, default=5, help="timed repetitions per figure (best and median)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for each probe step")
    parser.add_argument("--no-device", action="store_true", help="skip device memory even when CUDA is present")
    parser.add_argument("--strict", action="store_true",
                        help="exit 1 when a lane falls back to TCP or its transport is unknown (for scripts and CI)")
    parser.add_argument("--no-ucx", action="store_true", help="skip the ucx backend's lane (ucxx's UCX)")
    parser.add_argument("--devices", metavar="I,T",
                        help="CUDA devices of the device-memory initiator (it WRITEs on the push lane and READs "
                             "on the pull lane, as a pull's decode end does) and target, e.g. 0,1 "
                             "(default: each process's current device)")
    parser.add_argument("--peer", metavar="URL",
                        help="probe a running worker (`kvxfer serve`'s URL, e.g. http://10.0.0.2:8101): it hosts the "
                             "target, this host the initiator; push WRITEs from here into the worker, pull READs "
                             "from it. Run it on the other end's host")
    add_key_args(parser, cluster=True)  # --peer: a worker with a cluster key wants it
    return parser


def _check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> tuple[int, int] | None:
    """Every flag checked before anything starts (usage errors, exit 2); ``--devices`` read."""
    keys_from_args(parser, args)
    if args.peer is not None:
        try:
            args.peer = check_url(args.peer)
        except ValueError as exc:
            parser.error(f"--peer: {exc}")
        if args.devices is not None:
            parser.error("--devices places both ends on this host; with --peer the target is on the worker's "
                         "pool's device")
    if args.bytes is None:
        args.bytes = PEER_BYTES if args.peer else 512 << 20
    if args.bytes < 2 * ROW:  # the row figures need two 64 KiB rows at least
        parser.error(f"--bytes must be at least {2 * ROW} (two {ROW >> 10} KiB rows), got {args.bytes}")
    if args.reps < 1:
        parser.error(f"--reps must be at least 1, got {args.reps}")
    if not args.timeout > 0:
        parser.error(f"--timeout must be positive, got {args.timeout}")
    devices = _devices(parser, args.devices, args.no_device)
    problem = net_devices_problem()
    if problem:
        parser.error(problem)
    return devices


def _local(args: argparse.Namespace, devices: tuple[int, int] | None, report: dict[str, Any]) -> None:
    kinds = ["host"] + (["device"] if cuda_present() and not args.no_device else [])
    for memory in kinds:
        _say(f"{memory}: starting target and initiator processes ({args.bytes >> 20} MiB each)")
        placed = devices if memory == "device" and devices is not None else (-1, -1)
        report["memory"][memory] = probe(memory, args.bytes, args.reps, args.timeout, placed)
        if placed != (-1, -1):
            report["memory"][memory]["devices"] = list(placed)
    if "device" not in kinds:
        report["device_skipped"] = "no CUDA device" if not args.no_device else "--no-device"
    if not args.no_ucx:
        _say("ucx: a tag-message sender and receiver over ucxx")
        report["ucx"] = doctor_ucx.probe(min(args.bytes, 64 << 20), args.reps, args.timeout)


def _remote(args: argparse.Namespace, worker: dict[str, Any], report: dict[str, Any]) -> None:
    """``--peer``: host memory, and device memory when both this host and the worker's pool have a GPU."""
    worker_device = str(worker.get("probe", {}).get("device", "cpu"))
    skipped = "--no-device" if args.no_device else "no CUDA device here" if not cuda_present() else \
        f"the worker's pool is on {worker_device}" if not worker_device.startswith("cuda") else ""
    for memory in ["host"] + ([] if skipped else ["device"]):
        _say(f"{memory}: the worker at {args.peer} opens a {args.bytes >> 20} MiB target; an initiator starts here")
        result = probe_peer(args.peer, memory, args.bytes, args.reps, args.timeout, args.cluster_key)
        side = result.pop("worker")  # the worker's host and versions, as its probe answered
        report["memory"][memory] = result
        report["peer"].update({k: side.get(k) for k in ("host", "versions")})
    if skipped:
        report["device_skipped"] = skipped
    if not args.no_ucx:
        report["ucx"] = {"skipped": "--peer: the ucx backend's lane is probed between two processes of this host "
                                    "only (run kvxfer doctor without --peer)"}


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(list(argv) if argv is not None else None)
    devices = _check(parser, args)
    started = time.time()
    report: dict[str, Any] = {"host": socket.gethostname(), "memory": {}}
    try:
        if args.peer:
            worker = doctor_peer.connect(args.peer, min(args.timeout, 30.0), args.cluster_key)
            report["peer"] = {"url": args.peer, "name": worker.get("name"), "role": worker.get("role"),
                              "device": worker.get("probe", {}).get("device"), "integrity": worker.get("integrity")}
        _say("reading versions")
        report["versions"] = versions()
        report["integrity"] = integrity_report()
        if args.peer:
            _remote(args, worker, report)
        else:
            _local(args, devices, report)
    except doctor_peer.PeerError as exc:
        print(f"kvxfer doctor: error: {exc}", file=sys.stderr, flush=True)
        return 2
    except (RuntimeError, OSError, EOFError, subprocess.SubprocessError) as exc:
        if not args.peer:
            raise
        # Between two hosts a lane that does not work at all is an answer too: one line, not a traceback.
        notes = "; ".join(getattr(exc, "__notes__", []))
        print(f"kvxfer doctor: error: --peer {args.peer}: the probe failed: {type(exc).__name__}: {exc}"
              f"{' (' + notes + ')' if notes else ''}", file=sys.stderr, flush=True)
        return 2
    report["warnings"] = _warnings(report)
    report["seconds"] = round(time.time() - started, 1)
    _print(report)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
        _say(f"wrote {args.json}")
    return 1 if args.strict and report["warnings"] else 0


if __name__ == "__main__":
    sys.exit(main())
