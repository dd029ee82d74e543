"""What each of ``kvxfer launch``'s actors runs: one process tree on its Ray node.

The classes are plain Python (no Ray import at module level): the launcher makes them actors
with ``ray.remote``, and tests run them in a process of their own. Inside an actor they read
their node from Ray: its address (``--host``: the others reach it there), its id, and the GPUs
Ray gave the actor, which become the process's ``CUDA_VISIBLE_DEVICES`` (empty when it was
given none, so a worker never uses a GPU that Ray did not give it). Outside Ray they serve on
127.0.0.1 with no GPU.

Each process starts in a session of its own (its own process group), with a pipe on its stdin:

- ``stop()`` closes the pipe (``kvxfer serve``/``router --parent-watch``, and ``guard`` for
  etcd, take that as the request to stop), then sends SIGTERM to the whole group, then SIGKILL:
  the tree ends, children included. Ray's ``ray.kill`` alone would not end it: a process in a
  session of its own outlives the actor process that started it.
- an actor process killed outright (``ray.kill``, its driver gone) closes the pipe as it dies,
  so the process still stops, gracefully: a worker takes itself out of etcd first.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import IO, Any

from kvxfer.worker.procs import end_process

STOP_GRACE_S = 5.0
"""How long ``stop()`` waits after closing stdin before it sends SIGTERM."""
_POLL_S = 0.1


def node_context() -> tuple[str, str, list[str]]:
    """(node id, node address, GPU ids) of the Ray node this runs on; outside a Ray worker
    ("", "127.0.0.1", [])."""
    try:
        import ray  # noqa: PLC0415 - the extra; an actor always has it
    except ImportError:
        return "", "127.0.0.1", []
    if not ray.is_initialized():
        return "", "127.0.0.1", []
    gpus = [str(g) for g in ray.get_gpu_ids()]
    return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address(), gpus


def default_log_dir(namespace: str) -> Path:
    """Where an actor keeps its process's log on its node when no ``--log-dir`` is given."""
    return Path(tempfile.gettempdir()) / "kvxfer-launch" / namespace


def free_port(host: str) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


class ProcessTree:
    """One command in a session of its own on this node, logging to ``LOG_DIR/NAME.log``."""

    def __init__(self, name: str, log_dir: str | Path) -> None:
        self.name = name
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = self.log_dir / f"{name}.log"
        self.node_id, self.node_ip, self.gpu_ids = node_context()
        self.proc: subprocess.Popen[bytes] | None = None
        self.problem = ""          # why it could not start (ready() reports it)
        self.info: dict[str, Any] = {}
        self._log: IO[bytes] | None = None
        self._stopping = threading.Event()
        self._lock = threading.Lock()

    def _start(self, argv: list[str], env: dict[str, str]) -> None:
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=self._log,
                                     env=env, start_new_session=True)

    # --- asked by the launcher ---------------------------------------------------------------
    def where(self) -> dict[str, Any]:
        """Where it runs: node, process, GPUs, log."""
        pid = self.proc.pid if self.proc is not None else None
        return {"name": self.name, "node_id": self.node_id, "node_ip": self.node_ip, "pid": pid,
                "pgid": pid, "gpu_ids": list(self.gpu_ids), "log": str(self.log_path),
                "cuda_visible_devices": ",".join(self.gpu_ids), "actor_pid": os.getpid()}

    def alive(self) -> dict[str, Any]:
        """Whether its process still runs, and its exit code when not."""
        code = self.proc.poll() if self.proc is not None else None
        return {"alive": self.proc is not None and code is None, "code": code}

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def ready(self, timeout: float) -> dict[str, Any]:
        """Wait until it serves: ``where()`` plus ``ok`` and what it announced, or ``ok`` False
        and ``error`` (with its log's tail). Never raises: the launcher prints the error."""
        deadline = time.monotonic() + timeout
        if self.problem or self.proc is None:
            return {**self.where(), "ok": False, "error": self.problem or f"{self.name} did not start"}
        while not self._stopping.is_set():
            code = self.proc.poll()
            if code is not None:
                return self._failed(f"{self.name} exited with {code} before it was ready")
            found = self._check_ready()
            if found is not None:
                self.info = found
                return {**self.where(), **found, "ok": True}
            if time.monotonic() > deadline:
                return self._failed(f"{self.name} was not ready within {timeout:.0f} s")
            time.sleep(_POLL_S)
        return self._failed(f"{self.name} was stopped before it was ready")

    def _failed(self, why: str) -> dict[str, Any]:
        tail = self.log_tail()
        return {**self.where(), "ok": False, "error": f"{why} (log {self.log_path} on {self.node_ip})"
                + (f":\n{tail}" if tail else "")}

    def _check_ready(self) -> dict[str, Any] | None:
        raise NotImplementedError

    def stop(self, timeout: float = 10.0) -> int | None:
        """End the whole process tree: close stdin (a graceful stop), wait; SIGTERM to the
        process group, wait; SIGKILL. Its exit code (None: it never started)."""
        self._stopping.set()
        with self._lock:
            if self.proc is None:
                return None
            code = self._end(timeout)
            self._signal_group(signal.SIGKILL)  # what its children left behind in its group
            if self._log is not None:
                self._log.close()
            self._cleanup()
            return code

    def _end(self, timeout: float) -> int | None:
        assert self.proc is not None
        return end_process(self.proc, timeout, grace=STOP_GRACE_S, send=self._signal_group)

    def _signal_group(self, sig: int) -> None:
        assert self.proc is not None
        try:
            os.killpg(self.proc.pid, sig)  # its own session: the group's id is its pid
        except (ProcessLookupError, PermissionError):
            pass

    def _cleanup(self) -> None:
        """What a subclass removes once its process ended."""


