"""The best any pack -> one WRITE -> unpack path can do on one GPU, beside the D2D copy.

A packed NIXL transfer moves each byte three times on the device: the gather into the
sender's bounce arena, the WRITE into the receiver's arena, the scatter into its rows.
Between two processes on one GPU all three share that GPU's memory bandwidth, where the
D2D reference moves each byte once. This script times, in one process and without NIXL:

  d2d        torch ``copy_`` of the payload (the reference, as in every kvxfer bench);
  direct     one native kernel from scattered rows to scattered rows (what IpcBackend runs);
  serial     native gather + one contiguous D2D copy (a WRITE at device speed) + native scatter;
  pipelined  the same three stages in chunks on three streams, overlapping one another.

Indices are device-resident, so only the copies are timed. ``pipelined`` bounds the packed
NIXL path from above on this machine: NIXL's WRITE is slower than a D2D copy (docs/performance.md) and
the path adds notifications between processes.

    python bench/bounce_ceiling.py [--row-bytes 65536] [--total-mib 256,1024] [--chunk-mib 32] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from typing import Any

MiB = 1 << 20


def run(row_bytes: int, total: int, chunk_bytes: int, reps: int) -> dict[str, Any]:
    import torch

    from kvxfer import native
    from kvxfer.bench.config import Repetition
    from kvxfer.bench.timing import cuda_timed, time_runs

    cuda = native.cuda_module()
    rows = total // row_bytes
    slots = rows + rows // 4
    gen = torch.Generator(device="cuda").manual_seed(1)
    src = torch.randint(0, 256, (slots * row_bytes,), dtype=torch.uint8, device="cuda", generator=gen)
    dst = torch.zeros(slots * row_bytes, dtype=torch.uint8, device="cuda")
    src_ix = torch.randperm(slots, device="cuda", generator=gen)[:rows].contiguous()
    dst_ix = torch.randperm(slots, device="cuda", generator=gen)[:rows].contiguous()
    per_chunk = max(1, chunk_bytes // row_bytes)
    arena_slots = 4
    arena_a = torch.empty(arena_slots * per_chunk * row_bytes, dtype=torch.uint8, device="cuda")
    arena_b = torch.empty_like(arena_a)
    payload_a = torch.empty(total, dtype=torch.uint8, device="cuda")
    payload_b = torch.empty_like(payload_a)
    streams = [torch.cuda.Stream() for _ in range(3)]

    def kernel(s_base: int, s_stride: int, s_ix: int, d_base: int, d_stride: int, d_ix: int, n: int,
               stream: int) -> None:
        cuda.cuda_copy_rows_device(s_base, s_stride, s_ix, d_base, d_stride, d_ix, n, row_bytes, stream, 0)

    cur = lambda: torch.cuda.current_stream().cuda_stream  # noqa: E731

    def d2d() -> None:
        payload_b.copy_(payload_a)

    def direct() -> None:
        kernel(src.data_ptr(), row_bytes, src_ix.data_ptr(), dst.data_ptr(), row_bytes, dst_ix.data_ptr(), rows, cur())

    def serial() -> None:
        kernel(src.data_ptr(), row_bytes, src_ix.data_ptr(), payload_a.data_ptr(), row_bytes, 0, rows, cur())
        payload_b.copy_(payload_a)
        kernel(payload_b.data_ptr(), row_bytes, 0, dst.data_ptr(), row_bytes, dst_ix.data_ptr(), rows, cur())

    def pipelined() -> None:
        gather, write, scatter = streams
        here = torch.cuda.current_stream()
        for s in streams:
            s.wait_stream(here)
        done: list[tuple[Any, Any, Any]] = []  # per chunk: gathered, written, scattered
        for k, first in enumerate(range(0, rows, per_chunk)):
            n = min(per_chunk, rows - first)
            slot = k % arena_slots
            a = arena_a.data_ptr() + slot * per_chunk * row_bytes
            b = arena_b.data_ptr() + slot * per_chunk * row_bytes
            if k >= arena_slots:  # a slot is reused only after its last chunk moved on
                gather.wait_event(done[k - arena_slots][1])
                write.wait_event(done[k - arena_slots][2])
            kernel(src.data_ptr(), row_bytes, src_ix.data_ptr() + 8 * first, a, row_bytes, 0, n, gather.cuda_stream)
            gathered = torch.cuda.Event()
            gathered.record(gather)
            write.wait_event(gathered)
            with torch.cuda.stream(write):
                arena_b[slot * per_chunk * row_bytes:(slot * per_chunk + n) * row_bytes].copy_(
                    arena_a[slot * per_chunk * row_bytes:(slot * per_chunk + n) * row_bytes])
            written = torch.cuda.Event()
            written.record(write)
            scatter.wait_event(written)
            kernel(b, row_bytes, 0, dst.data_ptr(), row_bytes, dst_ix.data_ptr() + 8 * first, n, scatter.cuda_stream)
            scattered = torch.cuda.Event()
            scattered.record(scatter)
            done.append((gathered, written, scattered))
        for s in streams:
            here.wait_stream(s)

    out: dict[str, Any] = {"row_bytes": row_bytes, "total_bytes": rows * row_bytes, "chunk_bytes": per_chunk * row_bytes}
    for name, fn in (("d2d", d2d), ("direct", direct), ("serial", serial), ("pipelined", pipelined)):
        dst.zero_()
        timing = time_runs(cuda_timed(fn), Repetition(warmup=3, reps=reps, budget_s=30.0))
        if name != "d2d":
            torch.cuda.synchronize()
            got = dst.view(slots, row_bytes)[dst_ix.long()]
            want = src.view(slots, row_bytes)[src_ix.long()]
            if not torch.equal(got, want):
                raise RuntimeError(f"{name}: the destination rows differ from the source rows")
        out[name] = {"best_gbps": rows * row_bytes / timing.best / 1e9,
                     "median_gbps": rows * row_bytes / timing.median / 1e9}
    ref = out["d2d"]["best_gbps"]
    for name in ("direct", "serial", "pipelined"):
        out[name]["of_d2d"] = out[name]["best_gbps"] / ref
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--row-bytes", type=int, default=65536)
    ap.add_argument("--total-mib", default="256,1024")
    ap.add_argument("--chunk-mib", type=int, default=32)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args(argv)
    import torch

    results = []
    for mib in (int(x) for x in args.total_mib.split(",")):
        r = run(args.row_bytes, mib * MiB, args.chunk_mib * MiB, args.reps)
        results.append(r)
        print(f"{r['total_bytes'] // MiB} MiB of {args.row_bytes // 1024} KiB scattered rows, chunks of "
              f"{r['chunk_bytes'] // MiB} MiB; best GB/s (of d2d), rows verified:")
        for name in ("d2d", "direct", "serial", "pipelined"):
            f = r[name]
            share = f" ({f['of_d2d']:.1%})" if "of_d2d" in f else ""
            print(f"  {name:10s} {f['best_gbps']:9.1f}{share}   median {f['median_gbps']:.1f}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"schema": "kvxfer.bounce_ceiling/1", "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                       "machine": {"gpu": torch.cuda.get_device_name(0), "host": platform.node(),
                                   "python": platform.python_version(), "torch": torch.__version__},
                       "results": results}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
