"""The router's and the workers' Prometheus metrics, on ``prometheus_client``.

Each router and each worker has its own ``Registry``: a ``prometheus_client.CollectorRegistry``
(never the process-wide default, so that two routers or workers in one process keep their
counts apart). An embedder merges it into their own registry, or serves it as it is::

    from prometheus_client import REGISTRY, generate_latest
    REGISTRY.register(router.metrics)          # a registry is a collector of all it holds
    generate_latest(router.metrics)            # or this one alone (what /metrics answers)

Counters and histograms are prometheus_client's, behind a thin adapter that takes the label
values as keywords (``requests.inc(path="local", result="ok")``). Gauges are read when
scraped: from a function (``read``), or from the last values ``set`` (a worker sets its
gauges from the engine thread before it renders: ``Worker.refresh_metrics``). A counter kept
elsewhere (by a backend's thread) is read when scraped too (``read_counter``).

The names and labels are the API (README, dashboards, tests). Counters render with their
``_total`` name, a ``_created`` series beside them (prometheus_client's), and values as
floats (``3.0``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import prometheus_client
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4

LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4
"""The text format ``render()`` writes, as a /metrics answer's Content-Type."""
LabelValues = tuple[str, ...]


class Counter:
    """A prometheus_client Counter, its label values given as keywords."""

    def __init__(self, metric: prometheus_client.Counter) -> None:
        self.metric = metric

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        (self.metric.labels(**labels) if labels else self.metric).inc(amount)


class Histogram:
    """A prometheus_client Histogram, its label values given as keywords."""

    def __init__(self, metric: prometheus_client.Histogram) -> None:
        self.metric = metric

    def observe(self, value: float, **labels: str) -> None:
        (self.metric.labels(**labels) if labels else self.metric).observe(value)


class Gauge:
    """A gauge read when scraped (a prometheus_client custom collector): ``read()``'s values
    ({label values in ``labels`` order: value}), or else those last ``set``. No series until
    it has a value."""

    def __init__(self, name: str, help_text: str, labels: Sequence[str] = (),
                 read: Callable[[], dict[LabelValues, float]] | None = None) -> None:
        self.name, self.help, self.labels = name, help_text, tuple(labels)
        self.read = read
        self.values: dict[LabelValues, float] = {}

    def set(self, value: float, **labels: str) -> None:
        if set(labels) != set(self.labels):
            raise ValueError(f"{self.name}: labels {sorted(labels)}, not {sorted(self.labels)}")
        self.values[tuple(str(labels[k]) for k in self.labels)] = float(value)

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily(self.name, self.help, labels=self.labels)
        values = self.read() if self.read is not None else dict(self.values)  # a copy: a scrape may run on another thread
        for key, value in sorted(values.items()):
            family.add_metric(list(key), value)
        yield family


class ReadCounter:
    """A counter read when scraped (a prometheus_client custom collector): ``read()``'s running
    totals ({label values in ``labels`` order: value}), kept and only ever raised elsewhere.
    Rendered as ``<name>_total``."""

    def __init__(self, name: str, help_text: str, labels: Sequence[str],
                 read: Callable[[], dict[LabelValues, float]]) -> None:
        self.name, self.help, self.labels, self.read = name, help_text, tuple(labels), read

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(self.name, self.help, labels=self.labels)
        for key, value in sorted(self.read().items()):
            family.add_metric(list(key), value)
        yield family


class Registry(prometheus_client.CollectorRegistry):
    """One router's or worker's metrics; ``render()`` and ``snapshot()`` for its own use."""

    def counter(self, name: str, help_text: str, labels: Iterable[str] = ()) -> Counter:
        return Counter(prometheus_client.Counter(name, help_text, sorted(labels), registry=self))

    def histogram(self, name: str, help_text: str, labels: Iterable[str] = (),
                  buckets: Sequence[float] = LATENCY_BUCKETS) -> Histogram:
        return Histogram(prometheus_client.Histogram(name, help_text, sorted(labels), buckets=buckets, registry=self))

    def gauge(self, name: str, help_text: str, labels: Iterable[str] = (),
              read: Callable[[], dict[LabelValues, float]] | None = None) -> Gauge:
        # Registered without a describe(): so a gauge may share its name with a counter's
        # (kvxfer_quarantined_slots beside kvxfer_quarantined_slots_total), which
        # prometheus_client's name check would refuse.
        gauge = Gauge(name, help_text, sorted(labels), read)
        self.register(gauge)  # type: ignore[arg-type]
        return gauge

    def read_counter(self, name: str, help_text: str, labels: Iterable[str],
                     read: Callable[[], dict[LabelValues, float]]) -> ReadCounter:
        """``name`` without ``_total`` (the rendered name adds it)."""
        counter = ReadCounter(name, help_text, sorted(labels), read)
        self.register(counter)  # type: ignore[arg-type]
        return counter

    def render(self) -> str:
        """The Prometheus text format (``CONTENT_TYPE``)."""
        return prometheus_client.generate_latest(self).decode()

    def snapshot(self) -> dict[str, float]:
        """Every sample as ``{"name{labels}": value}``, as rendered, without the ``_created``
        series (for JSON reports)."""
        out: dict[str, float] = {}
        for family in self.collect():
            for sample in family.samples:
                if family.type in ("counter", "histogram") and sample.name.endswith("_created"):
                    continue
                out[sample.name + _labels(sample.labels)] = float(sample.value)
        return out


def _labels(labels: dict[str, Any]) -> str:
    if not labels:
        return ""
    escaped = (str(v).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"') for v in labels.values())
    return "{" + ",".join(f'{k}="{v}"' for k, v in sorted(zip(labels, escaped))) + "}"
