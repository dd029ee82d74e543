"""A router's metrics: the names and help texts below are its /metrics API."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Protocol

from kvxfer.router.results import Completion
from kvxfer.serving.metrics import Registry


class _Worker(Protocol):
    url: str
    role: str
    outstanding: int


class RouterMeters:
    """The counters, histograms and gauge of one router, in one registry of its own (a
    prometheus_client CollectorRegistry: ``Router.metrics``). ``workers`` lists the workers
    as they are when scraped (the gauge of requests in flight reads them then)."""

    def __init__(self, workers: Callable[[], Iterable[_Worker]]) -> None:
        r = self.registry = Registry()
        self.requests = r.counter("kvxfer_router_requests_total", "Requests by result and path.", ("path", "result"))
        self.tokens = r.counter("kvxfer_router_tokens_total", "Tokens streamed to clients.")
        self.ttft = r.histogram("kvxfer_router_ttft_seconds", "Request start to first token.")
        self.total = r.histogram("kvxfer_router_request_seconds", "Request start to its last token.")
        self.transfer = r.histogram("kvxfer_router_transfer_seconds", "Publish submission to outcome.")
        self.bytes = r.counter("kvxfer_router_transfer_bytes_total", "Bytes delivered by transfers.")
        self.rows = r.counter("kvxfer_router_transfer_rows_total", "Rows delivered by transfers.")
        self.worker_failures = r.counter("kvxfer_router_worker_failures_total", "Failed calls, by worker.",
                                         ("role", "worker"))
        self.outstanding = r.gauge("kvxfer_router_outstanding", "Requests in flight, by worker.", ("role", "worker"),
                                   lambda: {(e.role, e.url): float(e.outstanding) for e in workers()})

    def count(self, c: Completion) -> None:
        self.requests.inc(result="ok" if c.ok else "failed", path=c.path)
        self.tokens.inc(len(c.tokens))
        if c.ttft_s is not None:
            self.ttft.observe(c.ttft_s)
        self.total.observe(c.total_s)
        if c.transfer is not None:
            self.transfer.observe(c.transfer.seconds)
            self.bytes.inc(c.transfer.bytes)
            self.rows.inc(c.transfer.rows_delivered)
