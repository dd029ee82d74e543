"""``kvxfer pair``'s results and report: one ``Result`` per request, ``summarize`` into the
JSON report (tokens matched, failures by kind, TTFT and transfer quantiles) and
``print_report`` for people. ``kvxfer.pair`` runs the pair and fills them."""

from __future__ import annotations

import re
import sys
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kvxfer.pair.sampling import sampling_line
from kvxfer.pair.store import store_lines
from kvxfer.router.constants import KEY_PATTERN


@dataclass
class Result:
    request: str
    prompt_tokens: int
    tokens: list[int]
    expected: list[int]
    ttft_s: float | None
    total_s: float
    transfer: dict[str, Any] | None
    path: str
    error: str | None
    events: list[str] = field(default_factory=list)
    # When the second token reached the client: the decode worker's first, so the prefill,
    # the KV transfer and one decode step (the first token is the prefill worker's, sent at
    # once). Layer-wise streaming (--layerwise) shortens this one.
    second_token_s: float | None = None

    @property
    def matched(self) -> bool:
        return self.error is None and self.tokens == self.expected


def percentile(values: list[float], q: float) -> float | None:
    return float(np.percentile(np.asarray(values, dtype=np.float64), q)) if values else None


_URL = re.compile(r"https?://(?:\[[0-9a-fA-F:]*\]|[\w.-]+)(?::\d+)?")
_REQUEST_ID = re.compile(rf"\b(?:{KEY_PATTERN}(?:-local\d+)?(?:#local)?|pair-\d+)\b")
_NUMBER = re.compile(r"(?<![\w.])(?<!HTTP )\d+(?:\.\d+)?(?![\w.])")


def failure_kind(error: str) -> str:
    """What went wrong, without where or to which request: an error with its worker's URL,
    request ids and counts replaced, so one cause on several workers is one line of the report.
    HTTP statuses stay (a 409 refusal is not a 500)."""
    text = _REQUEST_ID.sub("<request>", _URL.sub("<worker>", error))
    return _NUMBER.sub("N", text)[:160]


def summarize(results: list[Result], wall_s: float, config: dict[str, Any]) -> dict[str, Any]:
    tokens = sum(len(r.tokens) for r in results)
    return {
        "config": config,
        **outcomes(results),
        "tokens": tokens, "wall_s": wall_s, "tokens_per_s": tokens / wall_s if wall_s > 0 else None,
        "ttft_s": _quantiles([r.ttft_s for r in results if r.ttft_s is not None]),
        "second_token_s": _quantiles([r.second_token_s for r in results if r.second_token_s is not None]),
        "latency_s": _quantiles([r.total_s for r in results if r.error is None]),
        **_transfer_summary([r.transfer for r in results if r.transfer]),
        "paths": _tally(r.path for r in results),
        "failures": _tally(_failure(r) for r in results if not r.matched),
        "results": [asdict(r) | {"matched": r.matched} for r in results],
    }


def outcomes(results: list[Result]) -> dict[str, int]:
    return {
        "requests": len(results), "completed": sum(1 for r in results if r.error is None),
        "matched": sum(1 for r in results if r.matched),
        "mismatched": sum(1 for r in results if r.error is None and not r.matched),
        "failed": sum(1 for r in results if r.error is not None),
    }


def _quantiles(values: list[float]) -> dict[str, float | None]:
    return {"p50": percentile(values, 50), "p99": percentile(values, 99)}


def _transfer_summary(transfers: list[dict[str, Any]]) -> dict[str, Any]:
    seconds = [float(t["seconds"]) for t in transfers]
    moved = sum(int(t["bytes"]) for t in transfers)
    return {
        "transfer_s": _quantiles(seconds),
        "transfers": len(transfers),
        "transfer_bytes": moved,
        "transfer_gb_per_s": (moved / sum(seconds) / 1e9) if seconds and sum(seconds) > 0 else None,
        "rows": sum(int(t["rows_delivered"]) for t in transfers),
        "rows_requested": sum(int(t["rows"]) for t in transfers),
        # Rows a delivered transfer did not move: the decode worker had those prompt blocks cached.
        "rows_cached_at_decode": sum(int(t["rows"]) - int(t["rows_delivered"]) for t in transfers
                                     if t["status"] == "delivered"),
    }


