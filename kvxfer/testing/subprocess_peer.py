"""A PeerEnd whose backend lives in a child process, for two-process conformance tests.

The child runs ``python -m kvxfer.testing.subprocess_peer FD FACTORY KWARGS``: ``FACTORY``
(``"module:function"``) builds ``(backend, row_memory, inject_fault_or_None)`` from the
JSON ``KWARGS``. Parent and child talk over a socket pair (not stdout: NIXL logs there)
with ``multiprocessing.connection`` framing. Hints cross as ``kvxfer.wire`` bytes, as a
router would carry them; the key is the process's ``KVXFER_HINT_KEY``.

Every child is tracked until it is reaped: ``live_children()`` lists those still running
so that tests can assert nothing is left behind, and ``atexit`` kills stragglers.
"""

from __future__ import annotations

import atexit
import importlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from typing import Any, ClassVar

import numpy as np

from kvxfer.contract import (
    Cancelled,
    Delivered,
    Failed,
    Hint,
    InvalidSubmission,
    KvxferError,
    Outcome,
    Peer,
    SlotRegion,
    SubmissionRejected,
    View,
)
from kvxfer.testing.conformance import PeerEnd
from kvxfer.testing.memory import retain_if_unquiesced
from kvxfer.wire import WireError, decode_hint, encode_hint

START_TIMEOUT = 90.0  # a loaded 2-core CI machine can take tens of seconds to start one
_ERRORS: dict[str, type[Exception]] = {
    "InvalidSubmission": InvalidSubmission, "SubmissionRejected": SubmissionRejected, "WireError": WireError,
}
_live: set[subprocess.Popen[bytes]] = set()
_live_lock = threading.Lock()


def live_children() -> list[int]:
    """Pids of SubprocessPeer children that have not been reaped."""
    with _live_lock:
        return [p.pid for p in _live if p.poll() is None]


@atexit.register
def _kill_stragglers() -> None:
    with _live_lock:
        procs = list(_live)
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=5)


def _pack_outcome(outcome: Outcome | None) -> tuple[Any, ...] | None:
    if outcome is None:
        return None
    masks = [np.asarray(m).copy() for m in outcome.masks]
    if isinstance(outcome, Delivered):
        return ("delivered", masks)
    if isinstance(outcome, Failed):
        return ("failed", masks, outcome.reason)
    return ("cancelled", masks, outcome.by_peer)


def _unpack_outcome(packed: tuple[Any, ...] | None) -> Outcome | None:
    if packed is None:
        return None
    if packed[0] == "delivered":
        return Delivered(packed[1])
    if packed[0] == "failed":
        return Failed(packed[2], packed[1])
    return Cancelled(packed[2], packed[1])


class SubprocessPeer(PeerEnd):
    """The peer end of a pair, hosted by a child process."""

    def __init__(self, factory: str, kwargs: dict[str, Any] | None = None, *,
                 env: dict[str, str] | None = None, prefix: Sequence[str] = ()) -> None:
        """``prefix``: a command that execs the child's (e.g. ``ip netns exec NS``: the
        child keeps its pid and the socket's descriptor)."""
        parent, child = socket.socketpair()
        child_env = {**os.environ, "NIXL_LOG_LEVEL": "WARN", **(env or {})}
        try:
            self.process = subprocess.Popen(
                [*prefix, sys.executable, "-m", "kvxfer.testing.subprocess_peer", str(child.fileno()), factory,
                 json.dumps(kwargs or {})],
                pass_fds=[child.fileno()], env=child_env, stdin=subprocess.DEVNULL)
        finally:
            child.close()
        with _live_lock:
            _live.add(self.process)
        self._conn = Connection(parent.detach())
        self._closed = False
        try:
            if not self._conn.poll(START_TIMEOUT):
                raise RuntimeError(f"peer child {self.process.pid} did not start within {START_TIMEOUT:g}s")
            ready = self._conn.recv()
        except BaseException:
            self.kill()
            raise
        if ready[0] != "ok":
            self.kill()
            raise RuntimeError(f"peer child failed to start: {ready[1:]}")
        self.regions: tuple[SlotRegion, ...] = ready[1]["regions"]
        self.agent: str = ready[1]["agent"]
        self.pid = self.process.pid

    # --- calls ------------------------------------------------------------------------
    def _call(self, *request: Any, timeout: float = 60.0) -> Any:
        if self._closed:
            raise RuntimeError("the peer child was closed")
        try:
            self._conn.send(request)
            if not self._conn.poll(timeout):
                raise TimeoutError(f"peer child {self.pid} did not answer {request[0]!r} within {timeout:g}s")
            reply = self._conn.recv()
        except (EOFError, BrokenPipeError, ConnectionResetError) as exc:
            raise RuntimeError(f"peer child {self.pid} is gone ({exc!r})") from None
        if reply[0] == "ok":
            return reply[1]
        error = _ERRORS.get(reply[1], RuntimeError)
        raise error(reply[2])

    def describe_bytes(self, view: View, audience: Peer | None = None) -> bytes:
        """The child's hint for ``view``, as wire bytes."""
        return bytes(self._call("describe", view, audience))

    def describe(self, view: View, audience: Peer | None = None) -> Hint:
        return decode_hint(self.describe_bytes(view, audience))

    def start_bytes(self, op: str, view: View, hint: bytes) -> int:
        """Submit with hint bytes that the child decodes (its WireError comes back as such)."""
        return int(self._call("start", op, view, bytes(hint)))

    def start(self, op: str, view: View, hint: Hint) -> int:
        return self.start_bytes(op, view, encode_hint(hint))

    def result(self, handle: int, timeout: float) -> tuple[Outcome | None, bool]:
        packed, quiesced = self._call("result", handle, timeout, timeout=timeout + 30.0)
        return _unpack_outcome(packed), bool(quiesced)

    def cancel(self, handle: int) -> None:
        self._call("cancel", handle)

    def write(self, region: str, slots: np.ndarray, data: bytes) -> None:
        self._call("write", region, np.asarray(slots, dtype=np.int64), bytes(data))

    def read(self, region: str, slots: np.ndarray) -> bytes:
        return bytes(self._call("read", region, np.asarray(slots, dtype=np.int64)))

    def inject_fault(self, rows: int | None) -> bool:
        return bool(self._call("inject", rows))

    def set_option(self, name: str, value: Any) -> None:
        """Set an attribute of the child's backend (e.g. ``chunk_pause_s``)."""
        self._call("option", name, value)

    def shutdown(self) -> int:
        return int(self._call("shutdown"))

    def rebuild(self, kwargs: dict[str, Any]) -> None:
        """Shut the child's backend down and build a new one with the factory and ``kwargs``."""
        info = self._call("rebuild", kwargs)
        self.regions, self.agent = info["regions"], info["agent"]

    # --- lifetime ---------------------------------------------------------------------
    def kill(self) -> None:
        """SIGKILL the child (no clean-up runs there) and reap it."""
        if self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGKILL)
        self._reap(10.0)

    def close(self, timeout: float = 15.0) -> None:
        """Ask the child to shut its backend down and exit; kill it if it does not."""
        if not self._closed and self.process.poll() is None:
            try:
                self._conn.send(("exit",))
                self._conn.poll(timeout)
            except (OSError, EOFError):
                pass
        self._reap(timeout)

    def _reap(self, timeout: float) -> None:
        self._closed = True
        try:
            self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=10.0)
        self._conn.close()
        with _live_lock:
            _live.discard(self.process)


