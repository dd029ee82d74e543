"""Row copy on one GPU, in one run: torch D2D reference, the native kernel in-process and
through a CUDA IPC mapping of a second process's buffer, and IpcBackend's small-request
latency (publish call -> decode-side outcome visible, two processes).

    python bench/gpu_rowcopy.py --json bench/results/2026-11-29-h200-gpu-preset/gpu-h200-rowcopy-64KiB-2026-11-29.json

Figures are payload bytes per second; each case is warmed up, then timed over --reps
repetitions with CUDA events; best and median are reported beside the D2D reference.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import platform
import statistics
import sys
import time
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30


def _time_cuda(torch: Any, fn: Any, reps: int, warmup: int = 3) -> list[float]:
    """Seconds per call, one CUDA-event pair around each call."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end) / 1e3)
    return out


def _rate(nbytes: int, secs: list[float]) -> dict[str, float]:
    return {"best_gbps": nbytes / min(secs) / 1e9, "median_gbps": nbytes / statistics.median(secs) / 1e9,
            "best_ms": min(secs) * 1e3, "median_ms": statistics.median(secs) * 1e3}


def _serve_buffer(conn: Connection, nbytes: int) -> None:
    """Child: allocate a device buffer, export it, keep it until told to stop."""
    from kvxfer import native

    n = native.cuda_module()
    ptr = n.device_alloc(0, nbytes)
    try:
        conn.send(n.ipc_export(0, ptr))
        conn.recv()
    finally:
        n.device_free(0, ptr)


