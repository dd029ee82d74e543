"""``kvxfer doctor --peer URL``'s calls to a running worker (``kvxfer.worker.probe`` answers them).

Plain HTTP/1.1 with JSON bodies over the standard library: the doctor needs no event loop.
Every failure is a ``PeerError`` whose message is the one line the doctor prints: a URL
that does not answer, one that is no kvxfer worker, a worker too old to have the probe
route, a probe refused (another is open, a size over the worker's limit).
"""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request
from typing import Any

from kvxfer.contract import KvxferError
from kvxfer.serving.keys import BearerKey
from kvxfer.serving.keys import headers as key_headers

ROUTE = "/doctor/probe"
ROLES = ("prefill", "decode")


class PeerError(KvxferError):
    """The peer cannot be probed; the message names the URL and why."""


class _Status(PeerError):
    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


def _reason(exc: BaseException) -> str:
    reason = getattr(exc, "reason", exc)
    if isinstance(reason, ConnectionRefusedError):
        return "connection refused (is a worker listening there?)"
    if isinstance(reason, socket.gaierror):
        return f"unknown host ({reason.strerror or reason})"
    if isinstance(reason, (TimeoutError, socket.timeout)):
        return "no answer in time"
    return str(reason) or type(reason).__name__


def call(url: str, method: str, path: str, body: dict[str, Any] | None = None, timeout: float = 10.0,
         key: BearerKey | None = None) -> Any:
    """One exchange, with the cluster key ``key`` if any; the JSON answer. ``_Status`` for a
    status of 400 or more (its message the answer's ``error``), PeerError when nothing (or no
    JSON) comes back."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json", "Accept": "application/json",
                                              **key_headers(key)})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as answer:  # noqa: S310 - http:// checked by the caller
            raw = answer.read()
    except urllib.error.HTTPError as exc:
        text = exc.read()[:400]
        try:
            message = json.loads(text).get("error", "")
            if isinstance(message, dict):  # OpenAI's shape, as a 401 has it
                message = message.get("message", "")
        except (ValueError, AttributeError):
            message = text.decode("latin-1").strip().splitlines()[0] if text.strip() else ""
        raise _Status(f"{method} {path}: HTTP {exc.code}{': ' + message if message else ''}", exc.code) from None
    except (urllib.error.URLError, OSError) as exc:
        raise PeerError(f"--peer {url}: cannot reach it: {_reason(exc)}") from None
    try:
        return json.loads(raw) if raw else {}
    except ValueError:
        raise PeerError(f"--peer {url} is not a kvxfer worker: {method} {path} answered "
                        f"{raw[:60].decode('latin-1')!r}, not JSON") from None


def connect(url: str, timeout: float, key: BearerKey | None = None) -> dict[str, Any]:
    """The worker's ``/health`` once it proved to be a kvxfer worker with the probe route
    (which, on a worker with a cluster key, ``key`` must match)."""
    try:
        health = call(url, "GET", "/health", timeout=timeout)
    except _Status as exc:
        raise PeerError(f"--peer {url} is not a kvxfer worker ({exc})") from None
    if not isinstance(health, dict) or health.get("role") not in ROLES:
        router = isinstance(health, dict) and {"prefill", "decode"} <= set(health)
        what = "a kvxfer router" if router else "something else"
        raise PeerError(f"--peer {url} is not a kvxfer worker: its /health names no prefill or decode role "
                        f"({what}?); give a worker's URL, as `kvxfer serve` announced it")
    try:
        status = call(url, "GET", ROUTE, timeout=timeout, key=key)
    except _Status as exc:
        if exc.status == 404:
            raise PeerError(f"--peer {url}: the {health['role']} worker there has no {ROUTE} route: its kvxfer "
                            "predates `kvxfer doctor --peer`; upgrade it") from None
        raise PeerError(f"--peer {url}: {exc}") from None
    return {**health, "probe": status}


def open_target(url: str, nbytes: int, memory: str, timeout: float, key: BearerKey | None = None) -> dict[str, Any]:
    """Ask the worker for a probe target; PeerError naming its refusal (another probe open, ...)."""
    try:
        target = call(url, "POST", ROUTE, {"bytes": nbytes, "memory": memory}, timeout=timeout, key=key)
    except _Status as exc:
        raise PeerError(f"--peer {url}: the worker refused a {memory} probe: {exc}") from None
    for field in ("id", "metadata", "address", "device"):
        if field not in target:
            raise PeerError(f"--peer {url}: the worker's probe answer has no {field!r}")
    return dict(target)


def renew(url: str, probe_id: str, timeout: float, key: BearerKey | None = None) -> None:
    try:
        call(url, "POST", f"{ROUTE}/{probe_id}", {}, timeout=timeout, key=key)
    except _Status as exc:
        raise PeerError(f"--peer {url}: the worker dropped probe {probe_id} while it was measured: {exc}") from None


def free(url: str, probe_id: str, timeout: float, key: BearerKey | None = None) -> str | None:
    """Free the probe; None when done (or gone already), else why not (the worker frees it
    itself after its idle time)."""
    try:
        call(url, "DELETE", f"{ROUTE}/{probe_id}", timeout=timeout, key=key)
    except _Status as exc:
        return None if exc.status == 404 else str(exc)
    except PeerError as exc:
        return str(exc)
    return None
