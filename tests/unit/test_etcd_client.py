"""kvxfer.etcd against a real etcd (the ``etcd_server`` fixture): endpoints and namespaces
read or refused by name, puts and gets, a lease whose key outlives a SIGKILLed owner only by
its TTL, a lease found lost when etcd stops, a prefix watch that reports puts and deletes
and follows again after etcd was paused, and calls to an etcd that does not answer, which
fail within the client's timeout naming the endpoint."""

from __future__ import annotations

import queue
import secrets
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from kvxfer.etcd import (
    EtcdClient,
    EtcdUnavailable,
    KeptLease,
    PrefixWatch,
    WatchEvent,
    etcd_endpoints,
    etcd_namespace,
)
from kvxfer.etcd.client import EtcdEndpoint
from kvxfer.testing.etcd_server import EtcdServer
from kvxfer.testing.waiting import settle

TTL = 2
TIMEOUT = 1.0
SLACK = 3.0  # a loaded 2-core machine: scheduling, a process start, etcd's own lease checks


def _prefix(what: str) -> str:
    return f"/kvxfer-test/{what}-{secrets.token_hex(4)}/"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture
def client(etcd_server: EtcdServer) -> EtcdClient:
    return EtcdClient(etcd_server.endpoint, timeout=5.0)


# --- endpoints and namespaces ---------------------------------------------------------------
def test_endpoints_parse_with_default_scheme_and_port() -> None:
    assert etcd_endpoints(" http://a:1, b:2 ,https://c ") == (
        EtcdEndpoint("a", 1), EtcdEndpoint("b", 2), EtcdEndpoint("c", 2379, "https"))
    assert etcd_endpoints("") == ()
    assert str(etcd_endpoints("h")[0]) == "http://h:2379"


@pytest.mark.parametrize(("text", "named"), [
    ("ftp://h:1", "'ftp://h:1' is not http://host:port"),
    ("http://h:notaport", "'http://h:notaport' has a bad port"),
    ("http://:5", "'http://:5' is not http://host:port"),
    ("a:1,http://h:99999", "'http://h:99999' has a bad port"),
])
def test_a_malformed_endpoint_is_refused_by_name(text: str, named: str) -> None:
    with pytest.raises(ValueError) as caught:
        etcd_endpoints(text)
    assert named in str(caught.value)


def test_endpoints_and_namespace_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NIXL_ETCD_ENDPOINTS", "http://e1:7,e2")
    monkeypatch.setenv("KVXFER_ETCD_NAMESPACE", "team-a")
    assert etcd_endpoints() == (EtcdEndpoint("e1", 7), EtcdEndpoint("e2", 2379))
    assert etcd_namespace() == "team-a"
    assert etcd_namespace("given") == "given"
    monkeypatch.delenv("KVXFER_ETCD_NAMESPACE")
    monkeypatch.delenv("NIXL_ETCD_ENDPOINTS")
    assert etcd_namespace() == "default"
    assert etcd_endpoints() == ()
    with pytest.raises(ValueError, match="'a/b'"):
        etcd_namespace("a/b")


# --- calls ----------------------------------------------------------------------------------
def test_put_get_prefix_and_delete(client: EtcdClient) -> None:
    prefix = _prefix("kv")
    client.put(prefix + "a", b"\x00one\n\xff")
    client.put(prefix + "b", b"two")
    client.put(prefix[:-1] + "-sibling", b"not under the prefix")
    assert client.get(prefix + "a") == b"\x00one\n\xff"
    assert client.get(prefix + "missing") is None
    items, revision = client.get_prefix(prefix)
    assert items == {prefix + "a": b"\x00one\n\xff", prefix + "b": b"two"}
    assert revision > 0
    client.delete(prefix + "a")
    assert client.get(prefix + "a") is None
    items, later = client.get_prefix(prefix)
    assert items == {prefix + "b": b"two"} and later > revision
    with pytest.raises(ValueError, match="ends in '/'"):
        client.get_prefix("/no-slash")


def test_a_closed_lease_takes_its_key_at_once(client: EtcdClient) -> None:
    key = _prefix("revoke") + "k"
    lease = KeptLease(client, TTL)
    client.put(key, b"v", lease=lease.handle)
    assert client.get(key) == b"v"
    lease.close()
    assert client.get(key) is None


def test_closing_a_lease_whose_keepalives_fail_does_not_wait_for_etcd_again(etcd_server: EtcdServer) -> None:
    client = EtcdClient(etcd_server.endpoint, timeout=TIMEOUT)
    key = _prefix("failing") + "k"
    ttl = 6  # keepalives every 2 s: close() comes between two, right after one failed
    lease = KeptLease(client, ttl)
    client.put(key, b"v", lease=lease.handle)
    etcd_server.pause()
    try:
        assert settle(lambda: lease.failing, timeout=ttl / 3 + TIMEOUT + SLACK, step=0.02)
        started = time.monotonic()
        lease.close()
        took = time.monotonic() - started
    finally:
        etcd_server.resume()
    assert took < TIMEOUT * 0.5, f"close() waited {took:.2f} s for an etcd that does not answer"
    # Not revoked: the key lapses with the lease's TTL instead.
    assert settle(lambda: client.get(key) is None, timeout=ttl + 10, step=0.1)


_OWNER = """
import sys, time
from kvxfer.etcd import EtcdClient, KeptLease
client = EtcdClient(sys.argv[1], timeout=2.0)
lease = KeptLease(client, int(sys.argv[3]))
client.put(sys.argv[2], b"alive", lease=lease.handle)
print("ready", flush=True)
time.sleep(600)
"""


