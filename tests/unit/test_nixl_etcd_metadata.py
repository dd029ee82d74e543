"""NIXL agents' metadata in etcd (kvxfer.backends.nixl.etcd_metadata) against a real etcd:
tokens and records, settings refused by name, a key under a lease that close() revokes and
a lost lease replaced, lookups rate-limited per peer, and NixlBackends in this process that
move rows with hints carrying only a token: a peer that registers more memory later, a peer
restarted under the same name, a hint whose process was replaced, an etcd that does not
answer at construction or at close. NIXL's own etcd backend is never started."""

from __future__ import annotations

import os
import secrets
import socket
import time
from collections.abc import Iterator

import numpy as np
import pytest

from kvxfer.backends.common.attempt import TrackedAttempt
from kvxfer.backends.nixl import EtcdSettings, NixlBackend
from kvxfer.backends.nixl.etcd_metadata import (
    MAX_DELAY_S,
    EtcdMetadata,
    Published,
    Version,
    etcd_settings,
    metadata_key,
    parse_token,
)
from kvxfer.contract import (
    CacheKind,
    Delivered,
    Failed,
    InvalidSubmission,
    KvxferError,
    LayerGroupRows,
    TokenRange,
    TransferMode,
    View,
)
from kvxfer.etcd import EtcdClient, EtcdUnavailable
from kvxfer.testing.etcd_server import EtcdServer
from kvxfer.testing.memory import HostRows
from kvxfer.testing.nixl_pairs import host_rows
from kvxfer.testing.processes import listening_ports
from kvxfer.testing.waiting import settle

TTL = 2
TIMEOUT = 1.0
SLACK = 3.0  # a loaded 2-core machine
ROW = 512


def _namespace() -> str:
    return f"t-{secrets.token_hex(4)}"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture
def settings(etcd_server: EtcdServer) -> EtcdSettings:
    return EtcdSettings(etcd_server.endpoint, _namespace(), ttl_s=TTL, timeout_s=TIMEOUT)


@pytest.fixture
def client(etcd_server: EtcdServer) -> EtcdClient:
    return EtcdClient(etcd_server.endpoint, timeout=5.0)


# --- tokens, records, settings --------------------------------------------------------------
def test_tokens_and_records_round_trip_and_malformed_ones_are_refused() -> None:
    version = Version("0123456789abcdef", 7)
    assert version.token == b"etcd1:0123456789abcdef:7"
    assert parse_token(version.token) == version
    assert parse_token(b"") is None and parse_token(b"nixlSerDes|Agent...") is None
    for bad in (b"etcd1:xyz:1", b"etcd1:0123456789abcdef:", b"etcd1:0123456789abcdef:1:2"):
        with pytest.raises(ValueError, match="malformed etcd metadata token"):
            parse_token(bad)
    assert Version("0123456789abcdef", 8).covers(version) and version.covers(version)
    assert not Version("0123456789abcdef", 6).covers(version)
    assert not Version("fedcba9876543210", 9).covers(version)
    record = Published(version, b"\x00meta\ndata\xff")
    assert Published.decode(record.encode()) == record
    with pytest.raises(ValueError, match="not an agent's metadata record"):
        Published.decode(b"just bytes")


def test_settings_come_from_the_environment_and_are_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NIXL_ETCD_ENDPOINTS", raising=False)
    monkeypatch.delenv("KVXFER_ETCD_NAMESPACE", raising=False)
    assert etcd_settings(None, None) is None
    with pytest.raises(ValueError, match="NIXL_ETCD_ENDPOINTS"):
        etcd_settings(True, None)
    monkeypatch.setenv("NIXL_ETCD_ENDPOINTS", "e1:7")
    monkeypatch.setenv("KVXFER_ETCD_NAMESPACE", "ns1")
    assert etcd_settings(None, None) == EtcdSettings("http://e1:7", "ns1")
    assert etcd_settings(False, None) is None
    assert etcd_settings(None, EtcdSettings("h", "ns2", ttl_s=3)) == EtcdSettings("http://h:2379", "ns2", ttl_s=3)
    with pytest.raises(ValueError, match="'bad/ns'"):
        etcd_settings(None, EtcdSettings(namespace="bad/ns"))
    with pytest.raises(ValueError, match="at least 2 s"):
        etcd_settings(None, EtcdSettings(ttl_s=1))
    with pytest.raises(ValueError, match="'ftp://x'"):
        etcd_settings(True, EtcdSettings("ftp://x"))


