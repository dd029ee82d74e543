"""Reliability figures of the real stack, measured in one run.

    python -m kvxfer.testing.reliability [--kills N] [--chaos N] [--soak N] [--fuzz N] [--quick] [--json PATH]

Four experiments, each against real processes over NIXL on loopback addresses:

1. ``kills``  (``kills.py``): a NIXL peer SIGKILLed mid-transfer, N rounds: rows claimed,
   rows wrong among those that can be read back, time to a concluded, quiesced attempt.
2. ``chaos``  (``chaos.py``): 2 prefill + 2 decode workers behind a Router with policy
   recompute, workers SIGKILLed and restarted while N requests run: failures, wrong
   outputs, recovery time.
3. ``soak``   (``soak.py``): 1 + 1 workers, N short requests: throughput, latency, and each
   worker's RSS, threads and fds after the warm-up and at the end.
4. ``fuzz``   (``fuzz_wire.py``, ``fuzz_http.py``): N mutated hints, completion records and
   HTTP requests: anything but WireError from a decoder, any 500 or dropped answer.

``run(config)`` returns a ``Report`` (frozen dataclasses, JSON via ``Report.to_json``);
``Report.findings()`` lists what broke a property users rely on. Every process and thread
an experiment starts is stopped when it ends, on error and on Ctrl-C too.
"""

from __future__ import annotations

import dataclasses
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvxfer.testing.reliability.chaos import ChaosSummary, run_chaos
from kvxfer.testing.reliability.fuzz_http import HttpFuzzSummary, run_http_fuzz
from kvxfer.testing.reliability.fuzz_wire import WireFuzzSummary, real_seeds, run_wire_fuzz
from kvxfer.testing.reliability.kills import KillSummary, run_kills
from kvxfer.testing.reliability.soak import SoakSummary, run_soak

KILL_BOUND_S = 10.0  # a killed peer's transfer must be concluded and quiesced within this


@dataclass(frozen=True)
class Config:
    kills: int = 50          # kill rounds (0: skip)
    chaos: int = 400         # serving-chaos requests (0: skip)
    chaos_kills: int = 7     # worker kills during them: one every chaos / (chaos_kills + 1) completions
    soak: int = 10_000       # soak requests (0: skip)
    fuzz: int = 12_000       # fuzz cases: a sixth HTTP, the rest hints (3/5) and completion records (0: skip)
    seed: int = 0
    progress: bool = True
    log_dir: str = ""        # worker logs kept here; "" = a temporary folder, removed at the end

    def fuzz_split(self) -> tuple[int, int, int]:
        """(hint cases, completion-record cases, HTTP cases)."""
        http = self.fuzz // 6
        wire = self.fuzz - http
        return wire * 3 // 5, wire - wire * 3 // 5, http


QUICK = Config(kills=8, chaos=60, chaos_kills=2, soak=300, fuzz=2000)  # kills: each of the 4 cases twice


@dataclass(frozen=True)
class Report:
    config: Config
    machine: dict[str, str]
    started_utc: str
    seconds: dict[str, float]
    kills: KillSummary | None
    chaos: ChaosSummary | None
    soak: SoakSummary | None
    wire_fuzz: WireFuzzSummary | None
    http_fuzz: HttpFuzzSummary | None

    def findings(self) -> list[str]:
        """Each property a user relies on that this run saw broken (empty: none)."""
        out: list[str] = []
        if self.kills is not None:
            out += _kill_findings(self.kills)
        if self.chaos is not None:
            out += _chaos_findings(self.chaos)
        if self.soak is not None:
            out += _soak_findings(self.soak)
        if self.wire_fuzz is not None:
            out += _wire_fuzz_findings(self.wire_fuzz)
        if self.http_fuzz is not None:
            out += _http_fuzz_findings(self.http_fuzz)
        return out

    def to_json(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "findings": self.findings()}


def _kill_findings(k: KillSummary) -> list[str]:
    out = []
    if k.rows_wrong:
        out.append(f"kills: {k.rows_wrong} rows claimed delivered hold wrong bytes")
    if k.not_concluded or (k.detection_max_ms or 0.0) > KILL_BOUND_S * 1e3:
        out.append(f"kills: {k.not_concluded} attempts not concluded+quiesced, slowest "
                   f"{k.detection_max_ms} ms (bound {KILL_BOUND_S:g} s)")
    if k.unquiesced_at_shutdown:
        out.append(f"kills: {k.unquiesced_at_shutdown} local shutdowns left attempts unquiesced")
    if k.rounds_measured < k.rounds:
        out.append(f"kills: {k.rounds - k.rounds_measured} rounds could not place the kill mid-transfer")
    return out