def _failure(result: Result) -> str:
    """The report's line for a request that did not match."""
    return "tokens differ from colocated generation" if result.error is None else failure_kind(result.error)


def _tally(keys: Iterable[str]) -> dict[str, int]:
    """How often each key occurs, in order of first occurrence."""
    counts: dict[str, int] = {}
    for key in keys:
        counts[key] = counts.get(key, 0) + 1
    return counts


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1e3:.2f} ms"


def _kv_line(kv: dict[str, Any] | None) -> list[str]:
    if not kv:
        return []
    ends = [f"{role} TP {e['tp']}, {e['block_tokens']}-token {e['layout'].replace('_', '-')}"
            for role, e in kv.items()]
    return [f"  KV           {' -> '.join(ends)} (engine geometries, one transfer per rank pair)"]


def _colocated_line(colocated: dict[str, Any] | None) -> list[str]:
    if colocated is None:
        return []
    return [f"  colocated    TTFT p50 {_ms(colocated['ttft_s']['p50'])}   p99 {_ms(colocated['ttft_s']['p99'])}   "
            f"latency p50 {_ms(colocated['latency_s']['p50'])}   p99 {_ms(colocated['latency_s']['p99'])}   "
            f"{colocated['tokens_per_s'] or 0:.0f} tokens/s ({colocated['what']})"]


_REFUSED = re.compile(r'^kvxfer_integrity_rows_failed_total\{source="(transfer|store)"\} (\S+)$', re.M)


def integrity_refused(log_dir: Path) -> dict[str, int]:
    """Rows the workers refused because their digests did not check out, by source, from the
    metrics the pair saved beside their logs (every round's)."""
    out = {"transfer": 0, "store": 0}
    for path in log_dir.rglob("*.metrics"):
        for source, value in _REFUSED.findall(path.read_text()):
            out[source] += int(float(value))
    return out


_ENGINE_SERIES = re.compile(r'^kvxfer_engine_(thread_seconds|thread_jobs|step_seconds|steps)_total'
                            r'\{(?:job|transfers)="(\w+)"\} (\S+)$', re.M)


def engine_loop(log_dir: Path) -> dict[str, dict[str, float | None]]:
    """What moving requests cost the engines' step loops, by role, from the workers' saved metrics
    (every round's, warm-up requests included): the mean step with a transfer of that worker in
    flight and with none, and the engine thread's time in the jobs a move adds (lend, describe,
    submit, arrival, adopt), which run between two steps."""
    sums: dict[str, dict[str, float]] = {}
    for path in sorted(log_dir.rglob("*.metrics")):
        role = path.stem.rstrip("0123456789")
        if role not in ("prefill", "decode"):
            continue
        into = sums.setdefault(role, {})
        for series, label, value in _ENGINE_SERIES.findall(path.read_text()):
            into[f"{series}.{label}"] = into.get(f"{series}.{label}", 0.0) + float(value)
    def mean_ms(v: dict[str, float], seconds: str, count: str) -> float | None:
        n = v.get(count, 0.0)
        return 1e3 * v.get(seconds, 0.0) / n if n else None

    out: dict[str, dict[str, float | None]] = {}
    for role, v in sums.items():
        busy = sum(v.get(f"thread_seconds.{job}", 0.0) for job in ("step", "engine", "transfer"))
        out[role] = {
            "steps": v.get("thread_jobs.step", 0.0),
            "step_ms_in_flight": mean_ms(v, "step_seconds.in_flight", "steps.in_flight"),
            "step_ms_none": mean_ms(v, "step_seconds.none", "steps.none"),
            "steps_in_flight": v.get("steps.in_flight", 0.0),
            "transfer_jobs": v.get("thread_jobs.transfer", 0.0),
            "transfer_job_ms": 1e3 * v.get("thread_seconds.transfer", 0.0),
            "transfer_share_of_busy": v.get("thread_seconds.transfer", 0.0) / busy if busy else None,
        }
    return out


def _loop_lines(report: dict[str, Any]) -> list[str]:
    lines = []
    requests = report["requests"] + report["config"].get("warmup", 0)
    for role, e in sorted((report.get("engine_loop") or {}).items(), reverse=True):
        share = e["transfer_share_of_busy"]
        lines.append(
            f"  {role + ' loop':<12} step {_ms_or(e['step_ms_none'])} with no transfer in flight, "
            f"{_ms_or(e['step_ms_in_flight'])} with one ({e['steps_in_flight']:.0f} of {e['steps']:.0f} steps); "
            f"move jobs {e['transfer_job_ms'] / max(requests, 1):.2f} ms a request"
            f"{'' if share is None else f' ({100 * share:.1f}% of the engine thread busy)'}")
    return lines


