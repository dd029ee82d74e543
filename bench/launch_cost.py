"""What the native calls on a small transfer's path cost on this host, alone (GPU machine).

    python bench/launch_cost.py [--rows 32] [--row-bytes 65536] [--reps 2000] [--idle-us 0,300]

One process, one stream, device memory. Each repetition queues what IpcBackend queues for a
small push (one row-copy kernel with its indices in the launch parameters, the doorbell
store into page-locked host memory, the completion event), then spins until the event
completes. Printed: the median of each call's duration and of the time from the first call
to the doorbell word being visible to the CPU and to the event completing, in microseconds;
once with the thread running straight on, and once idle (sleeping) ``--idle-us`` before each
repetition, as a publisher that waited for its work is. ``trivial_call`` (cudaGetDeviceCount)
is what any call through the binding costs.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import sys
import time

import numpy as np

from kvxfer import native


def _median_us(values: list[int]) -> float:
    return statistics.median(values) / 1e3


def measure(rows: int, row_bytes: int, reps: int, idle_us: int) -> dict[str, float]:
    n = native.cuda_module()
    device = 0
    slots = rows * 4
    src = n.device_alloc(device, slots * row_bytes)
    dst = n.device_alloc(device, slots * row_bytes)
    word = np.zeros(1, dtype=np.uint64)
    word_dev = n.host_register(device, word.ctypes.data, 8)
    stream = n.stream_create(device)
    event = n.event_create(device)
    rng = np.random.default_rng(0)
    steps: dict[str, list[int]] = {k: [] for k in ("trivial_call", "copy_call", "bell_call", "event_call",
                                                    "to_bell_seen", "to_event_done")}
    view = ctypes.c_uint64.from_address(word.ctypes.data)
    try:
        for i in range(reps + 20):
            s_ix = rng.permutation(slots)[:rows].astype(np.int64)
            d_ix = rng.permutation(slots)[:rows].astype(np.int64)
            word[0] = 0
            if idle_us:
                time.sleep(idle_us / 1e6)
            t0 = time.perf_counter_ns()
            n.device_count()  # a native call that does next to nothing: the binding's own cost
            t1 = time.perf_counter_ns()
            n.cuda_copy_rows(src, row_bytes, s_ix, dst, row_bytes, d_ix, rows, row_bytes, stream, device, -1, -1)
            t2 = time.perf_counter_ns()
            n.stream_write_word(device, stream, word_dev, i + 1)
            t3 = time.perf_counter_ns()
            n.event_record(event, stream)
            t4 = time.perf_counter_ns()
            while view.value == 0:
                pass
            t5 = time.perf_counter_ns()
            while not n.event_query(event):
                pass
            t6 = time.perf_counter_ns()
            if i >= 20:
                for key, value in (("trivial_call", t1 - t0), ("copy_call", t2 - t1), ("bell_call", t3 - t2),
                                   ("event_call", t4 - t3), ("to_bell_seen", t5 - t1), ("to_event_done", t6 - t1)):
                    steps[key].append(value)
    finally:
        n.stream_synchronize(stream)
        n.event_destroy(event)
        n.stream_destroy(stream)
        n.host_unregister(device, word.ctypes.data)
        n.device_free(device, src)
        n.device_free(device, dst)
    return {k: round(_median_us(v), 2) for k, v in steps.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--row-bytes", type=int, default=65536)
    ap.add_argument("--reps", type=int, default=2000)
    ap.add_argument("--idle-us", default="0,300", help="comma list: sleep this long before each repetition")
    args = ap.parse_args(argv)
    out = {}
    for idle in (int(x) for x in args.idle_us.split(",")):
        out[f"idle_{idle}us"] = measure(args.rows, args.row_bytes, args.reps, idle)
    print(json.dumps({"rows": args.rows, "row_bytes": args.row_bytes, "reps": args.reps, "median_us": out}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
