"""Served processes (``kvxfer serve``, ``kvxfer router``) forked from a server that has
imported torch and kvxfer once, behind the small part of ``subprocess.Popen`` that
``Child`` and ``end_process`` use.

Why: a worker started as a fresh interpreter spends about 3 of its 4 CPU seconds to ready
importing torch and kvxfer again. ``kvxfer pair``, ``kvxfer up`` and the reliability
harness start several workers (and restart killed ones): on a 2-core machine each one
delays the others. multiprocessing's fork server imports them once
(``set_forkserver_preload``) and forks each child from that clean, single-threaded
process: nothing of the caller (its threads, locks, event loop or CUDA context) is copied,
which is why ``fork`` itself is not used. The server never touches CUDA (importing torch
does not initialise it), so each child still picks its own device.

A caller that imports torch anyway (``kvxfer pair`` run as the command, for its oracle) makes
the server a fork of itself instead (``fork_server_here``), so that torch is not imported a second time in a
fresh interpreter: about 3 CPU seconds, and as many of wall time before the first worker
starts, since starting the first child waits for the server's imports.

A forked child runs what ``python -m kvxfer.cli ARGV`` would run, with the caller's
environment and the three standard descriptors it was given. Its parent in /proc is the
fork server; its exit status still comes back (as multiprocessing reports it: -N for a
signal), and its stdin still closes when the caller dies, which is what ``--parent-watch``
waits for.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import multiprocessing as mp
import os
import socket
import subprocess
import sys
import threading
import time
import types
from collections.abc import Iterator
from multiprocessing import connection, forkserver, resource_tracker
from multiprocessing.reduction import DupFd
from typing import IO, Any

# What a served process imports on its way to ready: loaded once in the fork server.
PRELOAD = ("torch", "aiohttp", "kvxfer.cli", "kvxfer.worker.serve", "kvxfer.worker.app", "kvxfer.router.serve",
           "kvxfer.router", "kvxfer.bench", "kvxfer.engine")
_extra: list[str] = []


_imported: dict[int, frozenset[str]] = {}  # a fork server this module started (pid) -> what it imported


def preload(*modules: str) -> None:
    """Import ``modules`` in the fork server too: ``kvxfer pair --engine transformers`` adds the
    transformers engine, whose import is several CPU seconds that each worker would spend
    again. A server already running without them (started for other children of this process:
    another test module's, or the test kit's peers) is replaced at the next child, once none of
    this process's children is left."""
    _extra.extend(m for m in modules if m not in _extra)


def _context() -> Any:
    ctx = mp.get_context("forkserver")
    server = forkserver._forkserver
    running = server._forkserver_pid
    if (running is not None and not set(_extra) <= _imported.get(running, frozenset())
            and not mp.active_children() and hasattr(server, "_stop")):
        # Each child would import what preload() asked for itself (transformers: 6-9 CPU-s a
        # worker, against one server's start); with no child left, nothing uses the old one.
        server._stop()
    ctx.set_forkserver_preload([*PRELOAD, *_extra])  # read when the server starts: at the first child
    return ctx


@contextlib.contextmanager
def fork_server_here() -> Iterator[bool]:
    """Within the block, the fork server is a fork of this process, with ``PRELOAD`` and
    ``preload()``'s modules imported here first, rather than a fresh interpreter started at the
    first child; it is stopped and reaped when the block ends (its children stopped first), so
    that a caller in a longer-lived process (a script, a test) leaves none behind. Yields False
    where it cannot be (another thread runs here: its locks would be copied held; a server runs
    already; a Python whose fork server authenticates its clients): the first child then starts
    a fresh one as before, which lives as long as this process.

    Enter it before the caller does anything the children must not inherit (threads, an event
    loop, CUDA, torch's thread count), and only in a process whose state is kvxfer's own: the
    server is this process as it is now, and each child runs its exit handlers and finalizers
    (a calling script's ``TemporaryDirectory`` would be removed by the first worker to exit)."""
    server = forkserver._forkserver  # multiprocessing's own: ForkedProcess's context uses it
    if threading.active_count() > 1 or hasattr(server, "_forkserver_authkey"):  # 3.14 added a key
        yield False
        return
    for module in (*PRELOAD, *_extra):
        importlib.import_module(module)
    with server._lock:
        started = server._forkserver_pid is None
        if started:
            pid = _fork_server(server)
    try:
        yield started
    finally:
        if started:
            _stop_server(server, pid)