def bench_d2d(torch: Any, reps: int) -> dict[str, Any]:
    src = torch.empty(GiB, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    src.fill_(1)
    result = _rate(GiB, _time_cuda(torch, lambda: dst.copy_(src), reps))
    return {"case": "torch D2D copy", "bytes": GiB, **result}


def bench_kernel(torch: Any, reps: int, row: int, total: int, peer_buffer: Any = None) -> list[dict[str, Any]]:
    """Scattered rows from one pool into another (or into a peer's pool through IPC)."""
    from kvxfer import native

    n = native.cuda_module()
    rows = total // row
    slots = rows + rows // 4  # scattered: a quarter of the slots are skipped at random
    rng = np.random.default_rng(row)
    src_ix = rng.permutation(slots)[:rows].astype(np.int64)
    dst_ix = rng.permutation(slots)[:rows].astype(np.int64)
    src = torch.empty(slots * row, dtype=torch.uint8, device="cuda")
    src.random_(0, 255)
    if peer_buffer is None:
        dst_t = torch.zeros(slots * row, dtype=torch.uint8, device="cuda")
        dst_base, where = dst_t.data_ptr(), "in-process"
    else:
        dst_t, (dst_base, where) = None, peer_buffer
    stream = torch.cuda.current_stream().cuda_stream
    d_src = torch.from_numpy(src_ix).cuda()
    d_dst = torch.from_numpy(dst_ix).cuda()

    def host_indices() -> None:
        n.cuda_copy_rows(src.data_ptr(), row, src_ix, dst_base, row, dst_ix, rows, row, stream, 0, slots, slots)

    def device_indices() -> None:
        n.cuda_copy_rows_device(src.data_ptr(), row, d_src.data_ptr(), dst_base, row, d_dst.data_ptr(), rows, row,
                                stream, 0)

    out = []
    for label, fn in (("device indices", device_indices), ("host indices, uploaded per call", host_indices)):
        out.append({"case": f"native kernel, {where}, {label}", "row_bytes": row, "rows": rows, "bytes": rows * row,
                    **_rate(rows * row, _time_cuda(torch, fn, reps))})
    # Check the bytes once (a fast kernel that copies the wrong rows is worth nothing).
    torch.cuda.synchronize()
    if dst_t is not None:
        want = src.view(slots, row)[d_src]
        got = dst_t.view(slots, row)[d_dst]
        assert torch.equal(want, got), f"row copy of {row}-byte rows produced wrong bytes"
    return out


def bench_ipc_kernel(torch: Any, reps: int, row: int, total: int) -> list[dict[str, Any]]:
    from kvxfer import native

    n = native.cuda_module()
    rows = total // row
    nbytes = (rows + rows // 4) * row
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_serve_buffer, args=(child, nbytes), daemon=True)
    proc.start()
    try:
        handle, base, size = parent.recv()
        mapped = n.ipc_open(0, handle)
        try:
            return bench_kernel(torch, reps, row, total, peer_buffer=(mapped, "through a CUDA IPC mapping"))
        finally:
            torch.cuda.synchronize()
            n.ipc_close(0, mapped)
    finally:
        parent.send("stop")
        proc.join(30)
        if proc.is_alive():
            proc.kill()


def bench_latency(iters: int, rows: int = 32, row: int = 64 * KiB) -> dict[str, Any]:
    """publish() call -> the decode side's fetch outcome visible (its wake saw it), 32 x 64 KiB rows."""
    from kvxfer.backends.ipc import IpcBackend
    from kvxfer.contract import CacheKind, Delivered, LayerGroupRows, TokenRange, TransferMode, View
    from kvxfer.testing.ipc_pairs import ChildPeer, DeviceRows, PeerSpec

    slots = 4 * rows
    peer = ChildPeer(PeerSpec(TransferMode.PUSH, geometry=(("decode", row, slots),)))
    memory = DeviceRows((("prefill", row, slots),))
    local = IpcBackend("prefill", TransferMode.PUSH)
    lat_visible, lat_local = [], []
    try:
        local.register(memory.regions)
        rng = np.random.default_rng(0)
        for i in range(iters + 10):
            ords = np.arange(rows, dtype=np.int64)
            lv = View(f"r{i}", TokenRange(0, rows * 16), (LayerGroupRows(
                "g", CacheKind.PAGED, memory.regions[0], rng.permutation(slots)[:rows].astype(np.int64), ords),), b"x")
            pv = View(f"r{i}", TokenRange(0, rows * 16), (LayerGroupRows(
                "g", CacheKind.PAGED, peer.regions[0], rng.permutation(slots)[:rows].astype(np.int64), ords),), b"x")
            hint_p = peer.describe(pv)
            handle = peer.start("fetch", pv, local.describe(lv))
            t0 = time.monotonic_ns()
            attempt = local.publish(lv, hint_p)
            assert attempt.wait(10)
            t_local = time.monotonic_ns()
            outcome, quiet = peer.result(handle, 10)
            assert isinstance(outcome, Delivered) and outcome.all_delivered, outcome
            if i >= 10:  # the first ones open the mapping and warm up
                lat_visible.append((peer.last_visible_ns or 0) - t0)
                lat_local.append(t_local - t0)
    finally:
        local.shutdown()
        peer.close()
        memory.close()

    def pct(values: list[int], p: float) -> float:
        return float(np.percentile(np.array(values) / 1e3, p))

    return {"case": f"IpcBackend publish -> decode outcome visible, {rows} x {row // KiB} KiB", "iters": iters,
            "p50_us": pct(lat_visible, 50), "p99_us": pct(lat_visible, 99), "min_us": pct(lat_visible, 0),
            "publisher_concluded_p50_us": pct(lat_local, 50), "publisher_concluded_p99_us": pct(lat_local, 99)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--latency-iters", type=int, default=300)
    ap.add_argument("--sizes-mib", default="256,1024")
    ap.add_argument("--rows-kib", default="4,16,64")
    args = ap.parse_args(argv)

    import torch

    from kvxfer import native

    state = native.info()
    if not state.cuda_usable:
        print(f"kvxfer._native CUDA is not usable: {state.reason}", file=sys.stderr)
        return 2
    results: dict[str, Any] = {
        "machine": {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "python": platform.python_version(),
                    "cuda_runtime": state.cuda_runtime, "cuda_driver": state.cuda_driver, "host": platform.node()},
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    d2d = bench_d2d(torch, args.reps)
    torch.cuda.empty_cache()
    results["d2d"] = d2d
    print(f"{d2d['case']:<70} {d2d['best_gbps']:8.1f} GB/s best {d2d['median_gbps']:8.1f} median")
    cases = []
    for total in (int(s) * MiB for s in args.sizes_mib.split(",")):
        for row in (int(r) * KiB for r in args.rows_kib.split(",")):
            for case in bench_kernel(torch, args.reps, row, total) + bench_ipc_kernel(torch, args.reps, row, total):
                case["ratio_to_d2d_best"] = case["best_gbps"] / d2d["best_gbps"]
                cases.append(case)
                torch.cuda.empty_cache()
                print(f"{case['case']:<58} {row // KiB:3d} KiB x {case['rows']:7d} "
                      f"{case['best_gbps']:8.1f} GB/s best {case['median_gbps']:8.1f} median "
                      f"= {100 * case['ratio_to_d2d_best']:5.1f}% of D2D")
    results["row_copy"] = cases
    lat = bench_latency(args.latency_iters)
    results["small_request"] = lat
    print(f"{lat['case']}: p50 {lat['p50_us']:.1f} us, p99 {lat['p99_us']:.1f} us, min {lat['min_us']:.1f} us "
          f"(publisher concluded p50 {lat['publisher_concluded_p50_us']:.1f} us)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
