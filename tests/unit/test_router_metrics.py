"""Prometheus text exposition of the worker and router metrics."""

from __future__ import annotations

from kvxfer.router.metrics import Registry


def test_counters_gauges_and_cumulative_histograms_render_in_prometheus_text() -> None:
    r = Registry()
    c = r.counter("kvxfer_x_total", "Things.")
    g = r.gauge("kvxfer_open", "Open.")
    h = r.histogram("kvxfer_lat_seconds", "Latency.", buckets=(0.01, 0.1))
    c.inc(status="ok")
    c.inc(2, status="failed")
    g.set(3)
    for value in (0.005, 0.05, 0.05, 7.0):
        h.observe(value, role="decode")
    lines = r.render().splitlines()
    assert "# TYPE kvxfer_x_total counter" in lines and "# HELP kvxfer_open Open." in lines
    assert 'kvxfer_x_total{status="failed"} 2' in lines and 'kvxfer_x_total{status="ok"} 1' in lines
    assert "kvxfer_open 3" in lines
    assert 'kvxfer_lat_seconds_bucket{role="decode",le="0.01"} 1' in lines
    assert 'kvxfer_lat_seconds_bucket{role="decode",le="0.1"} 3' in lines  # cumulative
    assert 'kvxfer_lat_seconds_bucket{role="decode",le="+Inf"} 4' in lines
    assert 'kvxfer_lat_seconds_count{role="decode"} 4' in lines
    assert 'kvxfer_lat_seconds_sum{role="decode"} 7.105' in lines
    assert h.count(role="decode") == 4 and c.get(status="ok") == 1