def _ms_or(ms: float | None) -> str:
    return "-" if ms is None else f"{ms:.2f} ms"


def _refused_line(report: dict[str, Any]) -> list[str]:
    refused = report.get("integrity_rows_refused")
    if not refused or report["config"].get("integrity") == "off":
        return []
    recomputed = report["paths"].get("resumed", 0) + report["paths"].get("recomputed", 0)
    return [f"  integrity    {refused['transfer']} transferred and {refused['store']} stored rows refused "
            f"(digest mismatch); {recomputed} requests resumed or recomputed"]


def _integrity(config: dict[str, Any]) -> str:
    state = config.get("integrity")  # absent from reports written before it was
    return "" if state is None else f", integrity {state}"


def print_report(report: dict[str, Any], out: Any = None) -> None:
    c = report["config"]
    gbps = report["transfer_gb_per_s"]
    mode = c["mode"]
    if c.get("mode_requested", mode) != mode:
        mode = f"{mode}, routed from {c['mode_requested']}: its lane is TCP"
    # The model line names the oracle's device; the workers' follow when either differs from it.
    placed = "" if c["prefill_device"] == c["decode_device"] == c["device"] else \
        f" (oracle), prefill on {c['prefill_device']}, decode on {c['decode_device']}"
    lines = [
        f"kvxfer pair: {c['backend']} ({mode}, {c['lender']} lender{_integrity(c)}), {c['prefill_workers']} prefill + "
        f"{c['decode_workers']} decode workers, model {c['model']}{placed}",
        *_kv_line(c.get("engine_kv")),
        *sampling_line(c.get("sampling")),
        f"  requests     {report['requests']} sent, {report['completed']} completed, "
        f"{report['matched']} token-identical to colocated generation, {report['mismatched']} differ, "
        f"{report['failed']} failed",
        f"  tokens       {report['tokens']} in {report['wall_s']:.2f} s ({report['tokens_per_s'] or 0:.0f} tokens/s, "
        f"concurrency {c['concurrency']})",
        f"  TTFT         p50 {_ms(report['ttft_s']['p50'])}   p99 {_ms(report['ttft_s']['p99'])}   "
        f"latency p50 {_ms(report['latency_s']['p50'])}   p99 {_ms(report['latency_s']['p99'])}",
        f"  2nd token    p50 {_ms(report['second_token_s']['p50'])}   p99 {_ms(report['second_token_s']['p99'])}   "
        "(the decode worker's first: prefill, transfer, one step)",
        *_colocated_line(report.get("colocated")),
        f"  transfer     p50 {_ms(report['transfer_s']['p50'])}   p99 {_ms(report['transfer_s']['p99'])}   "
        f"{report['transfers']} transfers, {report['transfer_bytes'] / 1e6:.2f} MB, "
        f"{'-' if gbps is None else f'{gbps:.3f}'} GB/s (bytes / summed transfer time)",
        f"  rows         {report['rows']} delivered of {report['rows_requested']} prompt blocks "
        f"({report['rows_cached_at_decode']} already cached at the decode worker"
        f"{', or taken from the store' if report.get('store_rounds') else ''})",
        *store_lines(report.get("store_rounds", [])),
        f"  paths        {', '.join(f'{k}: {v}' for k, v in sorted(report['paths'].items()))}",
        f"  failures     {', '.join(f'{k}: {v}' for k, v in report['failures'].items()) or 'none'}",
        *_refused_line(report),
        *_loop_lines(report),
    ]
    for r in report["results"]:
        if not r["matched"]:
            lines.append(f"    {r['request']}: {r['error'] or 'tokens differ'}")
    # A model with a tokenizer: what it said, as the router delivered it (repr keeps newlines on one line).
    lines += [f"  text         {s['prompt']!r} -> {s['completion']!r}" for s in report.get("samples", [])]
    print("\n".join(lines), file=out or sys.stdout, flush=True)  # sys.stdout as it is now (a test's capture)
