"""`kvxfer doctor --peer URL` against a real `kvxfer serve` worker process: the worker hosts
the target (kvxfer.worker.probe), the doctor's initiator runs here. It reports the transport
of each lane and GB/s, gives the local run's advice, frees the probe (and its threads) when
it ends; a second probe is refused; a URL it cannot use is one line and exit status 2."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from kvxfer.doctor.report import REMEDY
from kvxfer.worker.procs import Child

BYTES = 4 << 20


@contextmanager
def worker(tmp_path: Path, env: dict[str, str] | None = None) -> Iterator[Child]:
    child = Child("decode", ["serve", "--role", "decode", "--port", "0", "--log-level", "INFO"],
                  tmp_path / "decode.log", {**os.environ, **(env or {})})
    try:
        child.wait_ready(120)
        yield child
    finally:
        child.stop()


def http(url: str, method: str = "GET", body: dict[str, Any] | None = None) -> tuple[int, dict[str, Any]]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method)
    try:
        with urllib.request.urlopen(request, timeout=30) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def doctor(*flags: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvxfer.cli", "doctor", "--reps", "1", *flags],
                          capture_output=True, text=True, timeout=240, env={**os.environ, **(env or {})})


def threads(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


def refused(run: subprocess.CompletedProcess[str], needle: str) -> str:
    assert run.returncode == 2, (run.returncode, run.stderr[-2000:])
    assert "Traceback" not in run.stderr, run.stderr
    errors = [line for line in run.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and needle in errors[0], run.stderr
    return errors[0]


def check_advice(report: dict[str, Any]) -> None:
    """A lane gets a TCP warning exactly when UCX put it on TCP; both TCP: the push remedy for both."""
    lanes = report["memory"]["host"]["lanes"]
    tcp = {lane for lane, ts in lanes.items() if any(t.startswith("tcp") for t in ts)}
    for lane in ("push", "pull"):
        said = [w for w in report["warnings"] if w.startswith(f"!!! HOST {lane.upper()} lane falls back to TCP")]
        assert bool(said) == (lane in tcp), (lane, lanes, report["warnings"])
        if said:
            remedy = REMEDY["push"] if "push" in tcp else REMEDY[lane]
            assert said[0].endswith(f"Remedy: {remedy}."), said


def test_peer_reports_lanes_and_figures_and_frees_its_probe(tmp_path: Path) -> None:
    with worker(tmp_path) as decode:
        probe_url = f"{decode.url}/doctor/probe"
        # One probe first, so that the worker's helper threads exist before we count.
        status, opened = http(probe_url, "POST", {"bytes": BYTES})
        assert status == 200, opened
        assert http(f"{probe_url}/{opened['id']}", "DELETE")[0] == 200
        idle = threads(decode.pid)
        out = tmp_path / "doctor.json"
        run = doctor("--peer", decode.url + "/", "--bytes", str(BYTES), "--json", str(out))
        assert run.returncode == 0, run.stderr[-3000:]
        report = json.loads(out.read_text())
        peer = report["peer"]
        assert peer["url"] == decode.url and peer["role"] == "decode" and peer["name"] == "decode"
        assert peer["host"] == socket.gethostname() and peer["versions"]["ucx"][0].isdigit()
        host = report["memory"]["host"]
        assert host["lanes"]["push"] and host["lanes"]["pull"], host["lanes"]
        # On one host UCX takes cma (or tcp over loopback) between the two processes.
        assert all(t.split("/")[0] in ("cma", "tcp", "posix", "sysv", "xpmem", "knem") for lane in host["lanes"].values()
                   for t in lane), host["lanes"]
        for lane in ("push", "pull"):
            figures = host["figures"]["lanes"][lane]
            assert set(figures) == {str(64 << 10), str(1 << 20)}
            assert all(f["best_gbps"] > 0 for f in figures.values())
        assert host["figures"]["rows"]["contiguous_coalesced"]["best_gbps"] > 0
        assert host["target"]["bytes"] == BYTES and host["target"]["memory"] == "host"
        assert report["device_skipped"] == "the worker's pool is on cpu" or "no CUDA" in report["device_skipped"]
        check_advice(report)
        assert "push (write) lane:" in run.stdout and "with the worker on" in run.stdout
        assert "[doctor] host: push (WRITE) 64 KiB" in run.stderr
        # Freed: none active, and the probe agent's threads ended.
        status, now = http(probe_url)
        assert status == 200 and now["active"] is None, now
        assert threads(decode.pid) == idle
        assert "doctor probe" in decode.log_tail(200) and "freed" in decode.log_tail(200)


def test_both_lanes_on_tcp_get_the_push_remedy(tmp_path: Path) -> None:
    tcp = {"UCX_TLS": "tcp"}
    with worker(tmp_path, tcp) as decode:
        out = tmp_path / "doctor.json"
        run = doctor("--peer", decode.url, "--bytes", str(BYTES), "--strict", "--json", str(out), env=tcp)
        assert run.returncode == 1, run.stderr[-3000:]  # --strict: a lane on TCP is the exit status
        report = json.loads(out.read_text())
        lanes = report["memory"]["host"]["lanes"]
        assert all(t.startswith("tcp/") for lane in ("push", "pull") for t in lanes[lane]) and all(lanes.values())
        check_advice(report)
        assert "(push is TCP too: switching to push mode does not help)" in run.stdout
        assert run.stdout.count(f"Remedy: {REMEDY['push']}.") == 2
        assert http(f"{decode.url}/doctor/probe")[1]["active"] is None
        # No transport in common (this end offers no TCP): a lane that does not work is one line, not a traceback.
        line = refused(doctor("--peer", decode.url, "--bytes", str(1 << 20), "--timeout", "60",
                              env={"UCX_TLS": "cma,self"}), "the probe failed: RuntimeError: host probe failed")
        logs = re.search(r"\(log: (\S+)/initiator.log\)", line)
        assert logs, line  # the initiator's log is kept and named
        shutil.rmtree(logs.group(1))
        assert http(f"{decode.url}/doctor/probe")[1]["active"] is None  # freed all the same


def test_a_second_probe_is_refused_by_name(tmp_path: Path) -> None:
    with worker(tmp_path) as decode:
        probe_url = f"{decode.url}/doctor/probe"
        status, first = http(probe_url, "POST", {"bytes": 1 << 20})
        assert status == 200
        status, second = http(probe_url, "POST", {"bytes": 1 << 20})
        assert status == 409 and "one probe at a time" in second["error"], second
        line = refused(doctor("--peer", decode.url, "--bytes", str(BYTES)), "one probe at a time")
        assert first["id"] in line and decode.url in line
        assert http(probe_url)[1]["active"]["id"] == first["id"]  # the refused doctor left the first alone
        status, over = http(probe_url, "POST", {"bytes": 1 << 30})
        assert status == 400 and "256 MiB" in over["error"]
        assert http(f"{probe_url}/{first['id']}", "DELETE") == (200, {"id": first["id"], "freed": True})
        assert http(f"{probe_url}/{first['id']}", "DELETE")[0] == 404
        assert http(probe_url)[1]["active"] is None


class _Canned(BaseHTTPRequestHandler):
    """A server that is no kvxfer worker of this version: ``answers`` maps a path to (status, body)."""

    answers: dict[str, tuple[int, bytes]] = {}

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        status, body = self.answers.get(self.path, (404, b'{"error": "no GET here"}'))
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@contextmanager
def canned(answers: dict[str, tuple[int, bytes]]) -> Iterator[str]:
    handler = type("Handler", (_Canned,), {"answers": answers})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, name="canned-http", daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


def test_urls_it_cannot_probe_are_one_line() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free_port = s.getsockname()[1]
    refused(doctor("--peer", f"http://127.0.0.1:{free_port}"), "cannot reach it: connection refused")
    refused(doctor("--peer", "10.0.0.2:8101"), "is not a server's URL: give http://HOST:PORT")
    too_old = {"/health": (200, json.dumps({"status": "ok", "role": "prefill", "name": "p"}).encode())}
    with canned(too_old) as url:
        refused(doctor("--peer", url), "has no /doctor/probe route: its kvxfer predates `kvxfer doctor --peer`")
    with canned({"/health": (200, b"<html>hello</html>")}) as url:
        refused(doctor("--peer", url), "is not a kvxfer worker: GET /health answered")
    router = {"/health": (200, json.dumps({"status": "ok", "prefill": {}, "decode": {}}).encode())}
    with canned(router) as url:
        refused(doctor("--peer", url), "is not a kvxfer worker: its /health names no prefill or decode role "
                                       "(a kvxfer router?)")
    with canned({}) as url:
        refused(doctor("--peer", url), "is not a kvxfer worker (GET /health: HTTP 404")
