"""NIXL agents' metadata in etcd, kept by kvxfer itself, not by NIXL's etcd backend.

One key per agent, under a lease that a thread keeps alive (``kvxfer.etcd.KeptLease``)::

    /kvxfer/<namespace>/nixl/<agent name>  ->  b"etcd1:<instance>:<generation>\\n" + the agent's metadata

so a killed worker's key goes when the lease's TTL ends (10 s by default), and a clean
close revokes the lease (the key goes at once). Where the lease is lost (etcd unreachable
for a whole TTL, or the lease expired while the process was stopped) a thread
(``etcd-nixl <name>``) puts the key again under a new lease as soon as etcd answers; it also
retries a publish that etcd did not take.

Why not NIXL's own etcd backend (NIXL 1.5.1, measured here): it puts its keys under no
lease (a SIGKILLed agent's keys stay forever); its listener binds one port, 8888, for every
agent of a host (a second worker failed "Address already in use"); with etcd unreachable a
``fetch_remote_metadata`` leaves a watch that makes the agent's destructor hang (the process
never exits), and with etcd reachable a fetch for a missing peer blocks NIXL's listener for
about 5 s; and clean shutdowns log "Failed to invalidate remote metadata". NIXL starts that
backend whenever ``NIXL_ETCD_ENDPOINTS`` is set when an agent is made, listener thread or
not, so ``NixlAgent`` hides the variable from NIXL while it makes its agent and runs no
listener: no port is bound for metadata at all.

Freshness. In etcd mode a hint's endpoint carries a token, not the metadata:
``etcd1:<instance>:<generation>`` (about 30 bytes). ``instance`` is random per agent (a
restarted process of the same name has another one); ``generation`` counts this agent's
publishes, and every registration publishes (it adds the regions' remote keys to the
metadata). A fetcher that holds that instance at that generation or a later one has what the
hint needs; otherwise it looks the peer up until etcd holds that instance at that
generation or later, and loads it (NIXL adds the new regions to the connection it has).
etcd holding another instance means the process the hint came from was replaced: the
submission fails (``PeerGone``), and never reaches the successor's memory.

Lookups of a peer not found yet (absent, or at an older generation than a hint needs) are
rate-limited per peer: the first at once, then after 50 ms, doubling to 2 s, each bounded
by the client's timeout; a lookup that satisfied its caller resets the peer's backoff.
"""

from __future__ import annotations

import logging
import math
import os
import re
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace

from kvxfer.contract import one_line
from kvxfer.etcd import ETCD_ENV, EtcdClient, EtcdUnavailable, KeptLease, check_ttl, etcd_endpoints, etcd_namespace

log = logging.getLogger(__name__)

DEFAULT_TTL_S = 10
DEFAULT_TIMEOUT_S = 2.0
FIRST_DELAY_S = 0.05  # backoff after a lookup that did not find what its caller needs
MAX_DELAY_S = 2.0
_KEEP_BACKOFFS = 1024  # peers whose backoff is remembered before idle ones are dropped
TOKEN = b"etcd1:"
_TOKEN = re.compile(rb"etcd1:([0-9a-f]{16}):([0-9]{1,12})")
# What makes NIXL start its own etcd backend when an agent is made (see the module's text).
NIXL_ENV = (ETCD_ENV, "NIXL_ETCD_NAMESPACE")
_ENV_LOCK = threading.Lock()


@contextmanager
def hidden_from_nixl() -> Iterator[None]:
    """Unset NIXL's etcd variables while a NIXL agent is made, and restore them after.

    The environment is the process's: another thread reading these two variables in that
    window (a few milliseconds) would miss them; kvxfer reads them only under this lock."""
    with _ENV_LOCK:
        saved = {name: os.environ.pop(name) for name in NIXL_ENV if name in os.environ}
        try:
            yield
        finally:
            os.environ.update(saved)


