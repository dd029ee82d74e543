"""Run the paired-worker job on this machine, as ``kvxfer pair`` does, with a small workload.

It starts a prefill worker, a decode worker and the router as separate processes (CPU
pools, NIXL over host memory), sends 8 prompts of mixed lengths through the router, checks
every completion token for token against colocated generation, prints the report and
stops every process. Exit status 0 means every request matched.

    .venv/bin/python examples/pair_local.py [extra kvxfer pair flags, e.g. --on-failure recompute]
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

from kvxfer import pair


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="kvxfer-example-") as tmp:
        report_path = Path(tmp) / "report.json"
        code = pair.main(["--requests", "8", "--min-len", "4", "--max-len", "120", "--max-new-tokens", "16",
                          "--concurrency", "2", "--json", str(report_path), *sys.argv[1:]])
        if report_path.exists():
            report = json.loads(report_path.read_text())
            print(f"example: {report['matched']}/{report['requests']} completions token-identical; "
                  f"transfer p50 {report['transfer_s']['p50'] * 1e3:.2f} ms over {report['transfers']} transfers")
        return code


if __name__ == "__main__":
    sys.exit(main())
