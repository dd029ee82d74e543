"""The worker's and the router's metrics: prometheus_client's text format, each in a registry of
its own that an embedder can merge into theirs, and never in the process-wide default one."""

from __future__ import annotations

import asyncio

import prometheus_client
from prometheus_client import CollectorRegistry, generate_latest

from kvxfer.router import Router
from kvxfer.serving.metrics import Registry
from kvxfer.worker.meters import Meters


def test_counters_gauges_and_cumulative_histograms_render_in_prometheus_text() -> None:
    r = Registry()
    c = r.counter("kvxfer_x_total", "Things.", ("status",))
    g = r.gauge("kvxfer_open", "Open.")
    h = r.histogram("kvxfer_lat_seconds", "Latency.", ("role",), buckets=(0.01, 0.1))
    c.inc(status="ok")
    c.inc(2, status="failed")
    g.set(3)
    for value in (0.005, 0.05, 0.05, 7.0):
        h.observe(value, role="decode")
    lines = r.render().splitlines()
    assert "# TYPE kvxfer_x_total counter" in lines and "# HELP kvxfer_open Open." in lines
    assert "# TYPE kvxfer_open gauge" in lines and "# TYPE kvxfer_lat_seconds histogram" in lines
    assert 'kvxfer_x_total{status="failed"} 2.0' in lines and 'kvxfer_x_total{status="ok"} 1.0' in lines
    assert "kvxfer_open 3.0" in lines
    assert 'kvxfer_lat_seconds_bucket{le="0.01",role="decode"} 1.0' in lines
    assert 'kvxfer_lat_seconds_bucket{le="0.1",role="decode"} 3.0' in lines  # cumulative
    assert 'kvxfer_lat_seconds_bucket{le="+Inf",role="decode"} 4.0' in lines
    assert 'kvxfer_lat_seconds_count{role="decode"} 4.0' in lines
    assert 'kvxfer_lat_seconds_sum{role="decode"} 7.105' in lines
    assert r.get_sample_value("kvxfer_x_total", {"status": "ok"}) == 1.0
    assert r.get_sample_value("kvxfer_lat_seconds_count", {"role": "decode"}) == 4.0


def test_values_are_exact_label_values_escaped_and_the_snapshot_leaves_out_created() -> None:
    r = Registry()
    c = r.counter("kvxfer_bytes_total", "Bytes.", ("path",))
    c.inc(1234567, path="plain")
    c.inc(2**40, path='a"b\\c\nd')
    lines = r.render().splitlines()
    assert 'kvxfer_bytes_total{path="plain"} 1.234567e+06' in lines  # exact, in Go's float format
    assert 'kvxfer_bytes_total{path="a\\"b\\\\c\\nd"} 1.099511627776e+12' in lines
    snapshot = r.snapshot()
    assert snapshot == {'kvxfer_bytes_total{path="plain"}': 1234567.0,
                        'kvxfer_bytes_total{path="a\\"b\\\\c\\nd"}': float(2**40)}, snapshot


def test_a_gauge_may_share_its_name_with_a_counters_and_reads_when_scraped() -> None:
    # The worker's kvxfer_quarantined_slots (a gauge) beside kvxfer_quarantined_slots_total
    # (a counter): prometheus_client's own Gauge would be refused as a duplicate.
    meters = Meters()
    meters.quarantined.inc(3)
    meters.quarantined_now.set(2)
    meters.blocks.set(5, state="pinned", group="full")
    text = meters.registry.render()
    assert "kvxfer_quarantined_slots_total 3.0\n" in text and "kvxfer_quarantined_slots 2.0\n" in text
    assert 'kvxfer_pool_blocks{group="full",state="pinned"} 5.0\n' in text
    outstanding = [3]
    r = Registry()
    r.gauge("kvxfer_q", "Q.", ("worker",), lambda: {("w1",): float(outstanding[0])})
    outstanding[0] = 7
    assert 'kvxfer_q{worker="w1"} 7.0\n' in r.render()


def test_the_registries_merge_into_an_embedders_and_stay_out_of_the_default_one() -> None:
    router = Router([], ["http://127.0.0.1:9"])
    meters = Meters()
    router.meters.requests.inc(path="local", result="ok")
    meters.transfers.inc(status="delivered")
    mine = CollectorRegistry(auto_describe=True)  # as prometheus_client's default one is made
    mine.register(router.metrics)
    mine.register(meters.registry)
    own = prometheus_client.Counter("embedder_calls_total", "The embedder's own.", registry=mine)
    own.inc()
    assert mine.get_sample_value("kvxfer_router_requests_total", {"path": "local", "result": "ok"}) == 1.0
    assert mine.get_sample_value("kvxfer_transfers_total", {"status": "delivered"}) == 1.0
    text = generate_latest(mine).decode()
    assert 'kvxfer_router_outstanding{role="decode",worker="http://127.0.0.1:9"} 0.0\n' in text
    assert "embedder_calls_total 1.0\n" in text
    # Counted once more, seen through the embedder's registry at once (no copy).
    router.meters.requests.inc(path="local", result="ok")
    assert mine.get_sample_value("kvxfer_router_requests_total", {"path": "local", "result": "ok"}) == 2.0
    default = generate_latest(prometheus_client.REGISTRY).decode()
    assert "kvxfer_" not in default


def test_worker_request_metric_labels_only_known_endpoints() -> None:
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
    assert lines == ['kvxfer_worker_requests_total{endpoint="other",result="not_found"} 3.0'], lines