# --- EtcdMetadata alone ---------------------------------------------------------------------
def test_published_under_a_lease_newer_generations_and_revoked_at_close(settings: EtcdSettings,
                                                                       client: EtcdClient) -> None:
    blob = [b"first"]
    meta = EtcdMetadata("agent-a", settings, lambda: blob[0])
    try:
        meta.publish(required=True)
        key = metadata_key(settings.namespace or "", "agent-a")
        assert key == f"/kvxfer/{settings.namespace}/nixl/agent-a" == meta.key
        first = Published.decode(client.get(key) or b"")
        assert first == Published(meta.version, b"first") and meta.version.generation == 1
        assert meta.token == meta.version.token
        blob[0] = b"second, with more regions"
        meta.publish()
        second = Published.decode(client.get(key) or b"")
        assert second.metadata == blob[0]
        assert second.version.instance == first.version.instance and second.version.generation == 2
        assert second.version.covers(first.version)
        assert meta.lookup("agent-a") == second
    finally:
        meta.close()
    assert client.get(key) is None, "close() did not take the key away"


def test_lookups_of_a_missing_peer_are_rate_limited_then_find_it(settings: EtcdSettings) -> None:
    meta = EtcdMetadata("asker", settings, lambda: b"mine")
    late = EtcdMetadata("late-peer", settings, lambda: b"late peer's metadata")
    try:
        meta.publish(required=True)
        asked, end = 0, time.monotonic() + 3.0
        while time.monotonic() < end:  # as a progress thread would: every step
            assert meta.lookup("late-peer") is None
            asked += 1
            time.sleep(0.001)
        print(f"3 s of asking: {asked} calls, {meta.lookups} lookups reached etcd")
        assert meta.lookups <= 10, f"{meta.lookups} lookups of a missing peer in 3 s"
        assert meta.lookups >= 3 and meta.skipped == asked - meta.lookups
        late.publish(required=True)
        found_at = time.monotonic()
        assert settle(lambda: meta.lookup("late-peer") is not None, timeout=MAX_DELAY_S + SLACK, step=0.01)
        assert time.monotonic() - found_at <= MAX_DELAY_S + SLACK
        meta.found("late-peer")
        before = meta.lookups
        assert meta.lookup("late-peer") is not None and meta.lookups == before + 1, "found() did not reset"
    finally:
        late.close()
        meta.close()


def test_a_lost_lease_is_replaced_and_the_key_put_again() -> None:
    with EtcdServer() as server:
        settings = EtcdSettings(server.endpoint, _namespace(), ttl_s=TTL, timeout_s=0.5)
        client = EtcdClient(server.endpoint, timeout=5.0)
        meta = EtcdMetadata("phoenix", settings, lambda: b"metadata", retry_s=0.2)
        try:
            meta.publish(required=True)
            first_lease = meta.lease_id
            server.pause()
            try:  # keepalives fail for a whole TTL: the lease is lost
                assert settle(lambda: meta.error != "", timeout=TTL + 0.5 + SLACK + 5, step=0.05)
            finally:
                server.resume()
            assert settle(lambda: meta.lease_id not in (None, first_lease) and meta.published == meta.version
                          and client.get(meta.key) is not None, timeout=15, step=0.1), meta.error
            record = Published.decode(client.get(meta.key) or b"")
            assert record == Published(meta.version, b"metadata")
            answer = client.call("range", lambda c: c.post(c.get_url("/kv/range"), json={
                "key": __import__("base64").b64encode(meta.key.encode()).decode()}))
            assert int(answer["kvs"][0]["lease"]) == meta.lease_id, "the key is not under the new lease"
            assert meta.publishes >= 2
        finally:
            meta.close()


