"""Completion records between same-node backends, over Unix domain stream sockets.

Each backend listens on a socket in a private temp dir; its path is the ``endpoint`` of
its hints. A backend sends to a peer over one outgoing connection per peer endpoint and
receives on the connections peers opened to it. Frames are a 4-byte big-endian length and
then the bytes of ``kvxfer.wire.encode_completion`` (or IpcBackend's 20-byte token frame).
A connection that reaches end of file or fails to send, or a socket nobody listens on,
means the peer's backend has gone: its process exited or it shut down. Nothing else does:
a peer that is slow to accept or to read, or a shortage of descriptors on our side, only
delays a frame (``PeerBusy``, or the rest of a frame left for ``flush()``), since a backend
that took a live peer for gone would let it write into memory it had given back.

Everything here runs on the owning backend's progress thread, except ``wake()``,
``try_send()`` and ``send_with()`` (any thread) and ``close()`` (after that thread has
stopped). Writes to a peer's connection hold one lock, so that frames never interleave;
``try_send()`` and ``send_with()`` never wait for it, and a frame written only in part is
finished by ``flush()``.
"""

from __future__ import annotations

import errno
import logging
import os
import select
import shutil
import socket
import struct
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from kvxfer import native
from kvxfer.contract import KvxferError

log = logging.getLogger(__name__)

_FRAME = struct.Struct(">I")
MAX_FRAME = 64 << 20
CHANNEL_DIR_PREFIX = "kvxfer-ipc-"  # each channel's private temp folder, holding its socket
SEND_TIMEOUT_S = 5.0
# connect() errors that say "not now" (a full listen backlog, no descriptor left here), not
# "nobody is there".
_TRANSIENT = frozenset({errno.EAGAIN, errno.EWOULDBLOCK, errno.EINTR, errno.EMFILE, errno.ENFILE, errno.ENOBUFS,
                        errno.ENOMEM, errno.ETIMEDOUT})


class PeerBusy(KvxferError, OSError):
    """The peer could not be reached just now, for a passing reason: try again later."""


@dataclass(eq=False)
class _Conn:
    sock: socket.socket
    peer: bytes  # the endpoint we dialled; b"" for a connection a peer opened to us
    buf: bytearray = field(default_factory=bytearray)
    pending: bytes = b""  # outbound: the rest of a frame try_send() wrote only in part


