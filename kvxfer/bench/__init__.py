"""Transfer microbenchmarks with baselines measured in the same run.

Public API: ``preset(name)`` or a ``BenchConfig`` you build, ``run(config)`` for a
``BenchResult``, ``evaluate(result)`` for the target rows of docs/performance.md, ``render_text`` and
``render_markdown`` for tables, ``compare(old, new)`` for regressions. The command line
is ``kvxfer bench`` (``kvxfer.bench.cli``).
"""

from kvxfer.bench.compare import compare, regressions
from kvxfer.bench.config import (
    BenchConfig,
    ConfigError,
    LatencySweep,
    OverheadSweep,
    Point,
    Repetition,
    ThroughputSweep,
    preset,
)
from kvxfer.bench.report import render_markdown, render_text
from kvxfer.bench.results import SCHEMA_VERSION, BenchResult, Figure, load
from kvxfer.bench.runner import run
from kvxfer.bench.targets import evaluate

__all__ = [
    "SCHEMA_VERSION", "BenchConfig", "BenchResult", "ConfigError", "Figure", "LatencySweep", "OverheadSweep",
    "Point", "Repetition", "ThroughputSweep", "compare", "evaluate", "load", "preset", "regressions",
    "render_markdown", "render_text", "run",
]
