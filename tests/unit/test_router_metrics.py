"""Prometheus text exposition of the worker and router metrics."""

from __future__ import annotations

from kvxfer.serving.metrics import Registry


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


def test_values_are_exact_and_label_values_escaped() -> None:
    """``%g`` rendered 1234567 bytes as 1.23457e+06; a quote in a label value broke the line."""
    r = Registry()
    c = r.counter("kvxfer_bytes_total", "Bytes.")
    c.inc(1234567)
    c.inc(2**40, path='a"b\\c\nd')
    lines = r.render().splitlines()
    assert "kvxfer_bytes_total 1234567" in lines
    assert 'kvxfer_bytes_total{path="a\\"b\\\\c\\nd"} 1099511627776' in lines
    assert r.snapshot()["kvxfer_bytes_total"] == 1234567.0


def test_worker_request_metric_labels_only_known_endpoints() -> None:
    import asyncio

    from test_router import cluster  # noqa: I001 - pytest puts tests/unit on sys.path

    from kvxfer.serving.http import HttpError, request_json, request_text

    async def main() -> str:
        async with cluster(1, 0) as c:
            p = c.prefill[0]
            for path in ('/x"y', "/nope1", "/nope2"):
                try:
                    await request_json(p, "POST", path, {})
                except HttpError:
                    pass
            return await request_text(p, "/metrics")

    text = asyncio.run(main())
    lines = [line for line in text.splitlines() if line.startswith("kvxfer_worker_requests_total{")]
    assert lines == ['kvxfer_worker_requests_total{endpoint="other",result="not_found"} 3'], lines
