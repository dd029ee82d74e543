"""Discovery: workers register in etcd under a lease, and a router follows that membership.

    /kvxfer/<namespace>/workers/<role>/<worker id>  ->  a WorkerRecord (JSON), under the worker's lease

- ``WorkerRecord``: what a router needs to know of a worker (role, URL, model, layout,
  capabilities, name, host, pid), encoded as JSON so that ``etcdctl get --prefix`` reads it.
  The worker id is its URL's ``host:port``: unique among the workers a router can reach.
- ``Registration`` (the worker's side): puts the record under a ``KeptLease``; when the lease is
  lost (etcd unreachable for a whole TTL, or the lease expired while the process was stopped)
  it puts it again under a new lease as soon as etcd answers; ``close()`` revokes the lease, so
  the key goes at once, within the client's timeout.
- ``Membership`` (the router's side): a ``PrefixWatch`` over the namespace's workers, whose
  events are handed to the router's event loop (``call_soon_threadsafe``) and applied there
  alone: a new key adds the worker (``target.add_worker(role, url)``), a deleted one (revoked,
  or its lease lapsed) removes it (``target.remove_worker(url)``). A worker of another model
  than the router's is refused with a log line. ``target`` is any object with those two
  methods (``kvxfer.router.Router``): this module imports no router.

A worker whose process stops (SIGSTOP, a hung host, SIGKILL) stops refreshing its lease: etcd
deletes its key when the TTL ends, and the router drops it then.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import MISSING, asdict, dataclass, fields
from typing import Any, Protocol
from urllib.parse import urlsplit

from kvxfer.contract import KvxferError, one_line
from kvxfer.etcd import (
    DEFAULT_NAMESPACE,
    ETCD_ENV,
    NAMESPACE_ENV,
    EtcdClient,
    EtcdUnavailable,
    KeptLease,
    PrefixWatch,
    WatchEvent,
    check_ttl,
    etcd_endpoints,
    etcd_namespace,
)
from kvxfer.serving.exchange import Handler, Request, Response

log = logging.getLogger("kvxfer.discovery")

DEFAULT_TTL = 10
"""Seconds a worker's lease lives without a refresh: how long a stopped worker stays listed."""
ROLES = ("prefill", "decode")
RECORD_VERSION = 1


class RecordError(KvxferError, ValueError):
    """A worker record that cannot be read; the message names the field."""


namespace_from = etcd_namespace  # the worker's and router's flag reads it as the NIXL backend does


def workers_prefix(namespace: str) -> str:
    """The prefix every worker key of ``namespace`` starts with (ends in '/')."""
    return f"/kvxfer/{namespace}/workers/"


def worker_id(url: str) -> str:
    """A worker's id in its key: its URL's ``host:port``."""
    return urlsplit(url).netloc


def worker_key(namespace: str, role: str, wid: str) -> str:
    return f"{workers_prefix(namespace)}{role}/{wid}"


@dataclass(frozen=True)
class RecordedKV:
    """How the worker's KV is shaped: a pair of workers must agree on the model's part
    (``scope``: a digest of the weights' config and KV dtype) and move what their layouts allow."""

    block_tokens: int          # the model's block size (part of its identity)
    dtype: str
    scope: str                 # ModelConfig.scope() as hex: same weights, same KV dtype
    engine_kv: bool = False    # moves engine geometries (a TP group) rather than pool rows
    tp: int = 1
    peer_tp: int = 1
    kv_block_tokens: int = 0   # its own paging (0: the model's)
    kv_layout: str = "block_major"


@dataclass(frozen=True)
class RecordedTransport:
    """How the worker moves KV, as its record says: a pair of workers must match."""

    backend: str               # nixl, ipc, ucx
    mode: str                  # push or pull
    lender: str                # inplace or staging
    store: str = ""            # "", memory or mooncake
    device: str = "cpu"


