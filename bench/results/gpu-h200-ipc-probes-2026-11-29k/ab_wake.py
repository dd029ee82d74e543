"""A/B in one process: the IPC progress thread woken right after a large copy is queued
(EARLY_WAKE_BYTES = 8 MiB, the default) or only once publish() has done its bookkeeping
(EARLY_WAKE_BYTES = 2**62: the code before the change). Runs `kvxfer bench` alternately.
    python3 ab_wake.py OUTDIR ROUNDS SIZE[,SIZE]"""
import sys

import kvxfer.backends.ipc as ipc
from kvxfer.cli import main

if __name__ == "__main__":  # the bench's decode end is a spawned child: it imports this file
    out, rounds, sizes = sys.argv[1], int(sys.argv[2]), sys.argv[3].split(",")
    for size in sizes:
        for r in range(rounds):
            for variant, value in (("late", 1 << 62), ("early", 8 << 20)) if r % 2 == 0 else (("early", 8 << 20), ("late", 1 << 62)):
                ipc.EARLY_WAKE_BYTES = value
                rc = main(["bench", "--preset", "gpu", "--cases", "local_copy,ipc", "--row-sizes", "4K,16K,64K",
                           "--request-bytes", size, "--memory", "device", "--slots", "scattered", "--directions", "push",
                           "--no-latency", "--no-overhead", "--no-progress",
                           "--json", f"{out}/ab-{size}-{r}-{variant}.json"])
                print(f"== {size} round {r} {variant}: rc={rc}", flush=True)
