"""PNG plots: GB/s against row size, one line per case, with the local-copy reference.

matplotlib is optional (``pip install matplotlib``): without it, ``plot`` says so and
writes nothing; the JSON and tables never depend on it.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

from kvxfer.bench.results import BenchResult

_DIRECTED = ("nixl_per_row", "peer_practice", "loopback", "nixl", "nixl_2p", "nixl_packed", "nixl_2p_packed", "ucx_2p",
             "ipc", "ipc_no_integrity", "ipc_busy_poll", "ipc_busy_poll_sockets")
MISSING = "matplotlib is not installed (pip install matplotlib): no plots written"


def available() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


# (memory, direction, slots, bytes per request) -> case -> {row_bytes (-1: one descriptor): GB/s}
Panels = dict[tuple[str, str, str, int], dict[str, dict[int, float]]]


def plot(result: BenchResult, out_dir: Path, stem: str) -> list[Path]:
    """One PNG per (memory, direction, slots) series set, over figures with one group."""
    if not available():
        raise RuntimeError(MISSING)
    import matplotlib

    matplotlib.use("Agg")  # files only, never a window
    import matplotlib.pyplot as plt

    panels, refs = _series(result)
    written = []
    out_dir.mkdir(parents=True, exist_ok=True)
    for (memory, direction, slots, total), cases in sorted(panels.items()):
        if not _has_curve(cases):
            continue  # a single row size is no curve; a panel needs a transfer on it
        fig, ax = plt.subplots(figsize=(7, 4.5))
        _draw(ax, cases, refs.get((memory, total)),
              title=f"{direction}, {memory} memory, {slots} slots, {_size(total)} per request")
        path = out_dir / f"{stem}-{memory}-{direction}-{slots}-{_size(total).replace(' ', '')}.png"
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def _series(result: BenchResult) -> tuple[Panels, dict[tuple[str, int], float]]:
    """Per panel, each case's GB/s by row size (only a row-size sweep at one request size);
    and the local-copy reference by (memory, bytes per request)."""
    panels: Panels = defaultdict(lambda: defaultdict(dict))
    refs: dict[tuple[str, int], float] = {}
    for f in result.figures:
        if f.mode != "throughput" or not f.ok:
            continue
        gbps = f.get("gbps_best")
        assert gbps is not None
        k = f.key
        if f.case == "local_copy":
            refs[(k["memory"], k["total_bytes"])] = gbps
        elif k.get("groups", 1) == 1:
            row = k.get("row_bytes")
            for d, s in _panels_of(k):
                panels[(k["memory"], d, s, k["total_bytes"])][f.case][row if row is not None else -1] = gbps
    return panels, refs


def _panels_of(key: dict[str, Any]) -> list[tuple[str, str]]:
    """A case keyed without a field (local_rows: no direction; one descriptor: no slots or
    row size) belongs on every panel of the others; one descriptor is a flat line."""
    directions = (key["direction"],) if "direction" in key else ("push", "pull")
    slots = (key["slots"],) if "slots" in key else ("contiguous", "scattered")
    return [(d, s) for d in directions for s in slots]


def _has_curve(cases: dict[str, dict[int, float]]) -> bool:
    return any(c in _DIRECTED and sum(r > 0 for r in series) >= 2 for c, series in cases.items())


def _draw(ax: Any, cases: dict[str, dict[int, float]], reference: float | None, title: str) -> None:
    rows = sorted({r for series in cases.values() for r in series if r > 0})
    for case, series in sorted(cases.items()):
        if -1 in series:
            ax.plot(rows, [series[-1]] * len(rows), linestyle=":", label=f"{case} (one descriptor)")
        else:
            xs = [r for r in rows if r in series]
            ax.plot(xs, [series[r] for r in xs], marker="o", label=case)
    if reference is not None:
        ax.axhline(reference, color="black", linestyle="--", label="local copy (reference)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(rows, [_size(r) for r in rows])
    ax.set_xlabel("row size")
    ax.set_ylabel("GB/s (best)")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)


def _size(n: int) -> str:
    from kvxfer.bench.config import format_size

    return format_size(n)
