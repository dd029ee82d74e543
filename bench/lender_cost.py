"""Lend + view + release cost per lease, for 1k- and 100k-row requests (a script, not a test).

Target (issue 3): at most 20 us + 0.2 us per row on the CPU machine. Run:
    .venv/bin/python bench/lender_cost.py [--reps N] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable

import torch

from kvxfer.lender import InPlaceLender, Lender, StagingLender
from kvxfer.pool import LayerGroupSpec, PagedKVPool

BT = 16
SPEC = LayerGroupSpec("full", layers=1, block_tokens=BT, kv_heads=1, head_dim=8, dtype=torch.float16)  # 512 B rows


def target_us(rows: int) -> float:
    return 20.0 + 0.2 * rows


def time_once(fn: Callable[[], None], reps: int) -> list[float]:
    fn()  # warm up
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e6)
    return out


def case(kind: str, rows: int, reps: int) -> dict[str, object]:
    pool = PagedKVPool([SPEC], rows + 4)
    lender: Lender
    if kind == "staging write":
        lender = StagingLender(pool, rows * BT, 1, 1 << 40)
    else:
        lender = InPlaceLender(pool)
    tokens = (0, rows * BT)
    pool.allocate("r", rows * BT)
    if kind == "in-place read":
        pool.commit("r", rows * BT)

    def once() -> None:
        lease = lender.lend_read("r", tokens) if kind == "in-place read" else lender.lend_write("r", tokens)
        view = lease.view()
        assert view is not None and view.rows == rows
        lease.release()

    samples = time_once(once, reps)
    best, median = min(samples), statistics.median(samples)
    return {"case": kind, "rows": rows, "best_us": round(best, 1), "median_us": round(median, 1),
            "target_us": target_us(rows), "meets_target": median <= target_us(rows)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--reps", type=int, default=200)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    results = []
    for kind in ("in-place read", "in-place write", "staging write"):
        for rows in (1_000, 100_000):
            r = case(kind, rows, args.reps if rows <= 1000 else max(10, args.reps // 10))
            results.append(r)
            print(f"{kind:15s} {rows:>7d} rows: best {r['best_us']:>9.1f} us  median {r['median_us']:>9.1f} us  "
                  f"target {r['target_us']:>8.1f} us  {'ok' if r['meets_target'] else 'MISSED'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": platform.node(), "processor": platform.processor(), "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
