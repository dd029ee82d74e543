"""A tiny transfer microbenchmark through kvxfer.bench's public API.

Moves 64 KiB rows through the loopback backend, beside the local-copy reference measured
in the same run, and prints the table with ratios and the target rows of docs/performance.md. The full
command is ``kvxfer bench`` (``--preset cpu``, ``--preset gpu``, ``--compare OLD NEW``).

    python examples/microbench.py [--json out.json]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvxfer.bench import (
    BenchConfig,
    LatencySweep,
    OverheadSweep,
    Repetition,
    ThroughputSweep,
    evaluate,
    render_text,
    run,
)
from kvxfer.bench.progress import Progress
from kvxfer.bench.results import write


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path, help="also write the versioned JSON result here")
    args = parser.parse_args()

    config = BenchConfig(
        name="microbench-example",
        cases=("local_copy", "local_rows", "loopback"),
        throughput=(ThroughputSweep(row_bytes=(4 << 10, 64 << 10, 1 << 20), request_bytes=8 << 20,
                                    slots=("contiguous", "scattered")),),
        latency=LatencySweep(rows=(32,), row_bytes=64 << 10, samples=50, warmup=5),
        overhead=OverheadSweep(rows=(10_000,), slots=("scattered",), repeats=3),
        repetition=Repetition(warmup=1, reps=5, budget_s=0.5),
    )
    result = run(config, Progress(0))
    targets = evaluate(result)
    print(render_text(result, targets), end="")
    if args.json:
        write(result, args.json, [t.to_json() for t in targets])
    return 1 if any(f.status == "error" for f in result.figures) else 0


if __name__ == "__main__":
    sys.exit(main())
