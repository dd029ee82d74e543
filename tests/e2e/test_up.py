"""`kvxfer up`: the router and its workers as one service from one command. It says where it
serves in one line, answers completions, starts a killed worker again on its port so the
router goes on serving, refuses bad flags in one line, and SIGTERM stops every process."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

BODY = {"model": "toy", "prompt": [1, 2, 3], "max_tokens": 5}


def _line(stream: Any, timeout_s: float) -> str:
    ready, _, _ = select.select([stream], [], [], timeout_s)
    return stream.readline() if ready else ""


def _complete(url: str) -> dict[str, Any]:
    request = urllib.request.Request(f"{url}/v1/completions", json.dumps(BODY).encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as answer:
        return json.loads(answer.read())


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0] != "Z"


def test_up_serves_restarts_a_killed_worker_and_stops_everything(tmp_path: Path) -> None:
    listing = tmp_path / "processes.json"
    up = subprocess.Popen([sys.executable, "-m", "kvxfer.cli", "up", "--port", "0", "--json", str(listing),
                           "--log-dir", str(tmp_path / "logs")],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert up.stdout is not None and up.stderr is not None
        ready = _line(up.stdout, 120)
        assert ready.startswith("kvxfer up: serving toy at http://127.0.0.1:"), ready + up.stderr.read()
        url = ready.split(" at ", 1)[1].split("/v1", 1)[0]
        first = _complete(url)["choices"][0]["token_ids"]
        assert len(first) == 5
        processes = {p["name"]: p for p in json.loads(listing.read_text())}
        assert sorted(processes) == ["decode0", "prefill0", "router"]
        os.kill(processes["decode0"]["pid"], signal.SIGKILL)
        restarted = _line(up.stderr, 60)
        assert restarted.startswith(f"kvxfer up: decode0 exited (-9); starting it again on port "
                                    f"{processes['decode0']['port']}"), restarted
        # The router knows the worker by its URL, which is the same again: the next request is served.
        deadline = time.monotonic() + 60
        while True:
            try:
                again = _complete(url)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        assert again["choices"][0]["token_ids"] == first
        up.send_signal(signal.SIGTERM)
        assert up.wait(60) == 0
        assert not [p for p in processes.values() if _alive(p["pid"])]
    finally:
        if up.poll() is None:
            up.kill()
            up.wait(30)


def test_bad_flags_are_one_line_before_anything_starts() -> None:
    proc = subprocess.run([sys.executable, "-m", "kvxfer.cli", "up", "--decode", "0"], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == "kvxfer up: error: --decode must be at least 1, got 0 (kvxfer up --help lists the flags)\n"


@pytest.mark.parametrize(("flags", "says"), [
    (["--engine", "transformers"], "--engine transformers loads a GGUF with transformers itself"),
    (["--engine", "transformers", "--model", "smollm2", "--backend", "ucx"],
     "--engine transformers moves KV over nixl for now, not --backend ucx"),
])
def test_what_the_transformers_engine_cannot_run_is_named_before_anything_starts(flags: list[str], says: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "kvxfer.cli", "up", *flags], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.startswith(f"kvxfer up: error: {says}") and proc.stderr.count("\n") == 1, proc.stderr