@dataclass(frozen=True)
class EtcdSettings:
    """Where and how an agent keeps its metadata in etcd."""

    endpoints: str | None = None   # http://host:port[,...]; None: $NIXL_ETCD_ENDPOINTS
    namespace: str | None = None   # None: $KVXFER_ETCD_NAMESPACE, else "default"
    ttl_s: int = DEFAULT_TTL_S     # how long a killed agent's key outlives it
    timeout_s: float = DEFAULT_TIMEOUT_S  # each etcd call's bound

    def resolved(self) -> EtcdSettings:
        """Endpoints and namespace read (from the environment where not given) and checked:
        ValueError names what is wrong."""
        with _ENV_LOCK:
            endpoints = etcd_endpoints(self.endpoints)
            namespace = etcd_namespace(self.namespace)
        if not endpoints:
            raise ValueError(f"etcd mode needs an etcd endpoint: set {ETCD_ENV} (http://host:port[,...])")
        check_ttl(self.ttl_s)
        if self.timeout_s <= 0:
            raise ValueError(f"an etcd timeout must be positive, not {self.timeout_s}")
        return replace(self, endpoints=",".join(str(e) for e in endpoints), namespace=namespace)


def etcd_settings(use_etcd: bool | None, settings: EtcdSettings | None) -> EtcdSettings | None:
    """The settings of an agent's etcd mode, resolved, or None for no etcd. ``use_etcd``
    None: etcd where ``settings`` name endpoints or ``NIXL_ETCD_ENDPOINTS`` is set; True:
    etcd (ValueError without an endpoint); False: none."""
    if use_etcd is False:
        return None
    settings = settings or EtcdSettings()
    if use_etcd is None and not settings.endpoints:
        with _ENV_LOCK:
            if not os.environ.get(ETCD_ENV, "").strip():
                return None
    return settings.resolved()


def metadata_key(namespace: str, agent: str) -> str:
    return f"/kvxfer/{namespace}/nixl/{agent}"


@dataclass(frozen=True)
class Version:
    """Which process (``instance``) and which of its publishes (``generation``)."""

    instance: str
    generation: int

    @property
    def token(self) -> bytes:
        return b"%s%s:%d" % (TOKEN, self.instance.encode(), self.generation)

    def covers(self, wanted: Version) -> bool:
        """True when metadata of this version has everything a hint naming ``wanted`` needs."""
        return self.instance == wanted.instance and self.generation >= wanted.generation


def parse_token(endpoint: bytes) -> Version | None:
    """The version a hint's endpoint names, or None where it is not a token (inline NIXL
    metadata, or empty). ValueError for a token that does not parse."""
    if not endpoint.startswith(TOKEN):
        return None
    match = _TOKEN.fullmatch(endpoint)
    if match is None:
        raise ValueError(f"malformed etcd metadata token {endpoint[:64]!r}")
    return Version(match[1].decode(), int(match[2]))


@dataclass(frozen=True)
class Published:
    """An agent's metadata as etcd holds it."""

    version: Version
    metadata: bytes

    def encode(self) -> bytes:
        return self.version.token + b"\n" + self.metadata

    @classmethod
    def decode(cls, raw: bytes) -> Published:
        token, sep, metadata = raw.partition(b"\n")
        version = parse_token(token)
        if version is None or not sep:
            raise ValueError(f"not an agent's metadata record: {raw[:64]!r}")
        return cls(version, metadata)


@dataclass
class _Backoff:
    delay: float
    next_at: float  # inf while a lookup is under way