def _fork_server(server: Any) -> int:
    """The fork server as a fork of this process (``server._lock`` held): what a fresh one would
    hold (the standard descriptors, the listener, the alive pipe), then multiprocessing's loop."""
    resource_tracker.ensure_running()  # its descriptor goes to each child, as multiprocessing does
    with socket.socket(socket.AF_UNIX) as listener:
        address = connection.arbitrary_address("AF_UNIX")
        listener.bind(address)
        os.chmod(address, 0o600)
        listener.listen()
        alive_r, alive_w = os.pipe()  # EOF when this process and every child have closed it
        pid = os.fork()
        if pid == 0:  # the server: what a fresh one would hold, then multiprocessing's loop
            code = 1
            try:
                keep = sorted({0, 1, 2, listener.fileno(), alive_r})
                for low, high in zip([-1, *keep], [*keep, os.sysconf("SC_OPEN_MAX")]):
                    if high > low + 1:  # closerange(n, n) closes every descriptor from n up
                        os.closerange(low + 1, high)
                forkserver.main(listener.fileno(), alive_r, [])
            except SystemExit:
                code = 0
            finally:
                os._exit(code)
        os.close(alive_r)
    server._forkserver_address, server._forkserver_alive_fd, server._forkserver_pid = address, alive_w, pid
    _imported[pid] = frozenset((*PRELOAD, *_extra))
    return pid


def _stop_server(server: Any, pid: int, timeout: float = 5.0) -> None:
    """Close this process's end of the server's alive pipe and reap the server, so that no copy
    of this process outlives the block (its command line is this one's, not a helper's). The
    server ends once every child has closed its end too; one still running is not waited for."""
    with server._lock:
        if server._forkserver_pid != pid:
            return
        os.close(server._forkserver_alive_fd)
        address = server._forkserver_address
        server._forkserver_pid = server._forkserver_alive_fd = server._forkserver_address = None
        deadline = time.monotonic() + timeout
        try:
            while os.waitpid(pid, os.WNOHANG)[0] == 0 and time.monotonic() < deadline:
                time.sleep(0.01)
        except ChildProcessError:
            pass  # reaped already
        try:
            os.unlink(address)
        except OSError:
            pass


def _standard_stream(fd: int, mode: str) -> IO[Any]:
    return open(fd, mode, buffering=1, encoding="utf-8", errors="backslashreplace", closefd=False)  # noqa: SIM115


def _run_cli(environ: dict[str, str], cwd: str, argv: list[str], stdin: Any, stdout: Any, stderr: Any) -> None:
    """The child: take the caller's environment, directory and descriptors, run the command,
    exit as the interpreter would (atexit handlers included, which multiprocessing skips)."""
    os.environ.clear()
    os.environ.update(environ)
    os.chdir(cwd)  # the server's is the caller's when the server started
    for fd, passed in ((0, stdin), (1, stdout), (2, stderr)):
        received = passed.detach()
        os.dup2(received, fd)
        os.close(received)
    sys.stdin, sys.stdout, sys.stderr = (_standard_stream(0, "r"), _standard_stream(1, "w"),
                                         _standard_stream(2, "w"))
    sys.argv = [sys.executable, *argv]
    from kvxfer.cli import main  # noqa: PLC0415 - preloaded: a lookup

    try:
        code = main(argv)
    finally:
        atexit._run_exitfuncs()
    sys.exit(code)


def _start_without_main(proc: Any) -> None:
    """``proc.start()`` with the caller's ``__main__`` hidden: multiprocessing would run the
    caller's script again in the child (as ``__mp_main__``), and a script that starts a
    ``kvxfer pair`` at module level, with no ``if __name__ == "__main__"`` guard, would then
    start it again in each worker. The child needs nothing from it: it runs the kvxfer CLI."""
    main = sys.modules["__main__"]
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        proc.start()
    finally:
        sys.modules["__main__"] = main


class ForkedProcess:
    """A started ``python -m kvxfer.cli ARGV`` forked from the fork server: ``pid``,
    ``stdin`` (writable, binary), ``stdout`` (readable, binary), ``poll``, ``wait``,
    ``send_signal`` and ``returncode`` as ``subprocess.Popen`` has them."""

    def __init__(self, argv: list[str], stderr: IO[bytes], env: dict[str, str] | None = None) -> None:
        stdin_r, stdin_w = os.pipe()
        stdout_r, stdout_w = os.pipe()
        try:
            ctx = _context()
            starts = forkserver._forkserver._forkserver_pid is None
            self._proc = ctx.Process(
                target=_run_cli, name=f"kvxfer {argv[0] if argv else ''}".strip(),
                args=(dict(os.environ) if env is None else dict(env), os.getcwd(), list(argv),
                      DupFd(stdin_r), DupFd(stdout_w), DupFd(stderr.fileno())))
            _start_without_main(self._proc)
            if starts:
                _imported[forkserver._forkserver._forkserver_pid] = frozenset((*PRELOAD, *_extra))
        except BaseException:
            for fd in (stdin_w, stdout_r):
                os.close(fd)
            raise
        finally:
            for fd in (stdin_r, stdout_w):  # the child has its own copies now
                os.close(fd)
        self.pid: int = self._proc.pid
        self.args = argv
        self.stdin: IO[bytes] | None = open(stdin_w, "wb", buffering=0)  # noqa: SIM115 - closed by end_process
        self.stdout: IO[bytes] | None = open(stdout_r, "rb", buffering=0)  # noqa: SIM115 - closed by Child.stop
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._proc.exitcode
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self._proc.join(timeout)
        code = self.poll()
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return code

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        import signal  # noqa: PLC0415

        self.send_signal(signal.SIGKILL)
