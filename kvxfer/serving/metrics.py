"""Prometheus text-format metrics: counters, gauges and histograms with labels.

Single-threaded by design (the worker and router update them from their event loop), so
no locks. ``render()`` writes the text exposition format, version 0.0.4.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from typing import TypeVar

LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
Labels = tuple[tuple[str, str], ...]


def _escape(value: str) -> str:
    """A label value as the text format wants it (a quote or newline would break the line)."""
    return str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _num(value: float) -> str:
    """A sample value, exact: ``%g`` kept 6 digits, so 1234567 bytes rendered as 1.23457e+06."""
    value = float(value)
    if value != value:
        return "NaN"
    if value in (float("inf"), float("-inf")):
        return "+Inf" if value > 0 else "-Inf"
    if value.is_integer() and abs(value) < 2**53:
        return str(int(value))
    return f"{value:.15g}"  # 15 digits: no float noise (7.105, not 7.1050000000000004)


def _labels(labels: Labels, extra: str = "") -> str:
    parts = [f'{k}="{_escape(v)}"' for k, v in labels]
    if extra:
        parts.append(extra)
    return "{" + ",".join(parts) + "}" if parts else ""


class _Metric:
    kind = "untyped"

    def __init__(self, name: str, help_text: str) -> None:
        self.name, self.help = name, help_text

    def header(self) -> list[str]:
        return [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} {self.kind}"]


class Counter(_Metric):
    kind = "counter"

    def __init__(self, name: str, help_text: str) -> None:
        super().__init__(name, help_text)
        self.values: dict[Labels, float] = {}

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        key = tuple(sorted(labels.items()))
        self.values[key] = self.values.get(key, 0.0) + amount

    def get(self, **labels: str) -> float:
        return self.values.get(tuple(sorted(labels.items())), 0.0)

    def lines(self) -> list[str]:
        return [f"{self.name}{_labels(k)} {_num(v)}" for k, v in sorted(self.values.items())]


class Gauge(_Metric):
    """A value read when rendered (``fn``) or set."""

    kind = "gauge"

    def __init__(self, name: str, help_text: str, fn: Callable[[], dict[Labels, float]] | None = None) -> None:
        super().__init__(name, help_text)
        self.fn = fn
        self.values: dict[Labels, float] = {}

    def set(self, value: float, **labels: str) -> None:
        self.values[tuple(sorted(labels.items()))] = value

    def lines(self) -> list[str]:
        values = self.fn() if self.fn is not None else self.values
        return [f"{self.name}{_labels(k)} {_num(v)}" for k, v in sorted(values.items())]


class Histogram(_Metric):
    kind = "histogram"

    def __init__(self, name: str, help_text: str, buckets: Sequence[float] = LATENCY_BUCKETS) -> None:
        super().__init__(name, help_text)
        self.buckets = tuple(buckets)
        self.series: dict[Labels, tuple[list[int], list[float]]] = {}  # counts per bucket (+Inf), [sum, count]

    def observe(self, value: float, **labels: str) -> None:
        key = tuple(sorted(labels.items()))
        counts, total = self.series.setdefault(key, ([0] * (len(self.buckets) + 1), [0.0, 0.0]))
        counts[bisect.bisect_left(self.buckets, value)] += 1
        total[0] += value
        total[1] += 1

    def count(self, **labels: str) -> int:
        series = self.series.get(tuple(sorted(labels.items())))
        return int(series[1][1]) if series else 0

    def lines(self) -> list[str]:
        out = []
        for key, (counts, total) in sorted(self.series.items()):
            running = 0
            for bound, c in zip((*self.buckets, float("inf")), counts):
                running += c
                le = "+Inf" if bound == float("inf") else f"{bound:g}"
                tag = 'le="' + le + '"'
                out.append(f"{self.name}_bucket{_labels(key, tag)} {running}")
            out.append(f"{self.name}_sum{_labels(key)} {_num(total[0])}")
            out.append(f"{self.name}_count{_labels(key)} {int(total[1])}")
        return out


_M = TypeVar("_M", bound=_Metric)


class Registry:
    def __init__(self) -> None:
        self.metrics: list[_Metric] = []

    def counter(self, name: str, help_text: str) -> Counter:
        return self._add(Counter(name, help_text))

    def gauge(self, name: str, help_text: str, fn: Callable[[], dict[Labels, float]] | None = None) -> Gauge:
        return self._add(Gauge(name, help_text, fn))

    def histogram(self, name: str, help_text: str, buckets: Sequence[float] = LATENCY_BUCKETS) -> Histogram:
        return self._add(Histogram(name, help_text, buckets))

    def _add(self, metric: _M) -> _M:
        self.metrics.append(metric)
        return metric

    def snapshot(self) -> dict[str, float]:
        """Every sample line as ``{"name{labels}": value}`` (for JSON reports)."""
        out: dict[str, float] = {}
        for metric in self.metrics:
            for line in metric.lines():  # type: ignore[attr-defined]
                key, _, value = line.rpartition(" ")
                out[key] = float(value)
        return out

    def render(self) -> str:
        lines: list[str] = []
        for metric in self.metrics:
            lines.extend(metric.header())
            lines.extend(metric.lines())  # type: ignore[attr-defined]
        return "\n".join(lines) + "\n"

