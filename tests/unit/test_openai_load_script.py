"""bench/openai_load.py at small scale, so it cannot rot: its ``main`` against a router and
toy workers served in this process (loopback), 8 requests 4 at a time, two of them leaving
after their first chunk. Its JSON has every figure, no error, and workers that hold nothing."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest
from test_router import cluster  # noqa: I001 - pytest puts tests/unit on sys.path

from kvxfer.router import Router
from kvxfer.router.app import make_handler as router_handler
from kvxfer.serving.http import HttpServer

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "openai_load.py"


def load_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("openai_load", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("openai_load", module)  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_the_load_script_reports_a_small_run_with_nothing_left_behind(tmp_path: Path) -> None:
    script = load_script()
    out = tmp_path / "load.json"

    async def main() -> int:
        async with cluster() as c, Router(c.prefill, c.decode) as router:
            server = HttpServer(router_handler(router))
            url = f"http://127.0.0.1:{await server.start()}"
            try:
                argv = ["--url", url, "--concurrency", "4", "--requests", "8", "--max-tokens", "24", "--leave-every",
                        "4", "--max-prompt", "40", "--out", str(out)]
                return int(await asyncio.to_thread(script.main, argv))
            finally:
                await server.close()

    assert asyncio.run(main()) == 0
    report = json.loads(out.read_text())
    assert report["schema"] == "kvxfer-openai-load" and report["model"] == "toy"
    assert (report["requests"], report["completed"], report["cancelled"], report["errors"]) == (8, 6, 2, {})
    assert report["completion_tokens"] >= 6 * 24 and report["throughput_tokens_per_s"] > 0
    assert 0 < report["ttft_s"]["p50"] <= report["ttft_s"]["p99"]
    assert len(report["leftovers"]) == 2 and report["leftovers_zero"] is True
    assert set(next(iter(report["leftovers"].values()))) == {"streams", "leases", "held", "quarantined",
                                                             "blocks_in_use"}


def test_bad_flags_are_one_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    script = load_script()
    with pytest.raises(SystemExit) as info:
        script.parse_args(["--concurrency", "0"])
    assert info.value.code == 2 and "--concurrency must be at least 1" in capsys.readouterr().err
