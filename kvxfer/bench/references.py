"""Ratios of a figure to its references measured in the same run.

A reference figure matches when every field of its key equals the same field of the
figure's key: ``local_copy`` is keyed by (memory, total bytes), so every figure moving the
same bytes over the same memory shares it; ``nixl_one_desc`` adds the direction.
"""

from __future__ import annotations

from kvxfer.bench.results import BenchResult, Figure

REFERENCES = ("local_copy", "nixl_one_desc")


def reference(result: BenchResult, figure: Figure, case: str) -> Figure | None:
    for f in result.figures:
        if f.case == case and f.mode == figure.mode and f.ok and all(
            figure.key.get(k) == v for k, v in f.key.items()
        ):
            return f
    return None


def ratio(result: BenchResult, figure: Figure, case: str) -> float | None:
    """Throughput of ``figure`` over that of its ``case`` reference (1.0 = as fast)."""
    if figure.mode != "throughput" or not figure.ok or figure.case == case:
        return None
    ref = reference(result, figure, case)
    if ref is None:
        return None
    mine, theirs = figure.get("gbps_best"), ref.get("gbps_best")
    return None if mine is None or not theirs else mine / theirs