# --- the child ------------------------------------------------------------------------

class _ChildEnd:
    """The child's backend and row memory, answering the parent's requests (one method per op)."""

    def __init__(self, build: Callable[..., Any], kwargs: dict[str, Any]) -> None:
        self._build = build
        self.backend, self.memory, self._inject = build(**kwargs)
        self._attempts: dict[int, Any] = {}

    def info(self) -> dict[str, Any]:
        return {"regions": tuple(self.memory.regions), "agent": getattr(self.backend, "name", "")}

    def answer(self, request: tuple[Any, ...]) -> Any:
        op = self._OPS.get(request[0])
        if op is None:
            raise ValueError(f"unknown request {request[0]!r}")
        return op(self, *request[1:])

    def describe(self, view: View, audience: Peer | None) -> bytes:
        return encode_hint(self.backend.describe(view, audience))

    def start(self, what: str, view: View, hint_bytes: bytes) -> int:
        hint = decode_hint(hint_bytes)
        attempt = self.backend.fetch(view, hint) if what == "fetch" else self.backend.publish(view, hint)
        handle = len(self._attempts) + 1
        self._attempts[handle] = attempt
        return handle

    def result(self, handle: int, timeout: float) -> tuple[Any, bool]:
        attempt, end = self._attempts[handle], time.monotonic() + timeout
        while time.monotonic() < end and not (attempt.poll() is not None and attempt.quiesced()):
            time.sleep(0.001)
        return _pack_outcome(attempt.poll()), attempt.quiesced()

    def cancel(self, handle: int) -> None:
        self._attempts[handle].cancel()

    def write(self, region: str, slots: np.ndarray, data: bytes) -> None:
        self.memory.write(region, slots, data)

    def read(self, region: str, slots: np.ndarray) -> bytes:
        return self.memory.read(region, slots)

    def inject(self, rows: int | None) -> bool:
        if self._inject is None:
            return False
        self._inject(rows)
        return True

    def option(self, name: str, value: Any) -> None:
        setattr(self.backend, name, value)

    def shutdown(self) -> int:
        return len(self.backend.shutdown())

    def rebuild(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        """A fresh backend in this process: cheaper than a new child."""
        retain_if_unquiesced(self.backend.shutdown(), self.memory)
        self._attempts.clear()
        self.backend, self.memory, self._inject = self._build(**kwargs)
        return self.info()

    _OPS: ClassVar[dict[str, Callable[..., Any]]] = {
        "describe": describe, "start": start, "result": result, "cancel": cancel, "write": write, "read": read,
        "inject": inject, "option": option, "shutdown": shutdown, "rebuild": rebuild,
    }


def _serve(conn: Connection, factory: str, kwargs: dict[str, Any]) -> None:
    module, _, name = factory.partition(":")
    build = getattr(importlib.import_module(module), name)
    try:
        child = _ChildEnd(build, kwargs)
    except Exception as exc:
        conn.send(("err", type(exc).__name__, f"{factory} failed: {exc}"))
        return
    conn.send(("ok", child.info()))
    while True:
        try:
            request = conn.recv()
        except (EOFError, OSError):
            break  # the parent is gone: shut down below
        if request[0] == "exit":
            conn.send(("ok", child.shutdown()))
            return
        try:
            value = child.answer(request)
        except (KvxferError, ValueError, KeyError, TypeError) as exc:
            conn.send(("err", type(exc).__name__, str(exc)))
            continue
        conn.send(("ok", value))
    child.backend.shutdown()


def main(argv: list[str]) -> int:
    fd, factory, kwargs = int(argv[0]), argv[1], json.loads(argv[2])
    conn = Connection(fd)
    try:
        _serve(conn, factory, kwargs)
    finally:
        conn.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
