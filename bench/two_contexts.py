"""What a packed chunk's scatter costs the receiving process, alone on the GPU and while another
process (the sender's role) keeps the same GPU busy with row kernels.

The packed NIXL path's receiver scatters each landed chunk on its own stream and waits for
it (``nixl_packed.Arena.scatter``); the sender gathers on its own context meanwhile. Kernels
of two processes do not run side by side on one GPU without MPS: the GPU switches between
their contexts. This script times, from the host, exactly that call (native scatter of one
chunk of scattered rows from a host index array, then a stream synchronize):

  alone      nothing else on the GPU;
  contended  a child process loops native gathers of the same shape on the same GPU.

    python bench/two_contexts.py [--row-bytes 65536] [--chunk-mib 32] [--reps 200] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import platform
import statistics
import sys
import time
from typing import Any

MiB = 1 << 20


def _buffers(row_bytes: int, chunk_bytes: int) -> tuple[Any, Any, Any, int]:
    import numpy as np
    import torch

    rows = chunk_bytes // row_bytes
    pool = torch.empty(rows * 16 * row_bytes, dtype=torch.uint8, device="cuda")  # 16x the chunk's rows
    arena = torch.empty(chunk_bytes, dtype=torch.uint8, device="cuda")
    slots = np.random.default_rng(1).permutation(rows * 16)[:rows].astype(np.int64)
    return pool, arena, slots, rows


def _busy(row_bytes: int, chunk_bytes: int, ready: Any, stop: Any) -> None:
    """The child: native gathers into its own arena until told to stop."""
    import torch

    from kvxfer import native
    from kvxfer.contract import MemoryKind

    pool, arena, slots, _ = _buffers(row_bytes, chunk_bytes)
    stream = torch.cuda.Stream()
    ready.set()
    while not stop.is_set():
        native.gather_rows(src_base=pool.data_ptr(), src_stride=row_bytes, src_slots=slots, dst_base=arena.data_ptr(),
                           row_bytes=row_bytes, memory=MemoryKind.DEVICE, stream=int(stream.cuda_stream))
        stream.synchronize()


def _time_scatters(row_bytes: int, chunk_bytes: int, reps: int) -> list[float]:
    import torch

    from kvxfer import native
    from kvxfer.contract import MemoryKind

    pool, arena, slots, _ = _buffers(row_bytes, chunk_bytes)
    stream = torch.cuda.Stream()
    out = []
    for i in range(reps + 10):
        start = time.perf_counter()
        native.scatter_rows(src_base=arena.data_ptr(), dst_base=pool.data_ptr(), dst_stride=row_bytes, dst_slots=slots,
                            row_bytes=row_bytes, memory=MemoryKind.DEVICE, stream=int(stream.cuda_stream))
        stream.synchronize()
        if i >= 10:  # warm-up
            out.append(time.perf_counter() - start)
    return out


def _summary(seconds: list[float], nbytes: int) -> dict[str, float]:
    ordered = sorted(seconds)
    return {"p50_us": statistics.median(seconds) * 1e6, "p90_us": ordered[int(0.9 * len(ordered))] * 1e6,
            "best_us": ordered[0] * 1e6, "p50_gbps": nbytes / statistics.median(seconds) / 1e9, "reps": len(seconds)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--row-bytes", type=int, default=64 << 10)
    parser.add_argument("--chunk-mib", type=int, default=32)
    parser.add_argument("--reps", type=int, default=200)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    chunk = args.chunk_mib * MiB
    import torch

    result: dict[str, Any] = {"machine": {"host": platform.node(), "python": sys.version.split()[0],
                                          "gpu": torch.cuda.get_device_name()},
                              "row_bytes": args.row_bytes, "chunk_bytes": chunk}
    result["alone"] = _summary(_time_scatters(args.row_bytes, chunk, args.reps), chunk)
    ctx = mp.get_context("spawn")
    ready, stop = ctx.Event(), ctx.Event()
    child = ctx.Process(target=_busy, args=(args.row_bytes, chunk, ready, stop), daemon=True)
    child.start()
    try:
        if not ready.wait(120):
            raise RuntimeError("the busy child did not start")
        result["contended"] = _summary(_time_scatters(args.row_bytes, chunk, args.reps), chunk)
    finally:
        stop.set()
        child.join(30)
        if child.is_alive():
            child.kill()
    for name in ("alone", "contended"):
        r = result[name]
        print(f"{name:10s} scatter of {args.chunk_mib} MiB in {args.row_bytes >> 10} KiB rows: p50 {r['p50_us']:7.1f} us "
              f"(p90 {r['p90_us']:7.1f}, best {r['best_us']:7.1f}), {r['p50_gbps']:7.1f} GB/s at p50")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
