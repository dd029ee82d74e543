"""A prefix of etcd kept in step on a thread: the current keys first, then every change.

The watch resumes from the last revision it saw when its stream breaks (etcd restarted, a
network blip), so no change is missed or replayed; when etcd has compacted past that
revision, it reads the prefix again and reports the difference.
"""

from __future__ import annotations

import base64
import json
import logging
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvxfer.etcd.client import EtcdClient, EtcdUnavailable, b64, prefix_end

log = logging.getLogger(__name__)


class _Compacted(Exception):
    """etcd no longer holds the revision the watch would resume from: read the prefix again."""


def _interrupt(response: Any) -> None:
    """End a read blocked on the watch stream now: closing the response alone waits for the
    read in progress (up to ``quiet_s``); shutting the socket down wakes it."""
    try:
        fd = response.raw.fileno()
        with socket.fromfd(fd, socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.shutdown(socket.SHUT_RDWR)
    except (OSError, AttributeError, ValueError) as exc:
        log.debug("etcd watch: socket shutdown: %s", exc)
    try:
        response.close()
    except Exception as exc:
        log.debug("etcd watch close: %s", exc)


@dataclass(frozen=True)
class WatchEvent:
    key: str
    value: bytes | None  # None: the key was deleted (or its lease lapsed)


class PrefixWatch:
    """Call ``on_event`` (from the watch's thread) for every key under ``prefix``: each one
    present at start, then each put and delete. ``synced`` is set once the start was read.
    ``close()`` ends the thread within the client's timeout."""

    def __init__(self, client: EtcdClient, prefix: str, on_event: Callable[[WatchEvent], None], *,
                 retry_s: float = 1.0, quiet_s: float = 5.0) -> None:
        prefix_end(prefix)  # refuses a prefix that does not end in "/"
        self.client = client
        self.prefix = prefix
        self._on_event = on_event
        self._retry_s = retry_s
        self._quiet_s = quiet_s
        self.synced = threading.Event()
        self._known: dict[str, bytes] = {}
        self._stop = threading.Event()
        self._response: Any = None
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name=f"etcd-watch {prefix}", daemon=True)
        self._thread.start()

    def _emit(self, key: str, value: bytes | None) -> None:
        if value is None:
            if self._known.pop(key, None) is None:
                return
        else:
            if self._known.get(key) == value:
                return
            self._known[key] = value
        try:
            self._on_event(WatchEvent(key, value))
        except Exception:
            log.exception("etcd watch callback failed for %s", key)

    def _resync(self) -> int:
        current, revision = self.client.get_prefix(self.prefix)
        for key in [k for k in self._known if k not in current]:
            self._emit(key, None)
        for key, value in current.items():
            self._emit(key, value)
        self.synced.set()
        return revision

    def _run(self) -> None:
        import requests  # noqa: PLC0415 - 0.15 s: not for a command that only checks its flags

        revision: int | None = None
        while not self._stop.is_set():
            try:
                if revision is None:
                    revision = self._resync()
                revision = self._follow(revision)
                continue  # the stream went quiet for a while: etcd answered, go on from there
            except _Compacted:
                revision = None
                continue
            except EtcdUnavailable as exc:
                log.info("etcd watch of %s: %s; retrying", self.prefix, exc)
                revision = None
            except (requests.exceptions.RequestException, OSError, ValueError) as exc:
                # The stream broke (or carried a line that is not JSON): is etcd there at all?
                if self._stop.is_set():
                    break
                log.info("etcd watch of %s broke (%s: %s)", self.prefix, type(exc).__name__, exc)
                if not self.client.healthy():
                    revision = None
            except Exception:  # a bug, not etcd: say so loudly, and keep the membership going
                log.exception("etcd watch of %s failed; reading the prefix again", self.prefix)
                revision = None
            self._stop.wait(self._retry_s)

    def _follow(self, revision: int) -> int:
        """Read the watch stream from ``revision + 1`` until it goes quiet for ``quiet_s`` (then
        check etcd answers, and return the revision reached) or breaks (raise)."""
        import requests  # noqa: PLC0415

        raw = self.client.raw()
        request = {"create_request": {"key": b64(self.prefix.encode()), "range_end": b64(prefix_end(self.prefix)),
                                      "start_revision": revision + 1}}
        response = raw.session.post(raw.get_url("/watch"), json=request, stream=True,
                                    timeout=(self.client.timeout, self._quiet_s))
        with self._lock:
            self._response = response
        try:
            if self._stop.is_set():
                return revision
            for line in response.iter_lines():
                if self._stop.is_set():
                    return revision
                if line.strip():
                    revision = self._chunk(json.loads(line).get("result", {}), revision)
        except requests.exceptions.ConnectionError as exc:
            if "timed out" not in str(exc).lower() and "timeout" not in type(exc).__name__.lower():
                raise
            self.client.check()  # quiet, not gone: etcd must still answer
            return revision
        finally:
            with self._lock:
                self._response = None
            response.close()
        raise ConnectionError("etcd closed the watch stream")

    def _chunk(self, result: dict[str, Any], revision: int) -> int:
        if result.get("canceled") or result.get("compact_revision"):
            raise _Compacted()
        for event in result.get("events", ()):
            kv = event["kv"]
            key = base64.b64decode(kv["key"]).decode()
            revision = max(revision, int(kv.get("mod_revision", revision)))
            if event.get("type") == "DELETE":
                self._emit(key, None)
            else:
                self._emit(key, base64.b64decode(kv.get("value", "")))
        # Only events move the revision on: a reply's header (the watch's creation) may run
        # ahead of catch-up events still to come, which a break would then skip.
        return revision

    def close(self) -> None:
        self._stop.set()
        with self._lock:
            response = self._response
        if response is not None:
            _interrupt(response)
        self._thread.join(self.client.timeout + self._quiet_s + 1)

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def snapshot(self) -> dict[str, bytes]:
        return dict(self._known)