def test_a_leased_key_goes_within_its_ttl_after_its_process_is_sigkilled(client: EtcdClient,
                                                                         etcd_server: EtcdServer) -> None:
    key = _prefix("killed") + "owner"
    proc = subprocess.Popen([sys.executable, "-c", _OWNER, etcd_server.endpoint, key, str(TTL)],
                            stdout=subprocess.PIPE, stdin=subprocess.DEVNULL)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == b"ready", "the lease owner did not start"
        # Kept alive: the key outlives several TTLs while its owner runs.
        time.sleep(2.5 * TTL)
        assert client.get(key) == b"alive", "the key went while its owner was alive: no keepalive"
        proc.kill()
        killed = time.monotonic()
        assert settle(lambda: client.get(key) is None, timeout=TTL + 10, step=0.1), "the key outlived its TTL"
        gone_after = time.monotonic() - killed
    finally:
        proc.kill()
        proc.wait(10)
        if proc.stdout is not None:
            proc.stdout.close()
    print(f"key gone {gone_after:.2f} s after SIGKILL (TTL {TTL} s)")
    assert gone_after <= TTL + SLACK


def test_a_lease_is_lost_and_its_owner_told_when_etcd_stops() -> None:
    with EtcdServer() as server:
        client = EtcdClient(server.endpoint, timeout=TIMEOUT)
        reasons: list[str] = []
        lease = KeptLease(client, TTL, on_lost=reasons.append)
        try:
            assert not lease.lost.is_set()
            server.stop()
            stopped = time.monotonic()
            # Keepalives every TTL/3; lost once they failed for a whole TTL.
            assert lease.lost.wait(TTL + TTL / 3 + TIMEOUT + SLACK + 5), "the lease was not found lost"
            print(f"lease lost {time.monotonic() - stopped:.2f} s after etcd stopped")
            # on_lost runs on the lease's thread just after ``lost`` is set.
            assert settle(lambda: bool(reasons)), "on_lost was not called"
            assert len(reasons) == 1 and lease.reason == reasons[0]
            assert "unreachable" in reasons[0] and server.endpoint in reasons[0], reasons[0]
            # A call to the stopped etcd fails at once, naming it.
            started = time.monotonic()
            with pytest.raises(EtcdUnavailable) as caught:
                client.get("/any")
            assert server.endpoint in str(caught.value)
            assert time.monotonic() - started < TIMEOUT + SLACK
        finally:
            started = time.monotonic()
            lease.close()
            assert time.monotonic() - started < TIMEOUT + SLACK


def test_calls_to_a_paused_etcd_fail_within_the_timeout_naming_it(etcd_server: EtcdServer) -> None:
    client = EtcdClient(etcd_server.endpoint, timeout=TIMEOUT)
    etcd_server.pause()
    try:
        for call in (lambda: client.get("/k"), lambda: client.put("/k", b"v"), client.check):
            started = time.monotonic()
            with pytest.raises(EtcdUnavailable) as caught:
                call()
            elapsed = time.monotonic() - started
            assert etcd_server.endpoint in str(caught.value)
            assert TIMEOUT * 0.5 <= elapsed < TIMEOUT + SLACK, elapsed
        assert not client.healthy()
    finally:
        etcd_server.resume()
    assert settle(client.healthy, timeout=10)


def test_calls_to_no_etcd_at_all_fail_at_once_naming_every_endpoint() -> None:
    first, second = f"http://127.0.0.1:{_free_port()}", f"http://127.0.0.1:{_free_port()}"
    client = EtcdClient(f"{first},{second}", timeout=TIMEOUT)
    started = time.monotonic()
    with pytest.raises(EtcdUnavailable) as caught:
        client.put("/k", b"v")
    assert first in str(caught.value) and second in str(caught.value)
    assert time.monotonic() - started < 2 * TIMEOUT + SLACK


# --- watches --------------------------------------------------------------------------------
@pytest.fixture
def events() -> Iterator[queue.Queue[WatchEvent]]:
    yield queue.Queue()


def _next(events: queue.Queue[WatchEvent], timeout: float = 15.0) -> WatchEvent:
    return events.get(timeout=timeout)


def test_a_prefix_watch_reports_puts_and_deletes_and_follows_again_after_a_pause(
        client: EtcdClient, etcd_server: EtcdServer, events: queue.Queue[WatchEvent]) -> None:
    prefix = _prefix("watch")
    client.put(prefix + "before", b"0")
    watch = PrefixWatch(EtcdClient(etcd_server.endpoint, timeout=TIMEOUT), prefix, events.put,
                        retry_s=0.2, quiet_s=1.0)
    paused = False
    try:
        assert watch.synced.wait(15)
        assert _next(events) == WatchEvent(prefix + "before", b"0")
        client.put(prefix + "a", b"1")
        assert _next(events) == WatchEvent(prefix + "a", b"1")
        client.put(prefix[:-1] + "-other/x", b"elsewhere")
        client.delete(prefix + "a")
        assert _next(events) == WatchEvent(prefix + "a", None)
        # Paused longer than the stream's quiet time and a call's timeout: the watch finds
        # etcd gone, retries, and resumes from the revision it had reached.
        etcd_server.pause()
        paused = True
        time.sleep(1.0 + TIMEOUT + 1.5)
        etcd_server.resume()
        paused = False
        client.put(prefix + "b", b"2")
        client.put(prefix + "before", b"0b")
        assert _next(events) == WatchEvent(prefix + "b", b"2")
        assert _next(events) == WatchEvent(prefix + "before", b"0b")
        time.sleep(0.5)
        assert events.empty(), f"unexpected event: {events.get_nowait()}"
        assert watch.snapshot() == {prefix + "before": b"0b", prefix + "b": b"2"}
        assert watch.running
    finally:
        if paused:
            etcd_server.resume()
        watch.close()
    assert not watch.running