def test_etcd_unreachable_at_construction_is_named_at_once() -> None:
    endpoint = f"http://127.0.0.1:{_free_port()}"
    started = time.monotonic()
    with pytest.raises(EtcdUnavailable) as caught:
        EtcdMetadata("nobody", EtcdSettings(endpoint, timeout_s=TIMEOUT), lambda: b"")
    assert endpoint in str(caught.value)
    assert isinstance(caught.value, KvxferError)
    assert time.monotonic() - started < TIMEOUT + SLACK


# --- NixlBackends in this process -----------------------------------------------------------
def _view(memory: HostRows, index: int, request: str, slots: list[int]) -> View:
    region = memory.regions[index]
    chosen = np.asarray(slots, dtype=np.int64)
    group = LayerGroupRows("g", CacheKind.PAGED, region, chosen, np.arange(chosen.size, dtype=np.int64))
    return View(request, TokenRange(0, 16 * chosen.size), (group,), b"etcd-layout")


def _push(publisher: NixlBackend, pmem: HostRows, fetcher: NixlBackend, fmem: HostRows, request: str,
          pindex: int = 0, findex: int = 0) -> TrackedAttempt:
    """Push 12 scattered rows; both ends Delivered with every row, and the bytes equal. The
    publisher's attempt."""
    pslots, fslots = [3, 4, 5, 9, 11, 20, 21, 30, 31, 32, 40, 47], [0, 2, 4, 6, 8, 10, 12, 14, 15, 16, 33, 34]
    pview, fview = _view(pmem, pindex, request, pslots), _view(fmem, findex, request, fslots)
    payload = np.random.default_rng(len(request)).integers(0, 256, len(pslots) * ROW, dtype=np.uint8).tobytes()
    pmem.write(pmem.regions[pindex].name, np.asarray(pslots), payload)
    fmem.write(fmem.regions[findex].name, np.asarray(fslots), b"\x5a" * len(payload))
    fhint = fetcher.describe(fview)
    assert parse_token(fhint.endpoint) is not None and len(fhint.endpoint) < 64, fhint.endpoint
    fetch = fetcher.fetch(fview, publisher.describe(pview))
    publish = publisher.publish(pview, fhint)
    assert publish.wait(20) and fetch.wait(20)
    for outcome in (publish.poll(), fetch.poll()):
        assert isinstance(outcome, Delivered) and outcome.all_delivered, outcome
    assert fmem.read(fmem.regions[findex].name, np.asarray(fslots)) == payload
    return publish


@pytest.fixture
def backends(settings: EtcdSettings) -> Iterator[list[NixlBackend]]:
    made: list[NixlBackend] = []
    yield made
    left = [backend.shutdown() for backend in made]
    assert left == [frozenset()] * len(made)


def _backend(made: list[NixlBackend], settings: EtcdSettings, memory: HostRows | None = None, **options: object
             ) -> NixlBackend:
    options = {"deadline_s": 10.0, **options}
    backend = NixlBackend(mode=TransferMode.PUSH, etcd=settings, **options)  # type: ignore[arg-type]
    made.append(backend)
    if memory is not None:
        backend.register(memory.regions)
    return backend


def test_nixl_agents_use_kvxfers_keys_never_nixls_own_backend_or_port_8888(
        etcd_server: EtcdServer, client: EtcdClient, monkeypatch: pytest.MonkeyPatch,
        backends: list[NixlBackend]) -> None:
    namespace = _namespace()
    monkeypatch.setenv("NIXL_ETCD_ENDPOINTS", etcd_server.endpoint)
    monkeypatch.setenv("KVXFER_ETCD_NAMESPACE", namespace)
    amem, bmem = host_rows((("A", ROW, 48),)), host_rows((("B", ROW, 48),))
    a, b = NixlBackend(deadline_s=10.0), NixlBackend(deadline_s=10.0)  # etcd mode from the environment
    backends += [a, b]
    a.register(amem.regions)
    b.register(bmem.regions)
    assert os.environ["NIXL_ETCD_ENDPOINTS"] == etcd_server.endpoint, "the variable was not restored"
    _push(a, amem, b, bmem, "env-mode")
    keys, _ = client.get_prefix(f"/kvxfer/{namespace}/nixl/")
    assert set(keys) == {f"/kvxfer/{namespace}/nixl/{a.name}", f"/kvxfer/{namespace}/nixl/{b.name}"}
    assert client.get_prefix("/nixl/")[0] == {}, "NIXL's own etcd backend wrote keys"
    assert 8888 not in listening_ports(os.getpid())


