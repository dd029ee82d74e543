"""kvxfer.native.copy_rows with host index arrays, in one process on one GPU: the call's own
time (queueing: index staging and launches) and call -> stream drained, against torch's D2D
copy of the same bytes. Run once per KVXFER_INDEX_STAGING mode (the native module reads it once).

    KVXFER_INDEX_STAGING=mapped python3 probe.py --out mapped.json
"""
import argparse
import json
import os
import time

import numpy as np
import torch

from kvxfer import native
from kvxfer.contract import MemoryKind


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--reps", type=int, default=30)
    a = ap.parse_args()
    stream = torch.cuda.Stream()
    out = {"mode": os.environ.get("KVXFER_INDEX_STAGING", "upload"), "gpu": torch.cuda.get_device_name(), "cases": []}
    for total in (256 << 20, 1 << 30):
        src = torch.empty(2 * total, dtype=torch.uint8, device="cuda")
        dst = torch.empty(2 * total, dtype=torch.uint8, device="cuda")
        ref = []
        for _ in range(a.reps):
            t = time.perf_counter()
            with torch.cuda.stream(stream):
                dst[:total].copy_(src[:total])
            stream.synchronize()
            ref.append(time.perf_counter() - t)
        for row in (4096, 16384, 65536):
            n = total // row
            r = np.random.default_rng(1)
            s_ix = r.permutation(2 * n)[:n].astype(np.int64)
            d_ix = r.permutation(2 * n)[:n].astype(np.int64)
            call, whole = [], []
            for _ in range(a.reps + 3):
                t = time.perf_counter()
                native.copy_rows(src_base=src.data_ptr(), src_stride=row, src_slots=s_ix, dst_base=dst.data_ptr(),
                                 dst_stride=row, dst_slots=d_ix, row_bytes=row, n_rows=n, memory=MemoryKind.DEVICE,
                                 stream=stream.cuda_stream, impl="native")
                t1 = time.perf_counter()
                stream.synchronize()
                t2 = time.perf_counter()
                call.append(t1 - t)
                whole.append(t2 - t)
            call, whole = call[3:], whole[3:]
            case = {"bytes": total, "row_bytes": row, "rows": n,
                    "call_us_p50": 1e6 * float(np.median(call)),
                    "whole_us_p50": 1e6 * float(np.median(whole)), "whole_us_min": 1e6 * min(whole),
                    "d2d_us_min": 1e6 * min(ref),
                    "pct_of_d2d_best": 100 * min(ref) / min(whole)}
            out["cases"].append(case)
            print(out["mode"], case, flush=True)
        del src, dst
        torch.cuda.empty_cache()
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