def _chaos_findings(c: ChaosSummary) -> list[str]:
    out = []
    if c.failures or c.wrong:
        out.append(f"chaos: {c.failures} failed and {c.wrong} wrong of {c.requests} under recompute")
    if c.not_recovered:
        out.append(f"chaos: after {c.not_recovered} kills no later request completed")
    return out + _held("chaos", c.workers_after)


def _soak_findings(s: SoakSummary) -> list[str]:
    out = []
    if s.failures or s.wrong:
        out.append(f"soak: {s.failures} failed and {s.wrong} wrong of {s.requests}")
    return out + _held("soak", s.workers_after)


def _wire_fuzz_findings(w: WireFuzzSummary) -> list[str]:
    return [f"fuzz: decoding {name} raised {tally.other_types} (not WireError)"
            for name, tally in (("hints", w.hints), ("completion records", w.completions)) if tally.other]


def _http_fuzz_findings(h: HttpFuzzSummary) -> list[str]:
    out = []
    for what, n in (("answered 500", h.server_errors), ("closed without a status", h.dropped),
                    ("not answered", h.hangs), ("streams cut", h.streams_cut)):
        if n:
            kinds = f": {h.server_error_kinds}" if "500" in what else ""
            out.append(f"fuzz: {n} HTTP requests {what}{kinds}")
    if not h.workers_alive:
        out.append("fuzz: a worker died or stopped answering /health")
    return out + _held("fuzz", h.workers_after)


def _held(what: str, states: Any) -> list[str]:
    return [f"{what}: worker {s.name} holds {s.held} prefills and {s.reserved} reservations at the end"
            if s.answered else f"{what}: worker {s.name} did not answer /health at the end"
            for s in states if not s.answered or s.held or s.reserved]


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], capture_output=True, text=True, timeout=10,
                              cwd=Path(__file__).resolve().parents[3]).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def machine() -> dict[str, str]:
    """Where and on what code the run starts (the commit is read before any experiment)."""
    commit = _git("rev-parse", "--short", "HEAD")
    if commit and _git("status", "--short"):
        commit += "+uncommitted changes"
    return {"nproc": str(os.cpu_count()), "python": sys.version.split()[0], "platform": platform.platform(),
            "git_commit": commit}


def run(config: Config = Config()) -> Report:
    """Run the experiments ``config`` asks for (a count of 0 skips one), in order."""
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    where = machine()
    seconds: dict[str, float] = {}
    logs = Path(config.log_dir) if config.log_dir else Path(tempfile.mkdtemp(prefix="kvxfer-reliability-"))
    results: dict[str, Any] = {"kills": None, "chaos": None, "soak": None, "wire_fuzz": None, "http_fuzz": None}
    try:
        def timed(name: str, fn: Any, *args: Any, **kwargs: Any) -> None:
            t = time.monotonic()
            results[name] = fn(*args, **kwargs)
            seconds[name] = round(time.monotonic() - t, 1)

        if config.kills:
            timed("kills", run_kills, config.kills, seed=config.seed, progress=config.progress)
        if config.chaos:
            timed("chaos", run_chaos, config.chaos, config.chaos_kills, seed=config.seed + 11,
                  log_dir=logs / "chaos", progress=config.progress)
        if config.soak:
            timed("soak", run_soak, config.soak, seed=config.seed + 5, log_dir=logs / "soak", progress=config.progress)
        if config.fuzz:
            hints, records, http = config.fuzz_split()
            timed("wire_fuzz", run_wire_fuzz, hints, records, seed=config.seed, progress=config.progress)
            timed("http_fuzz", run_http_fuzz, http, seed=config.seed, hints=real_seeds(config.seed),
                  log_dir=logs / "fuzz", progress=config.progress)
    finally:
        if not config.log_dir:
            shutil.rmtree(logs, ignore_errors=True)
    return Report(config, where, started, seconds, **results)


__all__ = ["KILL_BOUND_S", "QUICK", "Config", "Report", "run"]