def test_a_peer_that_registers_more_memory_later_is_still_reachable(settings: EtcdSettings,
                                                                     backends: list[NixlBackend]) -> None:
    amem, bmem = host_rows((("A", ROW, 48),)), host_rows((("B1", ROW, 48), ("B2", ROW, 48)))
    a = _backend(backends, settings, amem)
    b = _backend(backends, settings)
    b.register(bmem.regions[:1])
    _push(a, amem, b, bmem, "first", findex=0)
    assert a._agent.knows(b.name)
    token_before = b.describe(_view(bmem, 0, "probe", [0])).endpoint
    b.register(bmem.regions[1:])  # B's metadata grows: a new generation in etcd
    token_after = b.describe(_view(bmem, 1, "probe2", [0])).endpoint
    before, after = parse_token(token_before), parse_token(token_after)
    assert before is not None and after is not None and after.generation > before.generation
    etcd = a._agent.etcd
    assert etcd is not None
    asked = etcd.lookups
    _push(a, amem, b, bmem, "into-new-region", findex=1)
    assert etcd.lookups > asked, "the newer metadata was not looked up"
    _push(a, amem, b, bmem, "first-region-again", findex=0)


def test_a_packed_push_whose_ends_load_each_other_from_etcd(settings: EtcdSettings,
                                                             backends: list[NixlBackend]) -> None:
    # The packed path sends notes both ways (the fetcher's credits need the publisher loaded).
    packed = {"packed": "always", "packed_chunk_bytes": 4 * ROW, "arena_bytes": 16 * ROW}
    amem, bmem = host_rows((("A", ROW, 48),)), host_rows((("B", ROW, 48),))
    a = _backend(backends, settings, amem, **packed)
    b = _backend(backends, settings, bmem, **packed)
    attempt = _push(a, amem, b, bmem, "packed")
    assert a.path_of(attempt) == "packed"


def test_a_peer_restarted_under_its_name_is_reached_and_its_old_hints_refused(
        settings: EtcdSettings, backends: list[NixlBackend]) -> None:
    amem, bmem = host_rows((("A", ROW, 48),)), host_rows((("B", ROW, 48),))
    a = _backend(backends, settings, amem)
    first = _backend(backends, settings, bmem)
    _push(a, amem, first, bmem, "before-restart")
    stale = first.describe(_view(bmem, 0, "stale", [1, 2]))
    assert first.shutdown() == frozenset()
    backends.remove(first)
    bmem2 = host_rows((("B", ROW, 48),))
    second = _backend(backends, settings, bmem2, name=first.name)  # the same name, another process's state
    _push(a, amem, second, bmem2, "after-restart")
    view = _view(amem, 0, "stale", [1, 2])
    a.describe(view)
    attempt = a.publish(view, stale)
    assert attempt.wait(10)
    outcome = attempt.poll()
    assert isinstance(outcome, Failed) and "replaced" in outcome.reason, outcome
    assert not any(m.any() for m in outcome.masks)