@dataclass(frozen=True)
class WorkerRecord:
    """One worker as etcd lists it. ``started`` (wall-clock seconds) tells a restarted worker
    on the same URL from the same process registering again."""

    role: str
    url: str
    model: str
    layout: RecordedKV
    capabilities: RecordedTransport
    name: str = ""
    host: str = ""
    pid: int = 0
    started: float = 0.0

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise RecordError(f"worker record: role must be one of {ROLES}, got {self.role!r}")
        parts = urlsplit(self.url)
        try:
            port = parts.port
        except ValueError:
            port = None
        if parts.scheme != "http" or not parts.hostname or port is None or parts.path.strip("/"):
            raise RecordError(f"worker record: url {self.url!r} is not http://HOST:PORT")

    @property
    def id(self) -> str:
        return worker_id(self.url)

    def key(self, namespace: str) -> str:
        return worker_key(namespace, self.role, self.id)

    def identity(self) -> tuple[str, str]:
        """What every worker behind one router must share: the model's name and its scope."""
        return self.model, self.layout.scope

    def transport(self) -> tuple[str, str]:
        """(backend, mode): a prefill and a decode worker of another pair cannot move KV."""
        return self.capabilities.backend, self.capabilities.mode

    def encode(self) -> bytes:
        return json.dumps({"v": RECORD_VERSION, **asdict(self)}, sort_keys=True).encode()

    @classmethod
    def decode(cls, data: bytes) -> WorkerRecord:
        """RecordError naming what is wrong. Fields a newer writer added are ignored; a record
        of another version is refused."""
        try:
            raw = json.loads(data)
        except (ValueError, UnicodeDecodeError) as exc:
            raise RecordError(f"worker record is not JSON: {exc}") from None
        if not isinstance(raw, dict):
            raise RecordError("worker record is not a JSON object")
        if raw.get("v") != RECORD_VERSION:
            raise RecordError(f"worker record version {raw.get('v')!r}, this reader knows {RECORD_VERSION}")
        top = _fields(cls, raw, "worker record", skip=("layout", "capabilities"))
        top["layout"] = RecordedKV(**_fields(RecordedKV, raw.get("layout"), "worker record layout"))
        top["capabilities"] = RecordedTransport(**_fields(RecordedTransport, raw.get("capabilities"),
                                                     "worker record capabilities"))
        return cls(**top)


_TYPES: dict[str, type | tuple[type, ...]] = {"int": int, "float": (int, float), "str": str, "bool": bool}


def _fields(kind: type, raw: Any, what: str, skip: tuple[str, ...] = ()) -> dict[str, Any]:
    """The fields of dataclass ``kind`` from ``raw``, each checked against its annotation."""
    if not isinstance(raw, dict):
        raise RecordError(f"{what} is not a JSON object")
    out: dict[str, Any] = {}
    for f in fields(kind):
        if f.name in skip:
            continue
        if f.name not in raw:
            if f.default is MISSING:
                raise RecordError(f"{what} lacks {f.name!r}")
            continue
        value = raw[f.name]
        wanted = _TYPES[str(f.type)]
        if not isinstance(value, wanted) or (isinstance(value, bool) and str(f.type) != "bool"):
            raise RecordError(f"{what}: {f.name} must be {f.type}, got {value!r}")
        out[f.name] = float(value) if str(f.type) == "float" else value
    return out