class KvxferProcess(ProcessTree):
    """``kvxfer serve`` or ``kvxfer router`` (``argv`` after ``kvxfer``), on this node's address.

    The actor adds ``--host`` (the node's address unless ``host`` is given), ``--port``,
    ``--port-file`` and ``--parent-watch``; with ``set_device``, ``--device cuda:0`` when Ray
    gave it GPUs, else ``--device cpu``."""

    def __init__(self, name: str, argv: list[str], *, log_dir: str | Path, port: int = 0, host: str = "",
                 set_device: bool = False, env: dict[str, str] | None = None) -> None:
        super().__init__(name, log_dir)
        self.port_file = self.log_dir / f"{name}.port"
        self.port_file.unlink(missing_ok=True)
        self.host = host or self.node_ip
        full = [sys.executable, "-m", "kvxfer.cli", *argv, "--host", self.host, "--port", str(port),
                "--port-file", str(self.port_file), "--parent-watch"]
        if set_device:
            full += ["--device", "cuda:0" if self.gpu_ids else "cpu"]
        environment = {**os.environ, "NIXL_LOG_LEVEL": os.environ.get("NIXL_LOG_LEVEL", "WARN"), **(env or {}),
                       "CUDA_VISIBLE_DEVICES": ",".join(self.gpu_ids)}
        self._start(full, environment)

    def _check_ready(self) -> dict[str, Any] | None:
        try:
            line = self.port_file.read_text().strip()
        except OSError:
            return None
        if not line:
            return None
        info = json.loads(line)
        url = str(info["url"])
        if self.host in ("0.0.0.0", "::", ""):  # a wildcard bind: others reach it at the node's address
            url = f"http://{self.node_ip}:{info['port']}"
        out = {"url": url, "port": int(info["port"]), "role": info.get("role", "")}
        if "device" in info:
            out["device"] = info["device"]
        return out

    def url(self) -> str:
        return str(self.info.get("url", ""))

    def health(self, timeout: float = 5.0) -> dict[str, Any]:
        """Its ``GET /health``, from this node: ``{"status": HTTP status, "body": JSON}``, or
        ``{"error": why}`` when it does not answer."""
        if not self.info:
            return {"error": f"{self.name} is not serving"}
        try:
            with urllib.request.urlopen(self.url() + "/health", timeout=timeout) as answer:
                return {"status": answer.status, "body": json.loads(answer.read())}
        except urllib.error.HTTPError as exc:  # 503: the body still says why
            try:
                return {"status": exc.code, "body": json.loads(exc.read())}
            except ValueError:
                return {"status": exc.code, "body": None}
        except (OSError, ValueError) as exc:
            return {"error": f"{self.name} at {self.url()}: {exc}"}


class EtcdProcess(ProcessTree):
    """A single-member etcd on this node's address, in a data folder of its own (removed at
    ``stop()``), under ``kvxfer.launch.guard`` so that it ends with its actor."""

    def __init__(self, name: str, *, log_dir: str | Path, binary: str = "etcd") -> None:
        super().__init__(name, log_dir)
        path = shutil.which(binary)
        self.data_dir = ""
        self.endpoint = ""
        if path is None:
            self.problem = (f"{binary} is not installed on the head node ({self.node_ip}): install it there "
                            "(apt-get install etcd-server), or give --etcd http://HOST:PORT of a running etcd")
            return
        self.data_dir = tempfile.mkdtemp(prefix="kvxfer-etcd-")
        self.endpoint = f"http://{self.node_ip}:{free_port(self.node_ip)}"
        peer = f"http://127.0.0.1:{free_port('127.0.0.1')}"
        argv = [sys.executable, "-m", "kvxfer.launch.guard", path, "--name", name, "--data-dir",
                str(Path(self.data_dir) / "data"), "--listen-client-urls", self.endpoint,
                "--advertise-client-urls", self.endpoint, "--listen-peer-urls", peer,
                "--initial-advertise-peer-urls", peer, "--initial-cluster", f"{name}={peer}"]
        self._start(argv, dict(os.environ))

    def _check_ready(self) -> dict[str, Any] | None:
        try:
            with urllib.request.urlopen(f"{self.endpoint}/health", timeout=1) as answer:
                healthy = b'"true"' in answer.read()
        except OSError:
            return None
        return {"url": self.endpoint, "role": "etcd"} if healthy else None

    def url(self) -> str:
        return self.endpoint

    def _cleanup(self) -> None:
        if self.data_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)