def test_lookups_of_peers_not_in_etcd_yet_are_rate_limited_then_they_are_found(
        settings: EtcdSettings, client: EtcdClient, backends: list[NixlBackend]) -> None:
    amem, bmem = host_rows((("A", ROW, 48),)), host_rows((("B", ROW, 48),))
    a = _backend(backends, settings, amem, deadline_s=30.0)
    b = _backend(backends, settings, bmem, deadline_s=30.0)
    a_etcd, b_etcd = a._agent.etcd, b._agent.etcd
    assert a_etcd is not None and b_etcd is not None
    # Both keys gone (as if etcd had lost them): neither end can load the other.
    client.delete(a_etcd.key)
    client.delete(b_etcd.key)
    pslots, fslots = [1, 2, 3, 10, 11], [5, 6, 7, 20, 21]
    pview, fview = _view(amem, 0, "late", pslots), _view(bmem, 0, "late", fslots)
    payload = np.random.default_rng(9).integers(0, 256, len(pslots) * ROW, dtype=np.uint8).tobytes()
    amem.write("A", np.asarray(pslots), payload)
    phint, fhint = a.describe(pview), b.describe(fview)
    fetch = b.fetch(fview, phint)      # passive: asks for A every heartbeat
    publish = a.publish(pview, fhint)  # active: asks for B every progress step
    time.sleep(3.0)
    print(f"3 s without keys: A made {a_etcd.lookups} lookups ({a_etcd.skipped} held back), "
          f"B made {b_etcd.lookups} ({b_etcd.skipped} held back)")
    assert a_etcd.lookups <= 10 and b_etcd.lookups <= 10, (a_etcd.lookups, b_etcd.lookups)
    assert a_etcd.skipped >= 20, "the progress thread did not ask as often as expected: the test proves nothing"
    assert publish.poll() is None and fetch.poll() is None
    a_etcd.publish()
    b_etcd.publish()
    assert publish.wait(20) and fetch.wait(20)
    for outcome in (publish.poll(), fetch.poll()):
        assert isinstance(outcome, Delivered) and outcome.all_delivered, outcome
    assert bmem.read("B", np.asarray(fslots)) == payload


def test_a_backend_without_etcd_refuses_a_token_hint_by_name(settings: EtcdSettings,
                                                             backends: list[NixlBackend]) -> None:
    amem, bmem = host_rows((("A", ROW, 48),)), host_rows((("B", ROW, 48),))
    plain = NixlBackend(mode=TransferMode.PUSH, use_etcd=False, deadline_s=10.0)
    backends.append(plain)
    plain.register(amem.regions)
    b = _backend(backends, settings, bmem)
    view = _view(amem, 0, "r", [1])
    plain.describe(view)
    with pytest.raises(InvalidSubmission, match="names its NIXL metadata in etcd"):
        plain.publish(view, b.describe(_view(bmem, 0, "r", [1])))


def test_etcd_unreachable_or_paused_at_construction_raises_naming_it(etcd_server: EtcdServer) -> None:
    nobody = f"http://127.0.0.1:{_free_port()}"
    started = time.monotonic()
    with pytest.raises(EtcdUnavailable) as caught:
        NixlBackend(etcd=EtcdSettings(nobody, timeout_s=TIMEOUT))
    assert nobody in str(caught.value)
    assert time.monotonic() - started < TIMEOUT + SLACK
    etcd_server.pause()
    try:
        started = time.monotonic()
        with pytest.raises(EtcdUnavailable) as caught:
            NixlBackend(etcd=EtcdSettings(etcd_server.endpoint, timeout_s=TIMEOUT))
        assert etcd_server.endpoint in str(caught.value)
        assert time.monotonic() - started < TIMEOUT + SLACK
    finally:
        etcd_server.resume()


def test_shutdown_with_etcd_paused_finishes_within_the_timeout(etcd_server: EtcdServer, settings: EtcdSettings,
                                                                client: EtcdClient) -> None:
    amem, bmem = host_rows((("A", ROW, 48),)), host_rows((("B", ROW, 48),))
    a = NixlBackend(mode=TransferMode.PUSH, etcd=settings, deadline_s=10.0)
    b = NixlBackend(mode=TransferMode.PUSH, etcd=settings, deadline_s=10.0)
    a.register(amem.regions)
    b.register(bmem.regions)
    try:
        _push(a, amem, b, bmem, "before-pause")
        etcd_server.pause()
        for backend in (a, b):
            started = time.monotonic()
            assert backend.shutdown() == frozenset()
            took = time.monotonic() - started
            print(f"shutdown with etcd paused: {took:.2f} s (client timeout {TIMEOUT} s)")
            assert took < TIMEOUT + SLACK
    finally:
        etcd_server.resume()
        a.shutdown()
        b.shutdown()
    # Not revoked (etcd did not answer): the keys go when their TTL ends.
    assert settle(lambda: client.get_prefix(f"/kvxfer/{settings.namespace}/nixl/")[0] == {}, timeout=TTL + 10,
                  step=0.1)
