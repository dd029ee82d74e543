"""Compare two results figure by figure and flag regressions beyond a threshold.

Throughput regresses when GB/s (best) falls; latency when p50 or p99 rises; host overhead
when ns per row (median) rises. A figure that was measured before and is now missing,
skipped or failed is flagged too: a regression can hide as a silent skip.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvxfer.bench.references import ratio
from kvxfer.bench.results import BenchResult, Figure

# mode -> (metric, higher is better)
METRICS: dict[str, tuple[tuple[str, bool], ...]] = {
    "throughput": (("gbps_best", True),),
    "latency": (("p50_s", False), ("p99_s", False)),
    "overhead": (("per_row_s_median", False),),
}


@dataclass(frozen=True)
class Change:
    figure: str
    metric: str
    old: float | None
    new: float | None
    change: float | None   # relative, signed so that negative is worse
    verdict: str           # regression | improvement | same | lost | incomparable | new


def _value(result: BenchResult, f: Figure, metric: str, relative: bool) -> float | None:
    """The metric, or with ``relative`` a throughput's ratio to its own run's local copy."""
    if relative and metric == "gbps_best":
        return ratio(result, f, "local_copy")
    return f.get(metric)


def compare(old: BenchResult, new: BenchResult, threshold: float = 0.10, relative: bool = False) -> list[Change]:
    """``relative``: compare throughput as a fraction of each run's own local copy, which
    cancels a machine that is busier or slower as a whole (shared CI hosts)."""
    _check_comparable(old, new, threshold)
    out: list[Change] = []
    new_by_id = {f.id: f for f in new.figures}
    for f in old.figures:
        if f.ok:
            out.extend(_figure_changes(_BeforeAfter(old, new, f, new_by_id.get(f.id)), threshold, relative))
    out.extend(_new_figures(old, new))
    return out


def _check_comparable(old: BenchResult, new: BenchResult, threshold: float) -> None:
    if threshold < 0:
        raise ValueError(f"threshold must be >= 0, got {threshold}")
    placed = [tuple(r.config.get("devices") or (0, 0)) for r in (old, new)]
    if placed[0] != placed[1]:
        # Same figure names, other physics: a same-GPU local_copy is D2D, a cross-GPU one the peer copy.
        raise ValueError(f"the runs placed their ends on different GPUs (devices {placed[0]} and {placed[1]}): "
                         "their figures do not compare")


@dataclass(frozen=True)
class _BeforeAfter:
    """One figure of the old run (measured) and the same figure in the new run, if any."""

    old: BenchResult
    new: BenchResult
    before: Figure
    after: Figure | None


def _figure_changes(compared: _BeforeAfter, threshold: float, relative: bool) -> list[Change]:
    f = compared.before
    out = []
    for metric, higher in METRICS[f.mode]:
        if relative and metric == "gbps_best" and f.case == "local_copy":
            continue  # the reference itself: the ratios below divide by it, on both sides
        out.append(_metric_change(compared, metric, higher, threshold, relative))
    return out


def _metric_change(compared: _BeforeAfter, metric: str, higher: bool, threshold: float, relative: bool) -> Change:
    f, g = compared.before, compared.after
    before = _value(compared.old, f, metric, relative)
    name = "vs copy" if relative and metric == "gbps_best" else metric
    if before is None:
        # Not comparable as asked (no reference in the old run): said, never skipped
        # silently, so "no regression" cannot come from comparing nothing.
        return Change(f.id, f"{name} (no reference in the old run)", None, None, None, "incomparable")
    if g is None or not g.ok:
        why = "missing" if g is None else f"{g.status}: {g.reason}"
        return Change(f.id, f"{name} ({why})", before, None, None, "lost")
    after = _value(compared.new, g, metric, relative)
    if after is None:
        return Change(f.id, f"{name} (no reference in the new run)", before, None, None, "lost")
    rel = _relative(before, after, higher)
    verdict = "regression" if rel < -threshold else "improvement" if rel > threshold else "same"
    return Change(f.id, name, before, after, rel, verdict)


def _new_figures(old: BenchResult, new: BenchResult) -> list[Change]:
    """Figures measured now that the old run lacked or did not measure."""
    old_ids = {f.id for f in old.figures}
    old_ok = {f.id for f in old.figures if f.ok}
    out = []
    for g in new.figures:
        if g.ok and g.id not in old_ids:
            out.append(Change(g.id, "-", None, None, None, "new"))
        elif g.ok and g.id not in old_ok:
            out.append(Change(g.id, "- (failed or skipped in the old run)", None, None, None, "new"))
    return out


def _relative(before: float, after: float, higher: bool) -> float:
    """Signed relative change where negative is worse: -0.2 = 20% worse."""
    if before <= 0:
        return 0.0
    return (after - before) / before if higher else (before - after) / before


def regressions(changes: list[Change]) -> list[Change]:
    return [c for c in changes if c.verdict in ("regression", "lost", "incomparable")]


def _figure_value(metric: str, value: float | None) -> str:
    if value is None:
        return "-"
    if metric.startswith("per_row"):
        return f"{value * 1e9:.0f} ns"  # host overhead per row: tens of ns, not µs
    if metric.endswith("_s"):
        return f"{value * 1e6:.1f} µs"
    return f"{value:.2f}"


def render(changes: list[Change], threshold: float, show_all: bool = False) -> str:
    from kvxfer.bench.report import text_table

    shown = [c for c in changes if show_all or c.verdict != "same"]
    rows = [[c.verdict.upper() if c.verdict in ("regression", "lost", "incomparable") else c.verdict, c.figure, c.metric,
             _figure_value(c.metric, c.old), _figure_value(c.metric, c.new),
             "-" if c.change is None else f"{c.change:+.1%}"] for c in shown]
    bad = regressions(changes)
    summary = (f"{len(bad)} regression(s) beyond {threshold:.0%}" if bad
               else f"no regression beyond {threshold:.0%} over {len(changes)} comparisons")
    if not rows:
        return summary + "\n"
    return text_table(["verdict", "figure", "metric", "old", "new", "change"], rows) + "\n" + summary + "\n"


