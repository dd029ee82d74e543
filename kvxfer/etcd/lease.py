"""A lease kept alive by a thread, so that what a process puts under it vanishes when the
process dies (SIGKILL included) within the lease's TTL."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from kvxfer.etcd.client import EtcdClient, EtcdUnavailable

log = logging.getLogger(__name__)


def _lease_on(client: Any, lease_id: int) -> Any:
    """The lease through whichever endpoint answers now (etcd3gw binds one to the endpoint
    that granted it)."""
    from etcd3gw.lease import Lease  # noqa: PLC0415 - only etcd users need it

    return Lease(lease_id, client)


MIN_TTL_S = 2  # a lease is refreshed every third of its TTL: under 2 s that leaves too little slack


def check_ttl(ttl: float) -> None:
    """ValueError unless ``ttl`` is a lease TTL etcd and ``KeptLease`` can keep (at least 2 s)."""
    if ttl < MIN_TTL_S:
        raise ValueError(f"an etcd lease TTL must be at least {MIN_TTL_S} s, not {ttl}")


class KeptLease:
    """Grant a lease of ``ttl`` seconds and refresh it every ``ttl / 3`` s on a daemon thread.

    ``lost`` is set, and then ``on_lost`` called once from that thread (so that it sees ``lost``
    set), when etcd cannot be reached for a whole TTL, or says the lease expired: what was put
    under it is gone or going, and the owner must put it again under a new lease or stop
    advertising. ``close()`` stops the
    thread and revokes the lease (its keys go at once), within the client's timeout; while
    keepalives fail (``failing``: etcd does not answer) it does not try, so that it never
    waits a second timeout: the keys then go when the TTL ends.
    """

    def __init__(self, client: EtcdClient, ttl: int, *, on_lost: Callable[[str], None] | None = None) -> None:
        check_ttl(ttl)
        self.client = client
        self.ttl = ttl
        self._lease = client.grant(ttl)
        self.id = int(self._lease.id)
        self._on_lost = on_lost
        self.lost = threading.Event()
        self.reason = ""
        self.failing = False  # the last keepalive got no answer
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._keep, name=f"etcd-lease-{self.id:x}", daemon=True)
        self._thread.start()

    @property
    def handle(self) -> Any:
        """What ``EtcdClient.put(..., lease=)`` takes."""
        return self._lease

    def _keep(self) -> None:
        # A refresh every third of the TTL, counted from the start of the last one (a slow call
        # does not push the next one back), and the lease counted lost from its last refresh:
        # what etcd itself goes by.
        period = self.ttl / 3
        refreshed = time.monotonic()
        next_at = refreshed + period
        while not self._stop.wait(max(0.0, next_at - time.monotonic())):
            started = time.monotonic()
            next_at = started + period
            try:
                ttl = self.client.call("lease keepalive", lambda c: int(_lease_on(c, self.id).refresh()))
            except EtcdUnavailable as exc:
                self.failing = True
                if time.monotonic() - refreshed >= self.ttl:
                    self._lose(f"etcd unreachable for the lease's whole TTL ({self.ttl} s): {exc}")
                    return
                continue
            refreshed = started
            self.failing = False
            if ttl <= 0:
                self._lose(f"etcd says lease {self.id:x} expired")
                return

    def _lose(self, reason: str) -> None:
        self.reason = reason
        self.lost.set()
        log.warning("%s", reason)
        if self._on_lost is not None:
            try:
                self._on_lost(reason)
            except Exception:
                log.exception("on_lost callback failed")

    def close(self, *, revoke: bool = True) -> None:
        self._stop.set()
        self._thread.join(self.client.timeout + 1)
        if revoke and self.failing and not self.lost.is_set():
            log.info("etcd lease %x not revoked: etcd does not answer (its keys go when its TTL ends)", self.id)
        elif revoke and not self.lost.is_set():
            try:
                self.client.call("lease revoke", lambda c: _lease_on(c, self.id).revoke())
            except EtcdUnavailable as exc:
                log.info("could not revoke etcd lease %x (its keys go when its TTL ends): %s", self.id, exc)
