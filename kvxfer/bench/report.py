"""Tables of a result: one per mode, on the terminal (aligned text) and in markdown.

Every throughput row carries its ratios to the run's own references (local copy,
NIXL one descriptor); skipped and failed figures are listed with their reasons below.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvxfer.bench.config import format_size
from kvxfer.bench.references import ratio
from kvxfer.bench.results import BenchResult, Figure
from kvxfer.bench.targets import TargetRow


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.0%}" if x < 10 else f"{x:.0f}x"


def _shape(f: Figure) -> list[str]:
    k = f.key

    def g(name: str) -> str:
        v = k.get(name)
        return "-" if v is None else str(v)

    row = format_size(k["row_bytes"]) if "row_bytes" in k else "-"
    rows = g("rows") if k.get("groups", 1) == 1 else f"{g('rows')}x{g('groups')}"
    return [f.case, g("direction"), g("memory"), g("slots"), row, rows, format_size(k["total_bytes"])]


_SHAPE = ["case", "dir", "memory", "slots", "row", "rows", "bytes"]


def throughput_rows(result: BenchResult) -> tuple[list[str], list[list[str]]]:
    head = _SHAPE + ["GB/s best", "GB/s median", "vs copy", "vs nixl 1-desc", "descs", "reps"]
    rows = []
    for f in result.figures:
        if f.mode != "throughput" or not f.ok:
            continue
        rows.append(_shape(f) + [
            f"{f.get('gbps_best'):.2f}", f"{f.get('gbps_median'):.2f}",
            _pct(ratio(result, f, "local_copy")), _pct(ratio(result, f, "nixl_one_desc")),
            str(f.facts.get("descriptors", "-")), str(int(f.metrics.get("reps", 0))),
        ])
    return head, rows


def latency_rows(result: BenchResult) -> tuple[list[str], list[list[str]]]:
    head = _SHAPE + ["p50 µs", "p99 µs", "min µs", "samples", "measured"]
    rows = []
    for f in result.figures:
        if f.mode == "latency" and f.ok:
            m = f.metrics
            rows.append(_shape(f) + [f"{m['p50_s'] * 1e6:.1f}", f"{m['p99_s'] * 1e6:.1f}", f"{m['min_s'] * 1e6:.1f}",
                                     str(int(m["samples"])), str(f.facts.get("measured", ""))])
    return head, rows


def overhead_rows(result: BenchResult) -> tuple[list[str], list[list[str]]]:
    head = _SHAPE + ["ns/row best", "ns/row median", "publish ns/row", "decode side ns/row"]
    rows = []
    for f in result.figures:
        if f.mode == "overhead" and f.ok:
            m = f.metrics
            rows.append(_shape(f) + [f"{m['per_row_s_best'] * 1e9:.0f}", f"{m['per_row_s_median'] * 1e9:.0f}",
                                     f"{m['publish_per_row_s'] * 1e9:.0f}", f"{m['decode_per_row_s'] * 1e9:.0f}"])
    return head, rows


def target_rows(targets: Sequence[TargetRow]) -> tuple[list[str], list[list[str]]]:
    head = ["target", "threshold", "case", "figure", "measured", "status"]
    return head, [[t.target, t.threshold, t.case, t.shape, t.measured, t.status.upper() if t.status != "not measured"
                   else t.status] for t in targets]


def not_measured(result: BenchResult) -> list[str]:
    """One line per (case, status, reason), with how many figures it covers."""
    counts: dict[tuple[str, str, str], int] = {}
    for f in result.figures:
        if not f.ok:
            k = (f.case, f.status, f.reason)
            counts[k] = counts.get(k, 0) + 1
    return [f"{case}: {status}: {reason} ({n} figure{'s' if n > 1 else ''})"
            for (case, status, reason), n in counts.items()]


def text_table(head: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(head)]
    numeric = [all(_numeric(r[i]) for r in rows) and bool(rows) for i in range(len(head))]

    def fmt(cells: list[str]) -> str:
        return "  ".join(c.rjust(w) if n else c.ljust(w) for c, w, n in zip(cells, widths, numeric)).rstrip()

    return "\n".join([fmt(head), "  ".join("-" * w for w in widths)] + [fmt(r) for r in rows])


def _numeric(cell: str) -> bool:
    c = cell.replace(".", "").replace("%", "").replace("x", "").replace("-", "").replace(",", "")
    return c.isdigit() or cell == "-"


def markdown_table(head: list[str], rows: list[list[str]]) -> str:
    def esc(c: str) -> str:
        return c.replace("|", "\\|")

    lines = ["| " + " | ".join(esc(h) for h in head) + " |", "| " + " | ".join("---" for _ in head) + " |"]
    lines += ["| " + " | ".join(esc(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


_SECTIONS = (("Throughput (payload bytes per second)", throughput_rows),
             ("Latency (small requests)", latency_rows),
             ("Host submission overhead", overhead_rows))


def _machine_line(result: BenchResult) -> str:
    m, v = result.machine, result.versions
    mem = f", {m['memory_bytes'] / (1 << 30):.0f} GiB" if m.get("memory_bytes") else ""
    gpu = f", GPU {m['gpu']}" if m.get("gpu") else ", no GPU"
    if (m.get("gpu_count") or 0) > 1:
        access = m.get("gpu_peer_access")
        peer = "" if access is None else (", peer access" if access else ", no peer access")
        gpu = f", {m['gpu_count']} GPUs {m['gpu']}{peer}"
    vers = ", ".join(f"{k} {v[k]}" for k in ("python", "numpy", "torch", "nixl", "ucx") if v.get(k))
    if v.get("kvxfer_revision"):
        vers += f", kvxfer at {v['kvxfer_revision']}"
    load = ""
    if m.get("loadavg_1m_before") is not None:
        load = f"; load average {m['loadavg_1m_before']} before, {m.get('loadavg_1m_after')} after"
    return f"{m.get('hostname')}: {m.get('cpu')}, {m.get('cores')} cores{mem}{gpu}; {vers}{load}"


def placement_line(result: BenchResult) -> str | None:
    """Where device rows lived, when the two ends were on different GPUs."""
    p, d = result.config.get("devices") or (0, 0)
    if p == d:
        return None
    return (f"Device memory: prefill on cuda:{p}, decode on cuda:{d}; every device figure crosses between "
            f"the two GPUs, and local_copy is the torch peer copy cuda:{p} -> cuda:{d}.")


def render_text(result: BenchResult, targets: Sequence[TargetRow]) -> str:
    out = [f"kvxfer bench ({result.config.get('name')}) on {_machine_line(result)}", ""]
    placed = placement_line(result)
    if placed:
        out[-1:-1] = [placed]
    for title, build in _SECTIONS:
        head, rows = build(result)
        if rows:
            out += [title, text_table(head, rows), ""]
    out += ["Targets (docs/performance.md)", text_table(*target_rows(targets)), ""]
    missing = not_measured(result)
    if missing:
        out += ["Not measured"] + [f"  {line}" for line in missing]
    return "\n".join(out).rstrip() + "\n"


def render_markdown(result: BenchResult, targets: Sequence[TargetRow], json_name: str | None = None) -> str:
    out = [f"# kvxfer bench: {result.config.get('name')} preset", "",
           f"Machine: {_machine_line(result)}.  ", f"Run: {result.created}, {result.duration_s:.0f} s."
           + (f" Raw figures: `{json_name}`." if json_name else ""), ""]
    placed = placement_line(result)
    if placed:
        out[-1:-1] = [placed]
    for title, build in _SECTIONS:
        head, rows = build(result)
        if rows:
            out += [f"## {title}", "", markdown_table(head, rows), ""]
    out += ["## Targets (docs/performance.md)", "", markdown_table(*target_rows(targets)), ""]
    missing = not_measured(result)
    if missing:
        out += ["## Not measured", ""] + [f"- {line}" for line in missing] + [""]
    return "\n".join(out)
