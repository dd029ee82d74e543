"""A worker's metrics: the names and help texts below are its /metrics API.

Beside kvxfer's own series, the KV-transfer ones vLLM's NIXL connector exports, by the same
names, types, bucket bounds and ``model_name`` label, from the same transfers (each worker
counts those it took part in, publishing or fetching, whatever its backend):
``vllm:nixl_xfer_time_seconds`` and ``vllm:nixl_bytes_transferred`` (histograms, one
observation per delivered transfer: submission to outcome, and its bytes) and
``vllm:nixl_num_failed_transfers_total`` (those that failed or were cancelled, but for a fetch
cancelled because its client left: that one is only ``kvxfer_transfers_total{status="cancelled"}``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from kvxfer.contract import Cancelled, Delivered, Failed, Outcome, View
from kvxfer.serving.metrics import LabelValues, Registry


def reason_label(outcome: Outcome | None, reason: str = "") -> str:
    """A short, bounded label for metrics (the full reason goes to logs and responses)."""
    if isinstance(outcome, Cancelled):
        return "cancelled_by_peer" if outcome.by_peer else "cancelled"
    text = (reason or (outcome.reason if isinstance(outcome, Failed) else "")).lower()
    for words, label in ((("dead", "disconnect", "gone", "unreachable"), "peer_gone"),
                         (("deadline", "timeout", "timed out"), "timeout"), (("inject",), "injected")):
        if any(w in text for w in words):
            return label
    return "transfer_error"


def outcome_bytes(view: View, outcome: Outcome, parts: Sequence[View] = ()) -> int:
    """``parts``: the request's transfers, one geometry view per group of ``view`` (a hybrid
    cache's), each row weighing its own geometry's block."""
    if parts:
        return sum(int(m.sum()) * part.geometry.block_bytes for part, m in zip(parts, outcome.masks)
                   if part.geometry is not None)
    if view.geometry is not None:  # an engine's own KV: a row is a block of every layer's K and V (its heads)
        return int(outcome.masks[0].sum()) * view.geometry.block_bytes
    return sum(int(m.sum()) * g.region.slot_bytes for g, m in zip(view.groups, outcome.masks))


def _status(outcome: Outcome) -> str:
    return {Delivered: "delivered", Failed: "failed", Cancelled: "cancelled"}[type(outcome)]


NIXL_XFER_TIME_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 5.0)
NIXL_BYTES_BUCKETS = tuple(float(2 ** (10 + i)) for i in range(1, 25, 2))  # 2 KiB to 8 GiB
"""vLLM's NIXL connector's bucket bounds (NixlPromMetrics in vLLM's nixl_connector.py)."""


class Meters:
    """The counters, histograms and gauges of one worker, in one registry of its own (a
    prometheus_client CollectorRegistry: ``Worker.metrics``). ``model_name``: the vllm:
    series' label (the worker's ``--model``). ``integrity_rows``: the rows its backends' integrity
    checks refused so far, by source (read when scraped). ``clock``: the engine thread's
    ``EngineClock`` (kvxfer.worker.engine_thread), read when scraped."""

    def __init__(self, model_name: str = "",
                 integrity_rows: Callable[[], dict[LabelValues, float]] = dict, clock: Any = None) -> None:
        r = self.registry = Registry()
        self.model_name = model_name
        self.requests = r.counter("kvxfer_worker_requests_total", "Control API calls, by endpoint and result.",
                                  ("endpoint", "result"))
        self.transfers = r.counter("kvxfer_transfers_total", "Transfers concluded, by status.", ("status",))
        self.transfer_bytes = r.counter("kvxfer_transfer_bytes_total", "Bytes delivered by transfers.")
        self.transfer_rows = r.counter("kvxfer_transfer_rows_total", "Rows delivered by transfers.")
        self.failures = r.counter("kvxfer_transfer_failures_total", "Transfers that failed, by reason.", ("reason",))
        self.recomputed = r.counter("kvxfer_recomputed_tokens_total", "Prompt tokens recomputed after a transfer.")
        self.tokens = r.counter("kvxfer_generated_tokens_total", "Tokens produced by this worker.")
        self.latency = r.histogram("kvxfer_transfer_seconds", "Submission to outcome, per transfer.")
        self.prefill = r.histogram("kvxfer_prefill_seconds", "Prompt forward pass time.")
        self.step = r.histogram("kvxfer_decode_step_seconds", "One decode step.")
        self.open_leases = r.gauge("kvxfer_open_leases", "Leases not yet released.")
        self.quarantined_now = r.gauge("kvxfer_quarantined_slots",
                                       "Rows set aside now because a peer may still touch them.")
        self.quarantined = r.counter("kvxfer_quarantined_slots_total",
                                     "Rows set aside because a peer may still touch them.")
        self.reclaimed = r.counter("kvxfer_reclaimed_slots_total",
                                   "Set-aside rows given back once no peer could touch them.")
        self.blocks = r.gauge("kvxfer_pool_blocks", "Pool blocks by state.", ("group", "state"))
        self.active = r.gauge("kvxfer_worker_active_streams", "Publish or generate streams in progress.")
        self.held = r.gauge("kvxfer_worker_held_requests", "Requests holding pool blocks between calls: prefills "
                            "waiting for their publish, reservations waiting for their generate, and prefills, "
                            "reservations or local generations being set up, by table.", ("table",))
        self.store_rows = r.counter("kvxfer_store_rows_total", "Rows put into or read from the KV store, by "
                                    "operation and whether the store took or held them.", ("op", "result"))
        self.store_errors = r.counter("kvxfer_store_errors_total", "Store calls that failed as a whole.", ("op",))
        self.integrity_failed = r.read_counter(
            "kvxfer_integrity_rows_failed", "Rows that landed here and failed their integrity check (their bytes "
            "differ from the sender's digest, or came with none), by source: transfer or store.", ("source",),
            integrity_rows)
        if clock is not None:
            r.read_counter("kvxfer_engine_thread_seconds", "Seconds the engine thread spent in its jobs, by job: a step "
                           "of the engine's batch, the engine's other work, or the work a move adds (lend, describe, "
                           "submit, arrival, adopt), which delays the next step.", ("job",), clock.by_job)
            r.read_counter("kvxfer_engine_thread_jobs", "Jobs the engine thread ran, by job (as "
                           "kvxfer_engine_thread_seconds).", ("job",), clock.jobs_by_kind)
            r.read_counter("kvxfer_engine_step_seconds", "Seconds in the engine's steps, by whether rows of this "
                           "worker were lent to a transfer (an open lease) when the step began (in_flight, none).", ("transfers",),
                           clock.step_seconds_by_transfers)
            r.read_counter("kvxfer_engine_steps", "The engine's steps, by whether rows of this worker were lent "
                           "to a transfer (an open lease) when the step began (in_flight, none).", ("transfers",), clock.steps_by_transfers)
        model = ("model_name",)
        self.nixl_time = r.histogram("vllm:nixl_xfer_time_seconds", "Histogram of transfer duration for KV Cache "
                                     "transfers (kvxfer's, by vLLM's NIXL name).", model, NIXL_XFER_TIME_BUCKETS)
        self.nixl_bytes = r.histogram("vllm:nixl_bytes_transferred", "Histogram of bytes transferred per KV Cache "
                                      "transfer (kvxfer's, by vLLM's NIXL name).", model, NIXL_BYTES_BUCKETS)
        self.nixl_failed = r.counter("vllm:nixl_num_failed_transfers_total", "Number of failed KV Cache transfers "
                                     "(kvxfer's, by vLLM's NIXL name).", model)
        for series in (self.nixl_time, self.nixl_bytes, self.nixl_failed):
            series.metric.labels(model_name=model_name)  # at 0 from the start, as vLLM's are

    def count_transfer(self, view: View, outcome: Outcome, seconds: float, *, unwanted: bool = False,
                       parts: Sequence[View] = ()) -> dict[str, Any]:
        """Count a concluded transfer; its figures, as the /publish and /generate streams report them.
        ``unwanted``: its rows were no longer wanted (the client left), so a Cancelled outcome is
        counted as cancelled only, not as a failure. ``parts``: ``outcome_bytes``'s."""
        status = _status(outcome)
        self.transfers.inc(status=status)
        nbytes = outcome_bytes(view, outcome, parts)
        self.transfer_bytes.inc(nbytes)
        self.transfer_rows.inc(outcome.rows_delivered)
        self.latency.observe(seconds)
        reason = outcome.reason if isinstance(outcome, Failed) else ""
        if isinstance(outcome, Delivered):
            self.nixl_time.observe(seconds, model_name=self.model_name)
            self.nixl_bytes.observe(nbytes, model_name=self.model_name)
        elif not (unwanted and isinstance(outcome, Cancelled)):  # that one is a cancel, and nothing went wrong
            self.failures.inc(reason=reason_label(outcome))
            self.nixl_failed.inc(model_name=self.model_name)
        return {"status": status, "reason": reason, "rows": view.rows, "rows_delivered": outcome.rows_delivered,
                "bytes": nbytes, "seconds": seconds}