# --- the worker's side --------------------------------------------------------------------------
class Registration:
    """A worker's record in etcd, kept under a lease for as long as the worker serves.

    ``start(record)`` grants the lease and puts the key (EtcdUnavailable when etcd does not
    answer: the worker must not announce itself ready). A lost lease is replaced by a thread
    (``etcd-register``) that tries every ``retry_s`` until etcd answers again. ``close()``
    revokes the lease first, so a router drops the worker at once."""

    def __init__(self, client: EtcdClient, namespace: str, ttl: int = DEFAULT_TTL, *, retry_s: float = 1.0) -> None:
        check_ttl(ttl)
        self.client = client
        self.namespace = namespace
        self.ttl = ttl
        self.retry_s = retry_s
        self.record: WorkerRecord | None = None
        self.registrations = 0       # leases the record was put under
        self.error = ""              # why the last lease was lost, or the last attempt failed
        self._lease: KeptLease | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._lost = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def key(self) -> str:
        return self.record.key(self.namespace) if self.record is not None else ""

    @property
    def registered(self) -> bool:
        lease = self._lease
        return lease is not None and not lease.lost.is_set()

    def start(self, record: WorkerRecord) -> None:
        if self._thread is not None:
            raise RuntimeError("registration already started")
        self.record = record
        self._register()
        self._thread = threading.Thread(target=self._keep, name=f"etcd-register {record.id}", daemon=True)
        self._thread.start()

    def _register(self) -> None:
        assert self.record is not None
        lease = KeptLease(self.client, self.ttl, on_lost=self._on_lost)
        try:
            self.client.put(self.key, self.record.encode(), lease=lease.handle)
        except BaseException:
            lease.close()
            raise
        with self._lock:
            closed = self._stop.is_set()
            if not closed:
                self._lease = lease
                self.registrations += 1
        if closed:  # close() ran meanwhile: take the key back at once
            lease.close()
            return
        log.info("registered %s in etcd at %s (lease %x, TTL %d s)", self.key, self.client, lease.id, self.ttl)

    def _on_lost(self, reason: str) -> None:
        self.error = reason
        self._lost.set()

    def _keep(self) -> None:
        while True:
            self._lost.wait()
            if self._stop.is_set():
                return
            self._lost.clear()
            with self._lock:
                old, self._lease = self._lease, None
            if old is not None:
                old.close(revoke=False)
            log.warning("etcd lease of %s lost (%s): registering again", self.key, self.error)
            while not self._stop.is_set():
                try:
                    self._register()
                    break
                except EtcdUnavailable as exc:
                    self.error = one_line(exc)
                    self._stop.wait(self.retry_s)

    def close(self) -> None:
        """Revoke the lease (the key goes now; at worst when its TTL ends) and end the thread.
        Each etcd call is bounded by the client's timeout."""
        with self._lock:
            self._stop.set()
            lease, self._lease = self._lease, None
        self._lost.set()
        if lease is not None:
            lease.close(revoke=True)
        if self._thread is not None:
            self._thread.join(self.client.timeout * 2 + 1)

    def state(self) -> dict[str, Any]:
        """What the worker's /health says of it."""
        lease = self._lease
        return {"etcd": str(self.client), "key": self.key, "registered": self.registered,
                "lease": f"{lease.id:x}" if lease is not None else None, "ttl_s": self.ttl,
                "registrations": self.registrations, "error": self.error}


# --- the router's side --------------------------------------------------------------------------
class WorkerTable(Protocol):
    def add_worker(self, role: str, url: str) -> None: ...
    def remove_worker(self, url: str) -> None: ...


