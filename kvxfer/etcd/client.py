"""A small etcd v3 client over etcd's HTTP gateway (``etcd3gw``), every call bounded in time.

Why the gateway and not gRPC: every call is one HTTP request with a timeout, so a worker whose
etcd vanished finds out in ``timeout`` seconds and never blocks its own shutdown; and the
NIXL backend, which runs on threads, needs a blocking client, not an event loop.
"""

from __future__ import annotations

import base64
import logging
import os
import re
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from kvxfer.contract import KvxferError

log = logging.getLogger(__name__)

ETCD_ENV = "NIXL_ETCD_ENDPOINTS"
"""The environment variable that names etcd (NIXL's own name for it): ``http://host:port[,...]``."""
NAMESPACE_ENV = "KVXFER_ETCD_NAMESPACE"
"""The environment variable that names the key space (``/kvxfer/<namespace>/...``) when no namespace is given."""
DEFAULT_NAMESPACE = "default"
_NAMESPACE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


class EtcdUnavailable(KvxferError):
    """etcd did not answer in time, or refused the call; the message names the endpoint."""


@dataclass(frozen=True)
class EtcdEndpoint:
    host: str
    port: int
    protocol: str = "http"

    def __str__(self) -> str:
        return f"{self.protocol}://{self.host}:{self.port}"


def etcd_endpoints(text: str | None = None) -> tuple[EtcdEndpoint, ...]:
    """Parse ``http://host:port[,http://host2:port]`` (the scheme and the port 2379 are
    optional); ``None`` reads ``NIXL_ETCD_ENDPOINTS``. Empty when unset. ValueError names a
    malformed entry."""
    text = os.environ.get(ETCD_ENV, "") if text is None else text
    found = []
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        parts = urlsplit(item if "://" in item else f"http://{item}")
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"etcd endpoint {item!r} is not http://host:port")
        try:
            port = parts.port or 2379
        except ValueError:
            raise ValueError(f"etcd endpoint {item!r} has a bad port") from None
        found.append(EtcdEndpoint(parts.hostname, port, parts.scheme))
    return tuple(found)


def etcd_namespace(text: str | None = None) -> str:
    """``text``, or ``KVXFER_ETCD_NAMESPACE``, or ``default``; ValueError for a name that is
    not 1-64 of letters, digits, ``.``, ``_`` and ``-`` (it is one segment of a key)."""
    name = (os.environ.get(NAMESPACE_ENV, "") if text is None else text).strip() or DEFAULT_NAMESPACE
    if not _NAMESPACE.fullmatch(name):
        raise ValueError(f"etcd namespace {name!r}: use 1-64 letters, digits, '.', '_' or '-'")
    return name


def b64(raw: bytes) -> str:
    """How etcd's JSON gateway spells a key or value."""
    return base64.b64encode(raw).decode()


def prefix_end(prefix: str) -> bytes:
    """The first key past every key that starts with ``prefix`` (etcd's range_end)."""
    if not prefix.endswith("/"):
        raise ValueError(f"an etcd prefix ends in '/': {prefix!r}")
    raw = bytearray(prefix.encode())
    raw[-1] += 1
    return bytes(raw)


class EtcdClient:
    """Puts, gets, deletes and leases on the first endpoint that answers, each call bounded by
    ``timeout`` seconds; a failure is ``EtcdUnavailable`` naming the endpoints tried."""

    def __init__(self, endpoints: tuple[EtcdEndpoint, ...] | str, *, timeout: float = 2.0) -> None:
        import etcd3gw  # noqa: PLC0415 - only etcd users need it
        import requests  # noqa: PLC0415
        from etcd3gw.exceptions import Etcd3Exception  # noqa: PLC0415

        self._failures = (Etcd3Exception, requests.exceptions.RequestException)

        self.endpoints = etcd_endpoints(endpoints) if isinstance(endpoints, str) else endpoints
        if not self.endpoints:
            raise ValueError("no etcd endpoint given")
        self.timeout = timeout
        self._clients = [etcd3gw.Etcd3Client(host=e.host, port=e.port, protocol=e.protocol, timeout=timeout)
                         for e in self.endpoints]
        self._first = 0  # the endpoint that answered last: tried first next time

    def __str__(self) -> str:
        return ",".join(str(e) for e in self.endpoints)

    def call(self, what: str, fn: Any) -> Any:
        """``fn(client)`` on each endpoint in turn until one answers."""
        errors = []
        for step in range(len(self._clients)):
            index = (self._first + step) % len(self._clients)
            try:
                result = fn(self._clients[index])
            except self._failures as exc:
                errors.append(f"{self.endpoints[index]}: {type(exc).__name__} {exc}".strip())
                continue
            self._first = index
            return result
        raise EtcdUnavailable(f"etcd {what} failed ({'; '.join(errors)})")

    def healthy(self) -> bool:
        try:
            self.call("status", lambda c: c.status())
        except EtcdUnavailable:
            return False
        return True

    def check(self) -> None:
        """Raise EtcdUnavailable unless an endpoint answers."""
        self.call("status", lambda c: c.status())

    def put(self, key: str, value: bytes, *, lease: Any = None) -> None:
        self.call(f"put {key}", lambda c: c.put(key, value, lease=lease))

    def get(self, key: str) -> bytes | None:
        values = self.call(f"get {key}", lambda c: c.get(key))
        return bytes(values[0]) if values else None

    def get_prefix(self, prefix: str) -> tuple[dict[str, bytes], int]:
        """Every key under ``prefix`` with its value, and the store's revision they were read at."""
        def read(c: Any) -> Any:
            # The raw range call: its header says which revision the keys were read at, which
            # a watch resumes from without a gap.
            return c.post(c.get_url("/kv/range"), json={"key": b64(prefix.encode()),
                                                         "range_end": b64(prefix_end(prefix))})

        answer = self.call(f"get {prefix}*", read)
        revision = int(answer["header"]["revision"])
        items = {base64.b64decode(kv["key"]).decode(): base64.b64decode(kv.get("value", ""))
                 for kv in answer.get("kvs", ())}
        return items, revision

    def delete(self, key: str) -> None:
        self.call(f"delete {key}", lambda c: c.delete(key))

    def grant(self, ttl: int) -> Any:
        return self.call(f"lease grant ({ttl} s)", lambda c: c.lease(ttl))

    def close(self) -> None:
        """Close the HTTP sessions (their pooled connections): a process that makes many
        clients (tests, a backend per agent) would otherwise keep their sockets open."""
        for client in self._clients:
            try:
                client.session.close()
            except Exception as exc:  # closing is best effort: nothing is sent
                log.debug("closing an etcd session: %s", exc)

    def raw(self) -> Any:
        """The etcd3gw client of the endpoint that answered last (watches use it)."""
        return self._clients[self._first]
