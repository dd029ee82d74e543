"""IpcBackend throughput with several requests in flight, beside the device copy of the same run.

    python bench/ipc_in_flight.py [--row-sizes 4096,16384,65536] [--request-mib 256] [--depths 1,2,4]
                                  [--requests N] [--reps 10] [--devices P,D] [--json OUT.json] [--emulated]

``kvxfer bench``'s ``ipc`` figure times one request at a time: publish call to the
publisher's outcome, so each request pays the host's fixed cost (checks, launch, the
completion record, the outcome) while the GPU waits. A serving engine moves several requests
at once; here ``depth`` requests (disjoint scattered rows of one prefill pool, each to its own
fetch in the decode process) are published back to back, and the figure is their payload
over the time from the first publish call to the last publisher outcome (a wake callback per
request). Depth 1 is the one-request figure. With ``--requests N`` (more than the depth), N
requests go out in all, a new one published as soon as one of the ``depth`` in flight
concludes: the steady state of a loaded server, where the first request's start and the last
one's end are spread over N requests instead of ``depth``. Each request lands in decode rows
of its own; the first and last requests' rows are compared byte for byte. ``--emulated`` runs
over kvxfer.testing.host_cuda (no GPU): the code path, not figures. ``--devices 0,1`` puts
the prefill end on GPU 0 and the decode end on GPU 1: the reference is then the torch peer
copy between them.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import threading
import time
from typing import Any

import numpy as np

import kvxfer.testing.ipc_pairs as pair
from kvxfer.bench.config import devices_argument


def device_copy_gbps(nbytes: int, reps: int, emulated: bool, devices: tuple[int, int] = (0, 0)) -> float:
    """The reference: one contiguous copy of a request's bytes (torch D2D, or the peer copy
    between ``devices``; numpy on the host when emulated)."""
    if emulated:
        a, b = np.ones(nbytes, np.uint8), np.empty(nbytes, np.uint8)
        best = min(_timed(lambda: np.copyto(b, a)) for _ in range(reps))
        return nbytes / best / 1e9
    import torch

    src = torch.ones(nbytes, dtype=torch.uint8, device=f"cuda:{devices[0]}")
    dst = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{devices[1]}")
    times = []
    with torch.cuda.device(devices[0]):  # a peer copy runs on the source device's stream
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for _ in range(reps + 2):
            start.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
    return nbytes / min(times[2:]) / 1e9


def _timed(fn: Any) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def run_point(row: int, rows: int, depth: int, reps: int, emulated: bool, requests: int = 0,
              devices: tuple[int, int] = (0, 0)) -> dict[str, Any]:
    """``requests`` in all (at least ``depth``), ``depth`` of them in flight at a time."""
    total = max(depth, requests)
    slots = total * rows + total * rows // 4
    with pair.push_pair(row, slots, emulated, devices=devices) as (peer, memory, local):
        rng = np.random.default_rng(row + depth)
        mine = rng.permutation(slots)[: total * rows].astype(np.int64).reshape(total, rows)
        theirs = rng.permutation(slots)[: total * rows].astype(np.int64).reshape(total, rows)
        for k in (0, total - 1):
            memory.write("prefill", mine[k], rng.integers(0, 256, rows * row, dtype=np.uint8).tobytes())
        times = []
        for rep in range(reps + 1):
            views = [(pair.one_group_view(memory.regions[0], mine[k], f"r{rep}.{k}"),
                      pair.one_group_view(peer.regions[0], theirs[k], f"r{rep}.{k}"))
                     for k in range(total)]
            hints = [peer.describe(pv) for _, pv in views]
            handles = [peer.start("fetch", pv, local.describe(lv)) for lv, pv in views]
            ended = threading.Semaphore(0)  # released once per request, by the backend's progress thread
            t0 = time.perf_counter()
            attempts = []
            for k, ((lv, _), hint) in enumerate(zip(views, hints)):
                if k >= depth and not ended.acquire(timeout=60):  # one in flight ended: publish the next
                    raise RuntimeError("the publisher did not conclude")
                attempts.append(local.publish(lv, hint, _once(ended.release)))
            for _ in range(min(depth, total)):
                if not ended.acquire(timeout=60):
                    raise RuntimeError("the publisher did not conclude")
            elapsed = time.perf_counter() - t0
            for attempt, handle in zip(attempts, handles):
                out = attempt.poll()
                theirs_out, _quiet = peer.result(handle, 30)
                if out is None or not out.all_delivered or theirs_out is None or not theirs_out.all_delivered:
                    raise RuntimeError(f"not delivered: {out!r} / {theirs_out!r}")
            if rep > 0:
                times.append(elapsed)
        for k in (0, total - 1):
            if peer.read("decode", theirs[k]) != memory.read("prefill", mine[k]):
                raise RuntimeError(f"request {k}: the decode rows differ from the prefill rows")
    payload = total * rows * row
    return {"row_bytes": row, "rows_per_request": rows, "depth": depth, "requests": total, "payload_bytes": payload,
            "gbps_best": payload / min(times) / 1e9, "gbps_median": payload / statistics.median(times) / 1e9,
            "reps": len(times), "verified": True}


def _machine(emulated: bool) -> str:
    gpu = ""
    if not emulated:
        import torch

        gpu = f", {torch.cuda.get_device_name(0)}"
    return f"{platform.node()}: {platform.processor() or platform.machine()}{gpu}"


def _once(fn: Any) -> Any:
    """A wake callback that counts its attempt's outcome once (wake also runs on quiescence)."""
    done = [False]

    def wake() -> None:
        if not done[0]:
            done[0] = True
            fn()
    return wake


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--row-sizes", default="4096,16384,65536")
    ap.add_argument("--request-mib", type=float, default=256)
    ap.add_argument("--depths", default="1,2,4")
    ap.add_argument("--requests", type=int, default=0,
                    help="requests in all, a new one published as each ends (default: the depth, one batch)")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--json", help="write the figures here")
    ap.add_argument("--devices", default=(0, 0), type=devices_argument,
                    help="CUDA devices of the prefill and decode ends (e.g. 0,1)")
    ap.add_argument("--emulated", action="store_true", help="kvxfer.testing.host_cuda instead of CUDA (no GPU)")
    args = ap.parse_args(argv)
    devices = prefill, decode = args.devices
    if args.emulated and devices != (0, 0):
        ap.error("--emulated has one device: leave --devices at 0,0")
    if not args.emulated:
        import torch

        if max(devices) >= torch.cuda.device_count():
            ap.error(f"--devices {prefill},{decode}: this machine sees {torch.cuda.device_count()} CUDA device(s)")
    request = int(args.request_mib * 2**20)
    reference = device_copy_gbps(request, args.reps, args.emulated, devices)
    what = "host memcpy" if args.emulated else (
        f"torch peer copy cuda:{prefill} -> cuda:{decode}" if prefill != decode else "torch D2D copy")
    print(f"reference: {what} of {request >> 20} MiB: {reference:.1f} GB/s")
    figures = []
    for row in (int(x) for x in args.row_sizes.split(",")):
        for depth in (int(x) for x in args.depths.split(",")):
            fig = run_point(row, request // row, depth, args.reps, args.emulated, args.requests, devices)
            fig["vs_reference"] = fig["gbps_best"] / reference
            figures.append(fig)
            print(f"{row // 1024:>3} KiB rows x {request // row:>6} per request, {fig['requests']} requests, "
                  f"{depth} in flight: "
                  f"{fig['gbps_best']:8.1f} GB/s best, {fig['gbps_median']:8.1f} median, "
                  f"{100 * fig['vs_reference']:5.1f}% of the reference")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"what": "IpcBackend, `requests` requests with up to `depth` in flight, first publish call to "
                               "last publisher outcome",
                       "command": " ".join(sys.argv), "machine": _machine(args.emulated), "python": platform.python_version(),
                       "emulated": args.emulated, "devices": list(devices), "reference_gbps": reference,
                       "reference": f"{what}, one request's bytes",
                       "figures": figures}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