class Membership:
    """The workers of ``namespace`` as etcd lists them, applied to ``target`` on one event loop.

    ``model``: the model every worker must serve (the router's static workers'); unset, the
    first worker accepted sets it (name and scope) and the transport (backend and mode), and
    workers of another are refused with a warning, as are records that cannot be read and
    URLs the router has already (a static worker). ``members`` and ``refused`` are keyed by
    etcd key; read them on the loop."""

    def __init__(self, client: EtcdClient, namespace: str, target: WorkerTable, *, model: str | None = None,
                 on_change: Callable[[], None] | None = None, quiet_s: float = 5.0) -> None:
        self.client = client
        self.namespace = namespace
        self.prefix = workers_prefix(namespace)
        self.target = target
        self.model = model
        self.scope: str | None = None
        self.transport: tuple[str, str] | None = None  # (backend, mode): the first accepted worker's
        self.members: dict[str, WorkerRecord] = {}
        self.refused: dict[str, str] = {}
        self._refused_values: dict[str, bytes] = {}
        self.changes = 0
        self._on_change = on_change
        self._quiet_s = quiet_s  # the watch's read timeout: close() may wait this long
        self._loop: asyncio.AbstractEventLoop | None = None
        self._watch: PrefixWatch | None = None
        self._closed = False

    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Start the watch; its events run on ``loop`` (default: the running one)."""
        if self._watch is not None:
            raise RuntimeError("membership already started")
        self._loop = loop or asyncio.get_running_loop()
        self._watch = PrefixWatch(self.client, self.prefix, self._from_watch, quiet_s=self._quiet_s)

    def _from_watch(self, event: WatchEvent) -> None:
        loop = self._loop
        if loop is None or self._closed:
            return
        try:
            loop.call_soon_threadsafe(self.apply, event)
        except RuntimeError:  # the loop is closed: the router is gone
            pass

    async def synced(self, timeout: float) -> bool:
        """Wait until the watch has read the namespace once and its keys were applied."""
        deadline = time.monotonic() + timeout
        while self._watch is not None and not self._watch.synced.is_set():
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(0.02)
        await asyncio.sleep(0)  # the start's events were queued before synced was set: they run first
        return self._watch is not None

    # On the loop only ------------------------------------------------------------------------
    def apply(self, event: WatchEvent) -> None:
        if self._closed:
            return
        old = self.members.get(event.key)
        if event.value is None:
            self.refused.pop(event.key, None)
            self._refused_values.pop(event.key, None)
            if old is not None:
                self._drop(event.key, old, "its key is gone (lease revoked or lapsed)")
                # A key refused for this worker's URL (it came back in another role) may go in now.
                for key, value in list(self._refused_values.items()):
                    self.apply(WatchEvent(key, value))
            return
        try:
            record = WorkerRecord.decode(event.value)
        except RecordError as exc:
            record, why = None, str(exc)
        else:
            why = self._refusal(event.key, record)
        if old is not None and old == record:
            return
        if old is not None:  # registered anew (a restarted worker): a fresh endpoint
            self._drop(event.key, old, "registered again")
        if why is None:
            assert record is not None
            try:
                self.target.add_worker(record.role, record.url)
            except ValueError as exc:
                why = str(exc)
        if why is not None:
            if self.refused.get(event.key) != why:
                log.warning("discovery: not serving with %s: %s", event.key, why)
            self.refused[event.key] = why
            self._refused_values[event.key] = event.value
            return
        assert record is not None
        self.refused.pop(event.key, None)
        self._refused_values.pop(event.key, None)
        self.members[event.key] = record
        if self.model is None:
            self.model = record.model
        if self.scope is None:
            self.scope = record.layout.scope
        if self.transport is None:
            self.transport = record.transport()
        self.changes += 1
        log.info("discovery: %s worker %s (%s) joined", record.role, record.url, record.name)
        self._changed()

    def _refusal(self, key: str, record: WorkerRecord) -> str | None:
        if key != record.key(self.namespace):
            return f"its record names {record.role} worker {record.url}, whose key is {record.key(self.namespace)}"
        if self.model is not None and record.model != self.model:
            return f"it serves model {record.model!r}, this router {self.model!r}"
        if self.scope is not None and record.layout.scope != self.scope:
            return (f"its model {record.model!r} has other weights or KV dtype (scope {record.layout.scope}, "
                    f"this router's {self.scope})")
        if self.transport is not None and record.transport() != self.transport:
            backend, mode = record.transport()
            return f"it moves KV with {backend} {mode}, this router's workers with {' '.join(self.transport)}"
        return None

    def _drop(self, key: str, record: WorkerRecord, why: str) -> None:
        del self.members[key]
        try:
            self.target.remove_worker(record.url)
        except KeyError:
            pass
        self.changes += 1
        log.info("discovery: %s worker %s left: %s", record.role, record.url, why)
        self._changed()

    def _changed(self) -> None:
        if self._on_change is not None:
            try:
                self._on_change()
            except Exception:
                log.exception("discovery: on_change failed")

    def state(self) -> dict[str, Any]:
        """What the router's /health says of it."""
        watch = self._watch
        return {"etcd": str(self.client), "prefix": self.prefix,
                "synced": bool(watch is not None and watch.synced.is_set()),
                "members": {key: r.url for key, r in sorted(self.members.items())},
                "refused": dict(sorted(self.refused.items())), "model": self.model}

    def close(self) -> None:
        """Stop following (blocking: up to ``quiet_s``, while the watch's read runs out, or the
        client's timeout); the workers added stay in the target."""
        self._closed = True
        if self._watch is not None:
            self._watch.close()


