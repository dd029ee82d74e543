"""A Mooncake master process: the store's directory, which the ``MooncakeDriver`` clients
of a cluster share (it keeps no blob bytes itself; the clients' segments do).

From Python (tests, examples, one-host set-ups)::

    with MooncakeMaster() as master:               # free ports on 127.0.0.1
        driver = MooncakeDriver(master.address)

From a shell, in the foreground until Ctrl-C or SIGTERM::

    python -m kvxfer.backends.blob.mooncake_master --port 50051

The master runs without eviction (``--eviction_high_watermark_ratio=1.0 --eviction_ratio=0``): a put past the
segments' capacity is refused (FULL) instead of silently dropping older blobs; ``evict=True``
(``--evict``) lets Mooncake evict. Its output goes to a log file, not the console.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import weakref
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

from kvxfer.backends.blob.driver import StoreError
from kvxfer.backends.blob.mooncake import MooncakeDriver

BINARY = "mooncake_master"
DEFAULT_PORT = 50051
LEASE_TTL_MS = 2000   # how long a read blob is protected from removal; shorter than a batch get fails it
CLIENT_TTL_S = 2      # how soon the master forgets a client that stopped heart-beating (and its blobs)
START_TIMEOUT_S = 15.0
STOP_TIMEOUT_S = 5.0


def find_binary() -> str:
    """The ``mooncake_master`` command: beside this Python (a venv's bin), else on PATH."""
    beside = Path(sys.executable).parent / BINARY
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    found = shutil.which(BINARY)
    if found is None:
        raise StoreError(f"{BINARY} not found beside {sys.executable} nor on PATH: pip install 'kvxfer[store]'")
    return found


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def port_free(host: str, port: int) -> bool:
    """Whether nothing listens on ``port`` (a socket may still bind it over old connections)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


def _reap(proc: subprocess.Popen[bytes], timeout_s: float, log: Path | None = None) -> None:
    """SIGTERM, then SIGKILL if it has not exited within ``timeout_s``; always waited for. Then
    removes ``log``, if given."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.terminate()
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
    proc.wait()
    if log is not None:
        log.unlink(missing_ok=True)


class MooncakeMaster:
    """A ``mooncake_master`` child process listening on ``address`` ("host:port") once the
    constructor returns. ``port``/``metrics_port``: free ones unless given; ``stop()`` ends it
    (idempotent), ``kill()`` kills it at once (fault tests); a context manager stops it."""

    def __init__(self, *, port: int | None = None, metrics_port: int | None = None, host: str = "127.0.0.1",
                 lease_ttl_ms: int = LEASE_TTL_MS, client_ttl_s: int = CLIENT_TTL_S, evict: bool = False,
                 extra_args: Sequence[str] = (), log_path: str | os.PathLike[str] | None = None,
                 start_timeout_s: float = START_TIMEOUT_S, binary: str | None = None) -> None:
        self.host = host
        self.binary = binary or find_binary()
        for given in (port, metrics_port):
            if given is not None and not port_free(host, given):
                raise StoreError(f"port {given} on {host} is in use (another mooncake master?)")
        self._own_log = log_path is None
        if log_path is None:
            fd, name = tempfile.mkstemp(prefix="kvxfer-mooncake-master-", suffix=".log")
            os.close(fd)
            log_path = name
        self.log_path = Path(log_path)
        self._stopped = False
        flags = [f"--default_kv_lease_ttl={lease_ttl_ms}", f"--client_ttl={client_ttl_s}",
                 # Both, for no eviction: a put that finds the store full makes Mooncake evict
                 # eviction_ratio of the blobs whatever the watermark (its EvictionThreadFunc).
                 *([] if evict else ["--eviction_high_watermark_ratio=1.0", "--eviction_ratio=0"]), *extra_args]
        attempts = 3 if port is None or metrics_port is None else 1  # a free port may be taken meanwhile
        for attempt in range(attempts):
            if self._start(port or free_port(host), metrics_port or free_port(host), flags, start_timeout_s,
                           last=attempt == attempts - 1):
                return

    def _start(self, port: int, metrics_port: int, flags: list[str], timeout_s: float, *, last: bool) -> bool:
        self.port = port
        self.metrics_port = metrics_port
        self.command = [self.binary, f"--rpc_address={self.host}", f"--rpc_port={port}",
                        f"--metrics_host={self.host}", f"--metrics_port={metrics_port}", *flags]
        with open(self.log_path, "ab") as log:
            try:
                self._proc = subprocess.Popen(self.command, stdin=subprocess.DEVNULL, stdout=log,
                                              stderr=subprocess.STDOUT, start_new_session=True)
            except OSError as exc:
                if self._own_log:
                    self.log_path.unlink(missing_ok=True)
                raise StoreError(f"cannot run {self.binary}: {exc.strerror or exc}") from None
        # Reaps the master (and drops its own log) if the object goes without stop(), or at exit.
        self._finalizer = weakref.finalize(self, _reap, self._proc, STOP_TIMEOUT_S,
                                           self.log_path if self._own_log else None)
        return self._wait_listening(timeout_s, last=last)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def pid(self) -> int:
        return self._proc.pid

    def running(self) -> bool:
        return self._proc.poll() is None

    def _wait_listening(self, timeout_s: float, *, last: bool) -> bool:
        """True once the rpc port accepts connections; False when the master exited early and
        another attempt may follow; StoreError otherwise."""
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            if self._proc.poll() is not None:
                if not last:
                    self._finalizer.detach()
                    return False
                self._fail(f"exited with status {self._proc.returncode} before listening on {self.address}")
            try:
                socket.create_connection((self.host, self.port), 0.2).close()
                return True
            except OSError:
                time.sleep(0.02)
        self._fail(f"did not listen on {self.address} within {timeout_s:g}s")
        return False  # unreachable: _fail raises

    def _fail(self, what: str) -> None:
        self._finalizer.detach()
        _reap(self._proc, STOP_TIMEOUT_S)  # its log stays, for the error
        self._stopped = True
        raise StoreError(f"mooncake master ({' '.join(self.command)}) {what}; log {self.log_path}:\n"
                         f"{self.log_tail()}")

    def log_tail(self, lines: int = 20) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> int:
        """SIGTERM, SIGKILL after ``timeout_s``; returns the exit status. Idempotent. Removes the
        log file it made itself."""
        if not self._stopped:
            self._stopped = True
            self._finalizer.detach()
            _reap(self._proc, timeout_s, self.log_path if self._own_log else None)
        return int(self._proc.wait())

    def kill(self) -> None:
        """SIGKILL now, as a crash would (waited for; ``stop`` still cleans up)."""
        if self._proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self._proc.kill()
        self._proc.wait()

    def __enter__(self) -> MooncakeMaster:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "running" if self.running() else f"exited {self._proc.returncode}"
        return f"MooncakeMaster({self.address}, pid {self.pid}, {state})"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvxfer.backends.blob.mooncake_master",
                                     description="Run a Mooncake master in the foreground until Ctrl-C or SIGTERM.")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"rpc port (default {DEFAULT_PORT})")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--metrics-port", type=int, default=None, help="metrics port (default: a free one)")
    parser.add_argument("--lease-ttl-ms", type=int, default=LEASE_TTL_MS, help="lease of a read blob (ms)")
    parser.add_argument("--evict", action="store_true", help="evict old blobs when full instead of refusing puts")
    parser.add_argument("--log", default=None, help="the master's log file (default: a temporary file)")
    parser.add_argument("--segment-mib", type=int, default=0,
                        help="also hold this much of the store's memory in this process (at least 16), so that "
                             "blobs outlive the workers that put them (workers with --store-segment-mib 0)")
    args = parser.parse_args(argv)
    if args.segment_mib and args.segment_mib < 16:
        parser.error(f"--segment-mib must be 0 or at least 16 (Mooncake's least segment), got {args.segment_mib}")
    stop: list[int] = []  # the signals that asked to stop
    previous = {sig: signal.signal(sig, lambda sig, _frame: stop.append(sig)) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        return _serve(args, stop)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _serve(args: argparse.Namespace, stop: list[int]) -> int:
    try:
        master = MooncakeMaster(port=args.port, metrics_port=args.metrics_port, host=args.host,
                                lease_ttl_ms=args.lease_ttl_ms, evict=args.evict, log_path=args.log)
    except StoreError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    holder: MooncakeDriver | None = None
    try:
        print(f"mooncake master listening on {master.address}", flush=True)
        print(f"its log: {master.log_path}", flush=True)
        if args.segment_mib:
            holder = MooncakeDriver(master.address, segment_bytes=args.segment_mib << 20, host=args.host)
            print(f"holding {args.segment_mib} MiB of the store's memory", flush=True)
        while master.running() and not stop:
            time.sleep(0.2)
    except StoreError as exc:
        print(f"error: {exc}", file=sys.stderr)
        master.stop()
        return 1
    finally:
        if holder is not None:
            holder.close()
        died = not master.running()
        tail = master.log_tail() if died else ""
        status = master.stop()
        if died:
            print(f"mooncake master exited with status {status}; its log ended:\n{tail}", file=sys.stderr)
    return 1 if died else 0


if __name__ == "__main__":
    sys.exit(main())
