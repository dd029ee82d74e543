"""A real etcd server for tests: ``etcd`` (Debian's etcd-server, which ci/setup.sh installs)
on free loopback ports, in a data folder of its own, stopped and removed at the end.

``pause()``/``resume()`` stop and continue the process (etcd unreachable but not gone: calls
time out); ``stop()`` ends it (calls are refused).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path
from types import TracebackType

ETCD_BINARY = "etcd"


def etcd_binary() -> str | None:
    return shutil.which(ETCD_BINARY)


def _free_port(host: str) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


class EtcdServer:
    """``with EtcdServer() as etcd:`` ... ``etcd.endpoint`` is ``http://127.0.0.1:PORT``."""

    def __init__(self, host: str = "127.0.0.1", *, start_timeout_s: float = 20.0) -> None:
        binary = etcd_binary()
        if binary is None:
            raise FileNotFoundError("etcd is not installed (apt-get install etcd-server; ci/setup.sh does)")
        self.host = host
        self.port = _free_port(host)
        self.peer_port = _free_port(host)
        self.endpoint = f"http://{host}:{self.port}"
        self._dir = Path(tempfile.mkdtemp(prefix="kvxfer-etcd-"))
        self._log = open(self._dir / "etcd.log", "wb")  # noqa: SIM115 - closed in stop()
        self.process = subprocess.Popen(
            [binary, "--name", "kvxfer-test", "--data-dir", str(self._dir / "data"),
             "--listen-client-urls", self.endpoint, "--advertise-client-urls", self.endpoint,
             "--listen-peer-urls", f"http://{host}:{self.peer_port}",
             "--initial-advertise-peer-urls", f"http://{host}:{self.peer_port}",
             "--initial-cluster", f"kvxfer-test=http://{host}:{self.peer_port}"],
            stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            self._wait_healthy(start_timeout_s)
        except BaseException:
            self.stop()
            raise

    def _wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"etcd exited {self.process.returncode}: {self.log_tail()}")
            if self.healthy():
                return
            time.sleep(0.1)
        raise TimeoutError(f"etcd at {self.endpoint} not healthy after {timeout_s} s: {self.log_tail()}")

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.endpoint}/health", timeout=1) as answer:
                return b'"true"' in answer.read()
        except OSError:
            return False

    def log_tail(self, size: int = 2000) -> str:
        self._log.flush()
        text = (self._dir / "etcd.log").read_bytes()[-size:]
        return text.decode("utf-8", "replace")

    def pause(self) -> None:
        os.kill(self.process.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self.process.pid, signal.SIGCONT)

    def stop(self) -> None:
        if self.process.poll() is None:
            try:
                os.kill(self.process.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        self._log.close()
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> EtcdServer:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
