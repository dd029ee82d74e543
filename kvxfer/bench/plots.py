"""PNG plots: GB/s against row size, one line per case, with the local-copy reference.

matplotlib is optional (``pip install matplotlib``): without it, ``plot`` says so and
writes nothing; the JSON and tables never depend on it.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from kvxfer.bench.results import BenchResult

_DIRECTED = ("nixl_per_row", "peer_practice", "loopback", "nixl", "nixl_2p", "nixl_packed", "nixl_2p_packed", "ipc", "ipc_busy_poll", "ipc_busy_poll_sockets")
MISSING = "matplotlib is not installed (pip install matplotlib): no plots written"


def available() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def plot(result: BenchResult, out_dir: Path, stem: str) -> list[Path]:
    """One PNG per (memory, direction, slots) series set, over figures with one group."""
    if not available():
        raise RuntimeError(MISSING)
    import matplotlib

    matplotlib.use("Agg")  # files only, never a window
    import matplotlib.pyplot as plt

    # Per panel: case -> {row_bytes: GB/s}, kept only for a row-size sweep at one request size.
    panels: dict[tuple[str, str, str, int], dict[str, dict[int, float]]] = defaultdict(lambda: defaultdict(dict))
    refs: dict[tuple[str, int], float] = {}
    for f in result.figures:
        if f.mode != "throughput" or not f.ok:
            continue
        gbps = f.get("gbps_best")
        assert gbps is not None
        k = f.key
        if f.case == "local_copy":
            refs[(k["memory"], k["total_bytes"])] = gbps
            continue
        if k.get("groups", 1) != 1:
            continue
        # A case keyed without a field (local_rows: no direction; one descriptor: no slots or
        # row size) belongs on every panel of the others; one descriptor is a flat line.
        for d in ((k["direction"],) if "direction" in k else ("push", "pull")):
            for s in ((k["slots"],) if "slots" in k else ("contiguous", "scattered")):
                row = k.get("row_bytes")
                panels[(k["memory"], d, s, k["total_bytes"])][f.case][row if row is not None else -1] = gbps
    written = []
    out_dir.mkdir(parents=True, exist_ok=True)
    for (memory, direction, slots, total), cases in sorted(panels.items()):
        rows = sorted({r for series in cases.values() for r in series if r > 0})
        if not any(c in _DIRECTED and sum(r > 0 for r in series) >= 2 for c, series in cases.items()):
            continue  # a single row size is no curve; a panel needs a transfer on it
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for case, series in sorted(cases.items()):
            if -1 in series:
                ax.plot(rows, [series[-1]] * len(rows), linestyle=":", label=f"{case} (one descriptor)")
            else:
                xs = [r for r in rows if r in series]
                ax.plot(xs, [series[r] for r in xs], marker="o", label=case)
        if (memory, total) in refs:
            ax.axhline(refs[(memory, total)], color="black", linestyle="--", label="local copy (reference)")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(rows, [_size(r) for r in rows])
        ax.set_xlabel("row size")
        ax.set_ylabel("GB/s (best)")
        ax.set_title(f"{direction}, {memory} memory, {slots} slots, {_size(total)} per request")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
        path = out_dir / f"{stem}-{memory}-{direction}-{slots}-{_size(total).replace(' ', '')}.png"
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def _size(n: int) -> str:
    from kvxfer.bench.config import format_size

    return format_size(n)