# --- helpers for both commands ----------------------------------------------------------------------
def add_etcd_args(parser: argparse.ArgumentParser, *, register: bool) -> None:
    """``--etcd``, ``--etcd-namespace`` and, for a worker (``register``), ``--etcd-ttl``."""
    what = ("register this worker in etcd, under a lease" if register
            else "follow the workers registered in etcd, beside the static --prefill/--decode URLs")
    g = parser.add_argument_group(f"discovery: {what} (kvxfer.serving.discovery)")
    # SUPPRESS: no "(default: None)" in --help; check_etcd reads what is unset.
    g.add_argument("--etcd", default=argparse.SUPPRESS, metavar="URLS",
                   help=f"etcd endpoints, http://HOST:PORT[,...] (unset: ${ETCD_ENV}; empty: no discovery)")
    g.add_argument("--etcd-namespace", default=argparse.SUPPRESS, metavar="NAME",
                   help=f"the key space workers and routers share (unset: ${NAMESPACE_ENV}, else {DEFAULT_NAMESPACE})")
    if register:
        g.add_argument("--etcd-ttl", type=int, default=DEFAULT_TTL, metavar="S",
                       help="seconds the worker stays listed after it stops refreshing its lease (at least 2)")


def check_etcd(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Read the etcd flags into ``args.etcd_client`` (None: no discovery) and
    ``args.etcd_namespace``; a usage error (exit 2, one line) for a malformed flag or an etcd
    that does not answer now."""
    args.etcd_client = None
    try:
        endpoints = etcd_endpoints(getattr(args, "etcd", None))
        args.etcd_namespace = namespace_from(getattr(args, "etcd_namespace", None))
    except ValueError as exc:
        parser.error(f"--etcd: {exc}")
    try:
        check_ttl(getattr(args, "etcd_ttl", DEFAULT_TTL))
    except ValueError as exc:
        parser.error(f"--etcd-ttl: {exc}")
    if not endpoints:
        return
    client = EtcdClient(endpoints)
    try:
        client.check()
    except EtcdUnavailable as exc:
        parser.error(f"--etcd {client}: etcd does not answer ({one_line(exc)})")
    args.etcd_client = client


def advertised_url(host: str, port: int) -> str:
    """The URL others reach a server on: a wildcard address (0.0.0.0, ::) is advertised as
    this host's name."""
    if host in ("", "0.0.0.0", "::", "[::]"):
        host = socket.getfqdn()
    elif ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"http://{host}:{port}"


def with_health(handler: Handler, key: str, state: Callable[[], dict[str, Any] | None]) -> Handler:
    """``handler`` whose GET /health JSON object also holds ``key: state()`` (when not None)."""
    async def handle(request: Request) -> Response:
        response = await handler(request)
        if request.method != "GET" or (request.path.strip("/") or "health") != "health" or response.stream:
            return response
        extra = state()
        if extra is None:
            return response
        try:
            body = json.loads(response.body)
        except ValueError:
            return response
        if isinstance(body, dict):
            body[key] = extra
            response.body = json.dumps(body).encode()
        return response
    return handle


async def in_thread(fn: Callable[[], None], timeout: float, name: str) -> bool:
    """Run ``fn`` on a daemon thread and wait at most ``timeout`` s for it (a shutdown step
    that must not hold the process: the thread is left behind if it overruns). True when it
    finished in time."""
    loop = asyncio.get_running_loop()
    done = loop.create_future()

    def run() -> None:
        try:
            fn()
        except Exception:
            log.exception("%s failed", name)
        finally:
            try:
                loop.call_soon_threadsafe(lambda: done.done() or done.set_result(None))
            except RuntimeError:
                pass

    threading.Thread(target=run, name=name, daemon=True).start()
    try:
        await asyncio.wait_for(asyncio.shield(done), timeout)
    except asyncio.TimeoutError:
        log.warning("%s did not finish within %.1f s", name, timeout)
        return False
    return True