class EtcdMetadata:
    """This agent's metadata in etcd (``publish``), and its peers' (``lookup``).

    ``current`` gives the agent's metadata as it is now: each publish reads it under this
    object's lock, so that etcd never holds older metadata under a newer generation.
    Construction checks that etcd answers (EtcdUnavailable, naming the endpoint, if not).
    """

    def __init__(self, name: str, settings: EtcdSettings, current: Callable[[], bytes], *,
                 retry_s: float = 1.0) -> None:
        settings = settings.resolved()
        assert settings.namespace is not None and settings.endpoints is not None
        self.name = name
        self.namespace = settings.namespace
        self.ttl = settings.ttl_s
        self.key = metadata_key(self.namespace, name)
        self.client = EtcdClient(settings.endpoints, timeout=settings.timeout_s)
        self.client.check()
        self._current = current
        self._retry_s = retry_s
        self.version = Version(secrets.token_hex(8), 0)
        self.published: Version | None = None  # what etcd was last given (under the live lease)
        self.publishes = 0                      # puts etcd took
        self.lookups = 0                        # lookups that asked etcd
        self.skipped = 0                        # lookups answered "not yet" by the backoff alone
        self.error = ""                         # why the last publish failed
        self._lease: KeptLease | None = None
        self._lock = threading.Lock()           # publishes
        self._backoff: dict[str, _Backoff] = {}
        self._backoff_lock = threading.Lock()
        self._wake = threading.Event()
        self._closed = False
        self._thread: threading.Thread | None = None

    def __str__(self) -> str:
        return f"{self.key} at {self.client}"

    @property
    def token(self) -> bytes:
        """What a hint's endpoint carries: this agent's instance and latest generation."""
        return self.version.token

    @property
    def lease_id(self) -> int | None:
        lease = self._lease
        return None if lease is None else lease.id

    # --- this agent -----------------------------------------------------------------------
    def publish(self, *, required: bool = False) -> None:
        """Put the agent's current metadata under a new generation. ``required`` (the first):
        EtcdUnavailable when etcd does not take it; otherwise the keeping thread retries."""
        with self._lock:
            if self._closed:
                return
            self.version = Version(self.version.instance, self.version.generation + 1)
            try:
                self._put_locked()
            except EtcdUnavailable as exc:
                if required:
                    lease, self._lease = self._lease, None
                    if lease is not None:
                        lease.close()
                    raise
                self.error = one_line(exc)
                log.warning("could not publish NIXL metadata %s (retrying): %s", self, self.error)
                self._wake.set()
            if self._thread is None:
                self._thread = threading.Thread(target=self._keep, name=f"etcd-nixl {self.name}", daemon=True)
                self._thread.start()

    def _put_locked(self) -> None:
        lease = self._lease
        if lease is None or lease.lost.is_set():
            self._lease = None
            if lease is not None:
                lease.close(revoke=False)  # lost: its thread has ended
            lease = self._lease = KeptLease(self.client, self.ttl, on_lost=self._on_lost)
        version = self.version
        self.client.put(self.key, Published(version, self._current()).encode(), lease=lease.handle)
        self.published = version
        self.publishes += 1
        self.error = ""

    def _on_lost(self, reason: str) -> None:
        self.error = reason
        self._wake.set()

    def _stale(self) -> bool:
        lease = self._lease
        return lease is None or lease.lost.is_set() or self.published != self.version

    def _keep(self) -> None:
        """Put the key again while etcd lacks it: a lost lease, a publish etcd did not take."""
        while True:
            self._wake.wait(self._retry_s if self._stale() else None)
            self._wake.clear()
            with self._lock:
                if self._closed:
                    return
                if not self._stale():
                    continue
                try:
                    self._put_locked()
                except EtcdUnavailable as exc:
                    self.error = one_line(exc)
                    continue
            log.info("published NIXL metadata %s again (lease %x)", self, self.lease_id or 0)

    def close(self) -> None:
        """Take the key away (revoke the lease) and end the threads: each etcd call is bounded
        by the client's timeout, and none is tried while etcd is known not to answer."""
        self._closed = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(self.client.timeout * 2 + 1)
        with self._lock:
            lease, self._lease = self._lease, None
        if lease is not None:
            lease.close()
        self.client.close()

    # --- peers ----------------------------------------------------------------------------
    def lookup(self, name: str) -> Published | None:
        """``name``'s metadata as etcd holds it; None when it is not there, etcd does not
        answer, or the peer's backoff says not yet. Call ``found(name)`` once what it gave
        is what was needed."""
        now = time.monotonic()
        with self._backoff_lock:
            state = self._backoff.get(name)
            if state is not None and now < state.next_at:
                self.skipped += 1
                return None
            delay = FIRST_DELAY_S if state is None else min(state.delay * 2, MAX_DELAY_S)
            self._backoff[name] = _Backoff(delay, math.inf)  # one lookup of a peer at a time
            self.lookups += 1
            if len(self._backoff) > _KEEP_BACKOFFS:
                self._forget_idle(now)
        found = None
        try:
            raw = self.client.get(metadata_key(self.namespace, name))
            found = Published.decode(raw) if raw is not None else None
        except EtcdUnavailable as exc:
            log.info("NIXL metadata of %r: %s", name, exc)
        except ValueError as exc:
            log.warning("NIXL metadata of %r in etcd unreadable: %s", name, exc)
        finally:
            with self._backoff_lock:
                self._backoff[name] = _Backoff(delay, time.monotonic() + delay)
        return found

    def found(self, name: str) -> None:
        """``name`` was loaded: its next lookup (a newer generation) goes at once."""
        with self._backoff_lock:
            self._backoff.pop(name, None)

    def _forget_idle(self, now: float) -> None:
        for name in [n for n, s in self._backoff.items() if s.next_at < now - 60]:
            del self._backoff[name]
