"""A router's metrics: the names and help texts below are its /metrics API.

Beside kvxfer's own series, the ones vLLM's OpenAI server exports, by the same names, types,
bucket bounds and ``model_name`` label, measured where the router sees them, so that a
dashboard or autoscaler made for vLLM reads a kvxfer router:
- ``vllm:time_to_first_token_seconds``: request start to its first token;
- ``vllm:time_per_output_token_seconds``: each gap between two tokens of a request;
- ``vllm:e2e_request_latency_seconds``: request start to its end;
- ``vllm:prompt_tokens_total``, ``vllm:generation_tokens_total``: the requests' prompt tokens
  and the tokens streamed;
- ``vllm:num_requests_waiting``: requests in flight without their first token yet (queued
  or prefilling on a worker: the router cannot tell which), ``vllm:num_requests_running``:
  those streaming tokens.
A request no worker ran (no usable pair) counts in none but the gauges while it is in flight.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Protocol

from kvxfer.router.results import Completion
from kvxfer.serving.metrics import Registry


class _Worker(Protocol):
    url: str
    role: str
    outstanding: int


class _Request(Protocol):
    ttft: float | None  # None until its first token


TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
               960.0, 1920.0, 7680.0)
"""vLLM's bucket bounds for these three histograms (vllm/v1/metrics/loggers.py)."""


class RouterMeters:
    """The counters, histograms and gauge of one router, in one registry of its own (a
    prometheus_client CollectorRegistry: ``Router.metrics``). ``workers`` lists the workers
    as they are when scraped (the gauge of requests in flight reads them then); ``requests``
    the requests in flight, and ``model_name`` the served model's name, likewise."""

    def __init__(self, workers: Callable[[], Iterable[_Worker]],
                 requests: Callable[[], Iterable[_Request]] = lambda: (), model_name: Callable[[], str] = str) -> None:
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
        self.model_name = model_name
        model = ("model_name",)
        self.vllm_ttft = r.histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in "
                                     "seconds (the router's view).", model, TTFT_BUCKETS)
        self.vllm_tpot = r.histogram("vllm:time_per_output_token_seconds", "Histogram of time per output token in "
                                     "seconds (the router's view).", model, TPOT_BUCKETS)
        self.vllm_e2e = r.histogram("vllm:e2e_request_latency_seconds", "Histogram of end to end request latency "
                                    "in seconds (the router's view).", model, E2E_BUCKETS)
        self.vllm_prompt = r.counter("vllm:prompt_tokens_total", "Number of prefill tokens processed.", model)
        self.vllm_generation = r.counter("vllm:generation_tokens_total", "Number of generation tokens processed.",
                                         model)

        def in_flight(streaming: bool) -> dict[tuple[str, ...], float]:
            return {(model_name(),): float(sum((q.ttft is not None) == streaming for q in requests()))}
        r.gauge("vllm:num_requests_running", "Number of requests streaming tokens (the router's view).", model,
                lambda: in_flight(True))
        r.gauge("vllm:num_requests_waiting", "Number of requests waiting for their first token (the router's view).",
                model, lambda: in_flight(False))

    def count(self, c: Completion, token_times: Sequence[float] = ()) -> None:
        """Count a finished request; ``token_times``: when each of its tokens came, in
        seconds since it began (the gaps between them feed vllm:time_per_output_token_seconds)."""
        self._count_vllm(c, token_times)
        self.requests.inc(result="ok" if c.ok else "failed", path=c.path)
        self.tokens.inc(len(c.tokens))
        if c.ttft_s is not None:
            self.ttft.observe(c.ttft_s)
        self.total.observe(c.total_s)
        if c.transfer is not None:
            self.transfer.observe(c.transfer.seconds)
            self.bytes.inc(c.transfer.bytes)
            self.rows.inc(c.transfer.rows_delivered)

    def _count_vllm(self, c: Completion, token_times: Sequence[float]) -> None:
        if c.finish_reason == "unavailable":
            return  # no worker ran any of it
        name = self.model_name()
        if c.ttft_s is not None:
            self.vllm_ttft.observe(c.ttft_s, model_name=name)
        for before, after in zip(token_times, token_times[1:]):
            self.vllm_tpot.observe(after - before, model_name=name)
        self.vllm_e2e.observe(c.total_s, model_name=name)
        self.vllm_prompt.inc(c.prompt_tokens, model_name=name)
        self.vllm_generation.inc(len(c.tokens), model_name=name)
