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

A forked child runs what ``python -m kvxfer.cli ARGV`` would run, with the caller's
environment and the three standard descriptors it was given. Its parent in /proc is the
fork server; its exit status still comes back (as multiprocessing reports it: -N for a
signal), and its stdin still closes when the caller dies, which is what ``--parent-watch``
waits for.
"""

from __future__ import annotations

import atexit
import importlib
import multiprocessing as mp
import os
import subprocess
import sys
import types
from multiprocessing.reduction import DupFd
from typing import IO, Any

# What a served process imports on its way to ready: loaded once in the fork server.
PRELOAD = ("torch", "aiohttp", "kvxfer.cli", "kvxfer.worker.serve", "kvxfer.worker.app", "kvxfer.router.serve",
           "kvxfer.router", "kvxfer.bench", "kvxfer.engine")


def _context(preload: tuple[str, ...] = ()) -> Any:
    ctx = mp.get_context("forkserver")
    # Read when the server starts (at the first child); a child of a server started with
    # another list imports what it misses itself.
    ctx.set_forkserver_preload([*PRELOAD, *preload])
    return ctx


def _standard_stream(fd: int, mode: str) -> IO[Any]:
    return open(fd, mode, buffering=1, encoding="utf-8", errors="backslashreplace", closefd=False)  # noqa: SIM115


def _run_main(environ: dict[str, str], cwd: str, main: str, argv: list[str], std: list[Any],
              passed: list[Any]) -> None:
    """The child: take the caller's environment, directory and descriptors, run
    ``main(argv)`` (``"{fdN}"`` in argv stands for the Nth passed descriptor's number here),
    and exit as the interpreter would (atexit handlers included, which multiprocessing skips)."""
    os.environ.clear()
    os.environ.update(environ)
    os.chdir(cwd)  # the server's is the caller's when the server started
    for fd, given in enumerate(std):
        received = given.detach()
        os.dup2(received, fd)
        os.close(received)
    sys.stdin, sys.stdout, sys.stderr = (_standard_stream(0, "r"), _standard_stream(1, "w"),
                                         _standard_stream(2, "w"))
    numbers = {f"{{fd{i}}}": str(given.detach()) for i, given in enumerate(passed)}
    argv = [numbers.get(arg, arg) for arg in argv]
    sys.argv = [sys.executable, *argv]
    module, _, function = main.partition(":")
    run = getattr(importlib.import_module(module), function)  # preloaded: a lookup

    try:
        code = run(argv)
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
    """A started ``main(argv)`` (by default ``python -m kvxfer.cli ARGV``) forked from the
    fork server: ``pid``, ``stdin`` (writable, binary) and ``stdout`` (readable, binary)
    with ``pipes``, ``poll``, ``wait``, ``send_signal``, ``kill`` and ``returncode`` as
    ``subprocess.Popen`` has them. Without ``pipes`` the child reads /dev/null and writes
    to the caller's stdout. ``pass_fds``: descriptors the child gets too ("{fdN}" in argv)."""

    def __init__(self, argv: list[str], stderr: IO[bytes] | None = None, env: dict[str, str] | None = None, *,
                 main: str = "kvxfer.cli:main", pipes: bool = True, pass_fds: tuple[int, ...] = (),
                 preload: tuple[str, ...] = ()) -> None:
        ours: list[int] = []     # the caller keeps these
        theirs: list[int] = []   # the child's ends: closed here once it has them
        try:
            if pipes:
                stdin_r, stdin_w = os.pipe()
                stdout_r, stdout_w = os.pipe()
                ours += [stdin_w, stdout_r]
                theirs += [stdin_r, stdout_w]
                std_in, std_out = stdin_r, stdout_w
            else:
                std_in = os.open(os.devnull, os.O_RDONLY)
                theirs.append(std_in)
                std_out = 1
            std_err = stderr.fileno() if stderr is not None else 2
            self._proc = _context(preload).Process(
                target=_run_main, name=f"kvxfer {argv[0] if argv else ''}".strip(),
                args=(dict(os.environ) if env is None else dict(env), os.getcwd(), main, list(argv),
                      [DupFd(std_in), DupFd(std_out), DupFd(std_err)], [DupFd(fd) for fd in pass_fds]))
            _start_without_main(self._proc)
        except BaseException:
            for fd in ours:
                os.close(fd)
            raise
        finally:
            for fd in theirs:  # the child has its own copies now
                os.close(fd)
        self.pid: int = self._proc.pid
        self.args = argv
        self.stdin: IO[bytes] | None = open(ours[0], "wb", buffering=0) if pipes else None  # noqa: SIM115 - closed by end_process
        self.stdout: IO[bytes] | None = open(ours[1], "rb", buffering=0) if pipes else None  # noqa: SIM115 - closed by Child.stop
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
