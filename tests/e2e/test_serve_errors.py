"""`kvxfer serve` refuses what cannot start before it builds anything: one line naming the
problem, exit status 2, no traceback, and (but for a device it must ask torch about) before
torch is imported, so the line comes within a fraction of a second; and says where it listens
once it does."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest

# `kvxfer serve` as the console script runs it, saying on its way out whether torch was imported.
KVXFER = """
import atexit, sys
atexit.register(lambda: print(f"torch imported: {'torch' in sys.modules}", flush=True))
from kvxfer.cli import main
sys.exit(main())
"""


def serve(*flags: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", KVXFER, "serve", "--role", "prefill", *flags],
                          capture_output=True, text=True, timeout=120, env={**os.environ, **(env or {})})


def refused(proc: subprocess.CompletedProcess[str], needle: str, *, torch: bool = False) -> None:
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    assert len(proc.stderr.splitlines()) == 1, proc.stderr  # no usage, no log lines: the error alone
    assert proc.stderr.startswith("kvxfer serve: error: ") and needle in proc.stderr, proc.stderr
    assert f"torch imported: {torch}" in proc.stdout


def test_a_port_in_use_is_refused_before_anything_is_built() -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        start = time.monotonic()
        proc = serve("--port", str(port))
        refused(proc, f"port {port} on 127.0.0.1 is in use")
        assert "Initialized NIXL agent" not in proc.stderr  # no agent was made
        assert time.monotonic() - start < 60


@pytest.mark.parametrize(("flags", "env", "needle"), [
    (["--log-level", "loud"], {}, "--log-level: must be one of DEBUG, INFO, WARNING, ERROR, CRITICAL"),
    ([], {"KVXFER_HINT_KEY": "not-hex"}, "KVXFER_HINT_KEY must be the key in hex"),
    ([], {"KVXFER_HINT_KEY": "abcd"}, "at least 16 bytes"),
    (["--model", "no-such-model"], {}, "no-such-model"),
    (["--store", "mooncake"], {}, "--store mooncake needs --store-master HOST:PORT"),
    (["--store", "mooncake", "--store-master", "127.0.0.1:1"], {}, "no Mooncake master answers at 127.0.0.1:1"),
    (["--store", "memory", "--store-path", "/proc/kvxfer-store"], {}, "--store memory: store directory /proc/kvxfer"),
    (["--store", "memory", "--lender", "staging"], {}, "--store reads and writes the pool's rows in place"),
    ([], {"UCX_NET_DEVICES": "eth0,bogus0"}, "UCX_NET_DEVICES names 'bogus0', which this host does not have"),
])
def test_bad_settings_are_one_line(flags: list[str], env: dict[str, str], needle: str) -> None:
    refused(serve(*flags, env=env), needle)


def test_ipc_without_a_gpu_is_named() -> None:
    from kvxfer.native import info

    if info().cuda_usable:
        pytest.skip("this machine has a usable GPU: --backend ipc can start")
    refused(serve("--backend", "ipc"), "--backend ipc needs a visible CUDA GPU", torch=True)  # asked torch first


def test_a_started_worker_says_where_it_listens() -> None:
    proc = subprocess.Popen([sys.executable, "-m", "kvxfer.cli", "serve", "--role", "prefill", "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stderr is not None
        ready = proc.stdout.readline()
        assert '"event": "ready"' in ready
        deadline = time.monotonic() + 30
        line = ""
        while time.monotonic() < deadline and "listening on" not in line:
            line = proc.stderr.readline()
        assert "prefill worker 'prefill' listening on http://127.0.0.1:" in line
    finally:
        proc.terminate()
        proc.wait(30)


def test_a_port_taken_after_the_probe_is_one_line_too(capsys: pytest.CaptureFixture[str]) -> None:
    import asyncio

    from kvxfer.serving.http import HttpServer, Response
    from kvxfer.serving.startup import listen

    async def handler(request: object) -> Response:
        return Response(200, b"{}")

    async def main(port: int) -> int | None:
        server = HttpServer(handler, "127.0.0.1", port)
        try:
            return await listen(server, "kvxfer serve", "127.0.0.1", port)
        finally:
            await server.close()

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        assert asyncio.run(main(port)) is None
    assert capsys.readouterr().err.startswith(f"kvxfer serve: error: cannot listen on 127.0.0.1:{port}")
