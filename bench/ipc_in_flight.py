"""IpcBackend throughput with several requests in flight, beside the device copy of the same run.

    python bench/ipc_in_flight.py [--row-sizes 4096,16384,65536] [--request-mib 256] [--depths 1,2,4]
                                  [--reps 10] [--json OUT.json] [--emulated]

``kvxfer bench``'s ``ipc`` figure times one request at a time: publish call to the
publisher's outcome, so each request pays the host's fixed cost (checks, launch, the
completion record, the outcome) while the GPU waits. A serving engine moves several requests
at once; here ``depth`` requests (disjoint scattered rows of one prefill pool, each to its own
fetch in the decode process) are published back to back, and the figure is their payload
over the time from the first publish call to the last publisher outcome (a wake callback per
request). Depth 1 is the one-request figure. Rows of one sample per point are compared byte for
byte. ``--emulated`` runs over kvxfer.testing.host_cuda (no GPU): the code path, not figures.
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

import kvxfer.backends.ipc_pair as pair


def device_copy_gbps(nbytes: int, reps: int, emulated: bool) -> float:
    """The reference: one contiguous copy of a request's bytes (torch D2D; numpy on the host when emulated)."""
    if emulated:
        a, b = np.ones(nbytes, np.uint8), np.empty(nbytes, np.uint8)
        best = min(_timed(lambda: np.copyto(b, a)) for _ in range(reps))
        return nbytes / best / 1e9
    import torch

    a = torch.ones(nbytes, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps + 2):
        start.record()
        b.copy_(a)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return nbytes / min(times[2:]) / 1e9


def _timed(fn: Any) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def run_point(row: int, rows: int, depth: int, reps: int, emulated: bool) -> dict[str, Any]:
    slots = depth * rows + depth * rows // 4
    with pair.push_pair(row, slots, emulated) as (peer, memory, local):
        rng = np.random.default_rng(row + depth)
        mine = rng.permutation(slots)[: depth * rows].astype(np.int64).reshape(depth, rows)
        theirs = rng.permutation(slots)[: depth * rows].astype(np.int64).reshape(depth, rows)
        memory.write("prefill", mine[0], rng.integers(0, 256, rows * row, dtype=np.uint8).tobytes())
        times = []
        for rep in range(reps + 1):
            views = [(pair.one_group_view(memory.regions[0], mine[k], f"r{rep}.{k}"),
                      pair.one_group_view(peer.regions[0], theirs[k], f"r{rep}.{k}"))
                     for k in range(depth)]
            hints = [peer.describe(pv) for _, pv in views]
            handles = [peer.start("fetch", pv, local.describe(lv)) for lv, pv in views]
            left, seen, all_seen, lock = [depth], [0.0], threading.Event(), threading.Lock()

            def wake(left: list[int] = left, seen: list[float] = seen, all_seen: threading.Event = all_seen,
                     lock: threading.Lock = lock) -> None:
                with lock:
                    left[0] -= 1
                    if left[0] == 0:
                        seen[0] = time.perf_counter()
                        all_seen.set()

            t0 = time.perf_counter()
            attempts = [local.publish(lv, hint, _once(wake)) for (lv, _), hint in zip(views, hints)]
            if not all_seen.wait(60):
                raise RuntimeError("the publisher did not conclude")
            for attempt, handle in zip(attempts, handles):
                out = attempt.poll()
                theirs_out, _quiet = peer.result(handle, 30)
                if out is None or not out.all_delivered or theirs_out is None or not theirs_out.all_delivered:
                    raise RuntimeError(f"not delivered: {out!r} / {theirs_out!r}")
            if rep > 0:
                times.append(seen[0] - t0)
        if peer.read("decode", theirs[0]) != memory.read("prefill", mine[0]):
            raise RuntimeError("the decode rows differ from the prefill rows")
    payload = depth * rows * row
    return {"row_bytes": row, "rows_per_request": rows, "depth": depth, "payload_bytes": payload,
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
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--json", help="write the figures here")
    ap.add_argument("--emulated", action="store_true", help="kvxfer.testing.host_cuda instead of CUDA (no GPU)")
    args = ap.parse_args(argv)
    request = int(args.request_mib * 2**20)
    reference = device_copy_gbps(request, args.reps, args.emulated)
    print(f"reference: {'host memcpy' if args.emulated else 'torch D2D copy'} of {request >> 20} MiB: {reference:.1f} GB/s")
    figures = []
    for row in (int(x) for x in args.row_sizes.split(",")):
        for depth in (int(x) for x in args.depths.split(",")):
            fig = run_point(row, request // row, depth, args.reps, args.emulated)
            fig["vs_reference"] = fig["gbps_best"] / reference
            figures.append(fig)
            print(f"{row // 1024:>3} KiB rows x {request // row:>6} per request, {depth} in flight: "
                  f"{fig['gbps_best']:8.1f} GB/s best, {fig['gbps_median']:8.1f} median, "
                  f"{100 * fig['vs_reference']:5.1f}% of the reference")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"what": "IpcBackend, depth requests in flight, first publish call to last publisher outcome",
                       "command": " ".join(sys.argv), "machine": _machine(args.emulated), "python": platform.python_version(),
                       "emulated": args.emulated, "reference_gbps": reference,
                       "reference": "host memcpy" if args.emulated else "torch D2D copy, one request's bytes",
                       "figures": figures}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
