"""Start and stop worker and router processes without races or orphans.

Each child is ``python -m kvxfer.cli serve|router ... --parent-watch``, forked from a server
that has imported torch and kvxfer once (``forked.py``; ``forked=False`` starts a fresh
interpreter instead): it announces its
port as one JSON line on stdout once listening (no port guessing), logs to a file, and
exits when its stdin closes, so even a parent killed with SIGKILL leaves no child behind.
``stop()`` closes stdin, sends SIGTERM, waits, then SIGKILL: every path ends with the
process reaped. ``ProcessGroup`` is a context manager that stops all of its children on
success, error and Ctrl-C alike.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import IO, Any

from kvxfer.contract import KvxferError
from kvxfer.worker.forked import ForkedProcess

INTERPRETER_HELPERS = (b"multiprocessing.resource_tracker", b"multiprocessing.forkserver")


def end_process(proc: subprocess.Popen[bytes] | ForkedProcess, timeout: float = 10.0, *, grace: float = 5.0,
                send: Any = None) -> int | None:
    """Stop ``proc`` and reap it: close its stdin (a child with a parent watch takes that as
    the request) and wait up to ``grace``; then SIGTERM and wait ``timeout``; then SIGKILL and
    wait ``timeout``. ``send(sig)`` delivers a signal (default: to ``proc``; a launcher
    passes one that signals the process group). Its exit code; None if it outlived SIGKILL.

    No signal comes with the stdin close: a SIGTERM on its heels could land while the child's
    event loop hands its signals back to their default on the way out, and end it with -15."""
    deliver = send if send is not None else proc.send_signal
    if proc.stdin is not None and not proc.stdin.closed:
        try:
            proc.stdin.close()
        except OSError:
            pass
    for wait, sig in ((min(grace, timeout), None), (timeout, signal.SIGTERM), (timeout, signal.SIGKILL)):
        if sig is not None and proc.poll() is None:
            deliver(sig)
        try:
            return proc.wait(wait)
        except subprocess.TimeoutExpired:
            continue
    return proc.poll()


def children_of(pid: int) -> list[int]:
    """Live (not zombie) processes whose parent is ``pid``, read from /proc (Linux).

    Python's own multiprocessing helpers (the resource tracker that any ``spawn`` context
    starts once per interpreter, the fork server) are left out: they live as long as the
    interpreter and exit when it does, so they are no process a job forgot to stop."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2:].split()
        if int(fields[1]) != pid or fields[0] == "Z":
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if not any(helper in cmdline for helper in INTERPRETER_HELPERS):
            out.append(int(entry.name))
    return out


def port_open(port: int, host: str = "127.0.0.1") -> bool:
    """True when something accepts TCP connections on ``host:port``."""
    import socket  # noqa: PLC0415

    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex((host, port)) == 0


class ProcessFailed(KvxferError):
    """A child exited or stayed silent before announcing that it was ready."""


class Child:
    def __init__(self, name: str, argv: list[str], log_path: Path, env: dict[str, str] | None = None,
                 *, forked: bool = True) -> None:
        self.name = name
        self.argv = argv
        self.log_path = log_path
        self._log: IO[bytes] = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc: subprocess.Popen[bytes] | ForkedProcess
        if forked:
            self.proc = ForkedProcess([*argv, "--parent-watch"], self._log, env)
        else:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "kvxfer.cli", *argv, "--parent-watch"],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, env=env,
            )
        self.info: dict[str, Any] = {}
        self._buf = b""

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def url(self) -> str:
        return str(self.info["url"])

    @property
    def port(self) -> int:
        return int(self.info["port"])

    def wait_ready(self, timeout: float) -> dict[str, Any]:
        """Read the ready line (the child writes nothing else on stdout)."""
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            while b"\n" not in self._buf:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ProcessFailed(f"{self.name} did not announce readiness within {timeout:.0f}s; "
                                        f"log: {self.log_path}\n{self.log_tail()}")
                if sel.select(left):
                    chunk = os.read(self.proc.stdout.fileno(), 4096)
                    if not chunk:
                        code = self.proc.wait(5)
                        raise ProcessFailed(f"{self.name} exited with {code} before it was ready; "
                                            f"log: {self.log_path}\n{self.log_tail()}")
                    self._buf += chunk
        line = self._buf.split(b"\n", 1)[0]
        try:
            self.info = json.loads(line)
        except ValueError:
            raise ProcessFailed(f"{self.name} announced {line[:200]!r}, not a JSON ready line") from None
        return self.info

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL now (chaos tests); ``stop()`` still reaps."""
        if self.alive():
            self.proc.send_signal(signal.SIGKILL)

    def signal_stop(self) -> None:
        """Ask the child to stop without waiting: close its stdin, which its parent watch
        (``--parent-watch``) takes as the request. No signal yet: a SIGTERM on the heels of
        that request could land while the child's loop hands its signals back to their
        default action on the way out, and end it with -15 (see ``stop``)."""
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            try:
                self.proc.stdin.close()
            except OSError:
                pass

    def stop(self, timeout: float = 10.0) -> int:
        """Close stdin (the child's parent watch) and wait; then SIGTERM and wait; then
        SIGKILL: always reaped (``end_process``)."""
        try:
            code = end_process(self.proc, timeout)
            return self.proc.wait(timeout) if code is None else code
        finally:
            if self.proc.stdout is not None:
                self.proc.stdout.close()
            self._log.close()

    def log_tail(self, lines: int = 20) -> str:
        try:
            text = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(text[-lines:])


class ProcessGroup:
    """Children started together; ``with`` stops every one of them, whatever happens."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.children: list[Child] = []

    def start(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> Child:
        child = Child(name, argv, self.log_dir / f"{name}.log", env)
        self.children.append(child)
        return child

    def wait_ready(self, children: list[Child], timeout: float = 120.0) -> None:
        """Started in parallel, awaited together: startup costs the slowest child, not the sum."""
        for child in children:
            child.wait_ready(timeout)

    def stop(self) -> dict[str, int]:
        codes = {}
        for child in reversed(self.children):  # all at once: they shut down in parallel
            try:
                child.signal_stop()
            except OSError:
                pass
        for child in reversed(self.children):
            try:
                codes[child.name] = child.stop()
            except Exception as exc:  # keep stopping the others
                codes[child.name] = -1
                print(f"kvxfer: stopping {child.name} failed: {exc}", file=sys.stderr)
        return codes

    def __enter__(self) -> ProcessGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
