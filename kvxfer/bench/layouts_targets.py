"""The engine-layouts targets and headline ratios, judged on one run's figures.

Two targets, on device memory (the ``layouts`` preset's GPU point):

- the IPC transform (``layouts_ipc``) moves the request at >= 75% of the device copy of the
  same bytes (``layouts_copy``);
- the packed NIXL transform (``layouts_nixl_packed``) is >= 20x raw NIXL posting one
  descriptor per layer, K/V, block and rank (``layouts_nixl_per_piece``).

``targets.targets_for`` returns ``TARGETS`` for a result of the ``layouts`` preset, so the CLI's
target table judges them. ``ratios(result)`` gives every layouts
figure's ratio to the copy and to the per-piece baseline, host figures too; the report's
"vs copy" column reads ``local_copy`` only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvxfer.bench import targets
from kvxfer.bench.config import format_size
from kvxfer.bench.references import ratio, reference
from kvxfer.bench.results import BenchResult, Figure
from kvxfer.bench.targets import PerfTarget, TargetRow

COPY = "layouts_copy"
PER_PIECE = "layouts_nixl_per_piece"


def _device(case: str) -> Callable[[Figure], bool]:
    return lambda f: f.case == case and f.mode == "throughput" and f.key.get("memory") == "device"


def _judge(reference: str, floor: float, as_times: bool) -> Callable[[BenchResult, Figure], tuple[str, bool] | None]:
    def judge(result: BenchResult, f: Figure) -> tuple[str, bool] | None:
        r = ratio(result, f, reference)
        if r is None:
            return None
        text = f"{r:.1f}x {reference}" if as_times else f"{r:.1%} of {reference}"
        return text, r >= floor
    return judge


TARGETS = (
    PerfTarget("engine layouts on a GPU: IPC transform, TP1 layer-major NHD → TP2 block-major",
           "≥ 75% of the device copy",
           _device("layouts_ipc"), _judge(COPY, 0.75, as_times=False),
           "a CUDA device, the layouts_ipc case and IpcBackend.GEOMETRY"),
    PerfTarget("engine layouts on a GPU: packed NIXL transform, TP1 layer-major NHD → TP2 block-major",
           "≥ 20× per-piece NIXL", _device("layouts_nixl_packed"), _judge(PER_PIECE, 20.0, as_times=True),
           "a CUDA device with NIXL over device memory, layouts_nixl_packed and layouts_nixl_per_piece"),
)


def _shape(f: Figure) -> str:
    k = f.key
    parts = [str(k.get("memory"))]
    if "rows" in k:
        parts += [str(k.get("slots")), f"{k['rows']} blocks x {k.get('groups', 1)} layers"]
    return ", ".join([*parts, format_size(k["total_bytes"])])


def evaluate(result: BenchResult) -> list[TargetRow]:
    """The target rows of a ``layouts`` run (``targets.evaluate``, without its note on pull)."""
    return [row for row in targets.evaluate(result) if row is not targets.PULL_NOTE]


def _median_ratio(result: BenchResult, f: Figure, case: str) -> float | None:
    ref = reference(result, f, case) if f.case != case else None
    mine, theirs = f.get("gbps_median"), ref.get("gbps_median") if ref is not None else None
    return mine / theirs if mine and theirs else None


def ratios(result: BenchResult) -> list[dict[str, Any]]:
    """Every layouts throughput figure measured: GB/s, and its ratios (best to best, median to
    median) to the copy and to per-piece NIXL."""
    out = []
    for f in result.figures:
        if not (f.ok and f.mode == "throughput" and f.case.startswith("layouts_")):
            continue
        out.append({"case": f.case, "shape": _shape(f), "gbps_best": f.get("gbps_best"),
                    "gbps_median": f.get("gbps_median"), "vs_copy": ratio(result, f, COPY),
                    "vs_per_piece": ratio(result, f, PER_PIECE), "vs_copy_median": _median_ratio(result, f, COPY),
                    "vs_per_piece_median": _median_ratio(result, f, PER_PIECE)})
    return out


def markdown(result: BenchResult) -> str:
    """The ratios and the target rows as markdown tables."""
    def cell(best: float | None, median: float | None, times: bool) -> str:
        if best is None or median is None:
            return "-"
        return f"{best:.2f}x / {median:.2f}x" if times else f"{best:.1%} / {median:.1%}"

    lines = ["| case | shape | GB/s best | GB/s median | vs layouts_copy (best / median) | "
             "vs per-piece NIXL (best / median) |", "| --- | --- | --- | --- | --- | --- |"]
    for r in ratios(result):
        lines.append(f"| {r['case']} | {r['shape']} | {r['gbps_best']:.2f} | {r['gbps_median']:.2f} | "
                     f"{cell(r['vs_copy'], r['vs_copy_median'], False)} | "
                     f"{cell(r['vs_per_piece'], r['vs_per_piece_median'], True)} |")
    lines += ["", "| target | threshold | case | measured | status |", "| --- | --- | --- | --- | --- |"]
    lines += [f"| {t.target} | {t.threshold} | {t.case} | {t.measured} | {t.status} |" for t in evaluate(result)]
    return "\n".join(lines) + "\n"