class Channel:
    """Listening socket, outgoing connections by peer endpoint, and a wake-up pipe."""

    def __init__(self, name: str) -> None:
        safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in name)[:40]
        self._dir = tempfile.mkdtemp(prefix=CHANNEL_DIR_PREFIX)
        self.path = os.path.join(self._dir, f"{safe}.sock")
        self.endpoint = self.path.encode()
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(self.path)
        self._listener.listen(64)
        self._listener.setblocking(False)
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._inbound: dict[int, _Conn] = {}
        self._outbound: dict[bytes, _Conn] = {}
        self._write_lock = threading.RLock()  # writes to (and closing of) outbound connections
        self._poll = select.poll()
        self._fds: set[int] = set()  # what _poll watches: spin() polls the same
        self._fds_lock = threading.Lock()  # connect() may run on another thread than spin()
        self._watch(self._listener.fileno())
        self._watch(self._wake_r)
        self._closed = False

    # --- any thread -------------------------------------------------------------------
    @property
    def wake_fd(self) -> int:
        """Writing a byte here wakes wait(): for CUDA host functions (no Python involved)."""
        return self._wake_w

    def wake(self) -> None:
        try:
            os.write(self._wake_w, b"\0")
        except (BlockingIOError, OSError):
            pass  # the pipe is full (a wake is already pending) or closed at shutdown

    # --- the progress thread ----------------------------------------------------------
    def wait(self, timeout_s: float) -> tuple[list[bytes], list[bytes]]:
        """Wait up to ``timeout_s`` (0 = just look); return (frames received, peers gone)."""
        frames: list[bytes] = []
        gone: list[bytes] = []
        for fd, _events in self._poll.poll(max(0, int(timeout_s * 1000))):
            if fd == self._wake_r:
                try:
                    while os.read(self._wake_r, 4096):
                        pass
                except BlockingIOError:
                    pass
            elif fd == self._listener.fileno():
                self._accept()
            elif fd in self._inbound:
                self._receive(self._inbound[fd], frames)
            else:
                conn = next((c for c in self._outbound.values() if c.sock.fileno() == fd), None)
                if conn is not None and not self._alive(conn):
                    gone.append(conn.peer)
        return frames, gone

    def spin(self, timeout_s: float, words: np.ndarray | None = None, slots: np.ndarray | None = None) -> bool:
        """Wait up to ``timeout_s`` for something that wait() would handle, or for a non-zero
        ``words[slots]`` (doorbells, ``doorbells``), polling without sleeping (and without the
        GIL, where kvxfer._native is built): True once there is."""
        with self._fds_lock:
            fds = list(self._fds)
        return native.spin_poll(fds, timeout_s, words, slots)

    def try_send(self, peer: bytes, frame: bytes) -> bool:
        """Send one frame now, from any thread, without waiting: False (nothing sent) when
        that would wait (another thread is writing, ``peer`` is not connected yet, its socket
        is full) or fails; the caller then leaves the frame to ``send()``."""
        return self.send_with(peer, frame, _write_now)

    def send_with(self, peer: bytes, frame: bytes, write: Callable[[int, bytes], int]) -> bool:
        """Send one frame through ``write(fd, data)``: code that writes the socket itself
        (native, in the same call as a CUDA one). It is called exactly once: with fd -1 when
        writing now would wait (another thread is writing, ``peer`` is not connected yet, a
        frame is pending), and returns the bytes it wrote (0: none; negative: it failed).
        True when the frame went, or went in part and flush() finishes it; False when nothing
        was written, and the caller sends it another way."""
        data = _FRAME.pack(len(frame)) + frame
        if not self._write_lock.acquire(blocking=False):
            write(-1, data)
            return False
        try:
            conn = self._outbound.get(peer)
            fd = -1 if conn is None or conn.pending else conn.sock.fileno()
            sent = write(fd, data)
            if conn is None or fd < 0 or sent <= 0:
                return False
            if sent < len(data):
                conn.pending = data[sent:]
                self.wake()  # the progress thread's flush() finishes it
            return True
        finally:
            self._write_lock.release()

    def flush(self) -> list[bytes]:
        """Write what ``try_send()`` left; return the peers found gone meanwhile."""
        gone: list[bytes] = []
        with self._write_lock:
            for conn in list(self._outbound.values()):
                if not conn.pending:
                    continue
                try:
                    conn.pending = conn.pending[conn.sock.send(conn.pending):]
                except BlockingIOError:
                    pass  # the next pass tries again
                except OSError:
                    gone.append(conn.peer)
                    self._drop_outbound(conn)
        return gone

    def send(self, peer: bytes, frame: bytes) -> bool:
        """Send one frame to ``peer``; False (and the connection dropped) when it is gone."""
        with self._write_lock:
            return self._send_locked(peer, frame)

    def _send_locked(self, peer: bytes, frame: bytes) -> bool:
        conn = self.connect(peer)
        if conn is None:
            return False
        if conn.pending:
            # The peer has not taken the last frame yet: this one queues behind it (flush()
            # sends both, in order) instead of waiting again on a peer that is slow to read.
            conn.pending += _FRAME.pack(len(frame)) + frame
            self.wake()
            return True
        data = memoryview(_FRAME.pack(len(frame)) + frame)
        deadline = time.monotonic() + SEND_TIMEOUT_S
        try:
            while data:
                try:
                    data = data[conn.sock.send(data):]
                except BlockingIOError:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        # Slow, not gone: the rest goes from flush(), on the progress thread.
                        log.warning("peer %r has not read for %gs; the frame goes later", peer, SEND_TIMEOUT_S)
                        conn.pending = bytes(data)
                        self.wake()
                        return True
                    # poll, not select: select() refuses a descriptor past FD_SETSIZE (1024),
                    # which a process holding many connections reaches.
                    writable = select.poll()
                    writable.register(conn.sock, select.POLLOUT)
                    writable.poll(left * 1000)
            return True
        except OSError as exc:
            log.info("peer %r is gone: %s", peer, exc)
            self._drop_outbound(conn)
            return False

    def connect(self, peer: bytes) -> _Conn | None:
        """The connection to ``peer``, opened on first use; None when nobody listens there;
        PeerBusy when it cannot be opened just now (see _TRANSIENT)."""
        conn = self._outbound.get(peer)
        if conn is not None:
            return conn
        sock: socket.socket | None = None
        try:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(SEND_TIMEOUT_S)
            sock.connect(os.fsdecode(peer))
        except OSError as exc:
            if sock is not None:
                sock.close()
            if isinstance(exc, TimeoutError) or exc.errno in _TRANSIENT:
                raise PeerBusy(exc.errno or errno.ETIMEDOUT, f"cannot reach peer {peer!r} now: {exc}") from exc
            if exc.errno not in (errno.ENOENT, errno.ECONNREFUSED):
                log.warning("cannot reach peer %r: %s", peer, exc)
            return None
        sock.setblocking(False)  # sends wait for room themselves (send()), with a deadline
        conn = _Conn(sock, peer)
        self._outbound[peer] = conn
        # Peers never write on this connection; readable means end of file: the peer is gone.
        self._watch(sock.fileno())
        return conn

    def reachable(self, peer: bytes) -> bool:
        conn = self.connect(peer)
        return conn is not None and self._alive(conn)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for conn in list(self._inbound.values()) + list(self._outbound.values()):
            conn.sock.close()
        self._inbound.clear()
        self._outbound.clear()
        self._listener.close()
        os.close(self._wake_r)
        os.close(self._wake_w)
        shutil.rmtree(self._dir, ignore_errors=True)

    # --- internals --------------------------------------------------------------------
    def _watch(self, fd: int) -> None:
        self._poll.register(fd, select.POLLIN)
        with self._fds_lock:
            self._fds.add(fd)

    def _unwatch(self, fd: int) -> None:
        with self._fds_lock:
            self._fds.discard(fd)
        self._poll.unregister(fd)

    def _alive(self, conn: _Conn) -> bool:
        try:
            data = conn.sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except BlockingIOError:
            return True
        except OSError:
            data = b""
        if data:
            return True
        self._drop_outbound(conn)
        return False

    def _drop_outbound(self, conn: _Conn) -> None:
        with self._write_lock:  # not while another thread writes to it
            if self._outbound.get(conn.peer) is conn:
                del self._outbound[conn.peer]
            try:
                self._unwatch(conn.sock.fileno())
            except (KeyError, ValueError):
                pass
            conn.sock.close()

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # no descriptor left here: the peer waits in the backlog
                log.warning("cannot accept a peer's connection now: %s", exc)
                return
            sock.setblocking(False)
            self._inbound[sock.fileno()] = _Conn(sock, b"")
            self._watch(sock.fileno())

    def _receive(self, conn: _Conn, frames: list[bytes]) -> None:
        eof = False
        try:
            while True:
                chunk = conn.sock.recv(1 << 20)
                if not chunk:
                    eof = True
                    break
                conn.buf += chunk
        except BlockingIOError:
            pass
        except OSError:
            eof = True
        # A peer may send its last record and exit at once: take whole frames before dropping.
        while len(conn.buf) >= _FRAME.size:
            (size,) = _FRAME.unpack_from(conn.buf)
            if size > MAX_FRAME:
                log.warning("dropping a connection that announced a %d-byte frame", size)
                eof = True
                break
            if len(conn.buf) < _FRAME.size + size:
                break
            frames.append(bytes(conn.buf[_FRAME.size:_FRAME.size + size]))
            del conn.buf[:_FRAME.size + size]
        if eof:
            self._drop_inbound(conn)

    def _drop_inbound(self, conn: _Conn) -> None:
        fd = conn.sock.fileno()
        if fd >= 0:
            self._inbound.pop(fd, None)
            try:
                self._unwatch(fd)
            except (KeyError, ValueError):
                pass
        conn.sock.close()


def _write_now(fd: int, data: bytes) -> int:
    """send_with()'s writer from Python: what the non-blocking socket takes now (0 when it
    takes nothing, or there is no socket; -1 when the write fails: send() finds out why)."""
    if fd < 0:
        return 0
    try:
        return os.write(fd, data)
    except BlockingIOError:
        return 0
    except OSError:
        return -1
