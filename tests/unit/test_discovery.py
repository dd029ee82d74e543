"""Discovery (kvxfer.serving.discovery) against a real etcd: the worker record's codec, a
worker's registration under a kept lease, and a router's membership following etcd's keys
(added, refused, removed when revoked or when the lease lapses)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import Callable
from typing import Any

import pytest

from kvxfer.etcd import EtcdClient
from kvxfer.router import Router
from kvxfer.serving.discovery import (
    Membership,
    RecordedKV,
    RecordedTransport,
    RecordError,
    Registration,
    WorkerRecord,
    namespace_from,
    with_health,
    worker_key,
    workers_prefix,
)
from kvxfer.serving.http import Request, Response
from kvxfer.testing.etcd_server import EtcdServer


def record(role: str = "prefill", port: int = 8001, *, model: str = "toy", scope: str = "ab" * 16,
           backend: str = "nixl", mode: str = "push", **extra: Any) -> WorkerRecord:
    return WorkerRecord(role, f"http://127.0.0.1:{port}", model, RecordedKV(16, "float32", scope),
                        RecordedTransport(backend, mode, "inplace"), name=f"{role}-{port}", host="h", pid=port,
                        started=1.5, **extra)


def wait_for(condition: Callable[[], bool], timeout: float, what: str) -> float:
    """Seconds until ``condition`` held (polled); AssertionError naming ``what`` after ``timeout``."""
    start = time.monotonic()
    while not condition():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"not within {timeout} s: {what}")
        time.sleep(0.05)
    return time.monotonic() - start


async def until(condition: Callable[[], bool], timeout: float, what: str) -> float:
    start = time.monotonic()
    while not condition():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"not within {timeout} s: {what}")
        await asyncio.sleep(0.05)
    return time.monotonic() - start


# --- the record ---------------------------------------------------------------------------------
def test_a_record_round_trips_and_names_its_key() -> None:
    r = record("decode", 9002)
    assert WorkerRecord.decode(r.encode()) == r
    assert r.id == "127.0.0.1:9002"
    assert r.key("ns") == "/kvxfer/ns/workers/decode/127.0.0.1:9002" == worker_key("ns", "decode", r.id)
    assert r.key("ns").startswith(workers_prefix("ns"))
    raw = json.loads(r.encode())
    assert raw["v"] == 1 and raw["layout"]["block_tokens"] == 16 and raw["capabilities"]["backend"] == "nixl"


def test_a_record_from_a_newer_writer_keeps_what_it_knows() -> None:
    raw = json.loads(record().encode())
    raw["gpu_count"] = 8
    raw["layout"]["sliding_window"] = 4096
    assert WorkerRecord.decode(json.dumps(raw).encode()) == record()


@pytest.mark.parametrize(("change", "words"), [
    (lambda raw: raw.update(v=2), "version 2"),
    (lambda raw: raw.pop("url"), "lacks 'url'"),
    (lambda raw: raw.update(pid="12"), "pid must be int"),
    (lambda raw: raw.update(pid=True), "pid must be int"),
    (lambda raw: raw["layout"].update(tp="2"), "layout: tp must be int"),
    (lambda raw: raw.update(capabilities=[]), "capabilities is not a JSON object"),
    (lambda raw: raw.update(role="router"), "role must be one of"),
    (lambda raw: raw.update(url="http://127.0.0.1"), "is not http://HOST:PORT"),
])
def test_a_bad_record_is_refused_by_name(change: Callable[[dict[str, Any]], Any], words: str) -> None:
    raw = json.loads(record().encode())
    change(raw)
    with pytest.raises(RecordError, match=words):
        WorkerRecord.decode(json.dumps(raw).encode())
    with pytest.raises(RecordError, match="not JSON"):
        WorkerRecord.decode(b"\xff{")


def test_the_namespace_comes_from_the_flag_the_environment_or_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVXFER_ETCD_NAMESPACE", raising=False)
    assert namespace_from(None) == "default"
    monkeypatch.setenv("KVXFER_ETCD_NAMESPACE", "team-a")
    assert namespace_from(None) == "team-a" and namespace_from("b.2") == "b.2"
    for bad in ("a/b", "-x", "x" * 65, "sp ace"):
        with pytest.raises(ValueError, match="etcd namespace"):
            namespace_from(bad)


def test_health_gets_the_discovery_state_and_nothing_else_changes() -> None:
    async def inner(request: Request) -> Response:
        if request.path == "/health":
            return Response.json({"status": "ok"}, 503)
        return Response.json([1])

    handler = with_health(inner, "discovery", lambda: {"registered": True})

    async def go() -> None:
        health = await handler(Request("GET", "/health", {}, b""))
        assert health.status == 503 and json.loads(health.body) == {"status": "ok", "discovery": {"registered": True}}
        assert json.loads((await handler(Request("GET", "/other", {}, b""))).body) == [1]
        assert json.loads((await handler(Request("POST", "/health", {}, b""))).body) == {"status": "ok"}
    asyncio.run(go())


# --- against a real etcd ------------------------------------------------------------------------
@pytest.fixture
def client(etcd_server: EtcdServer) -> EtcdClient:
    return EtcdClient(etcd_server.endpoint, timeout=2.0)


def test_a_registration_lists_the_worker_until_it_closes(client: EtcdClient) -> None:
    reg = Registration(client, "reg", ttl=3)
    reg.start(record())
    try:
        assert WorkerRecord.decode(client.get(reg.key) or b"") == record()
        state = reg.state()
        assert state["registered"] and state["registrations"] == 1 and state["key"] == reg.key and state["lease"]
    finally:
        started = time.monotonic()
        reg.close()
    assert time.monotonic() - started < client.timeout  # revoked, not left to lapse
    assert client.get(reg.key) is None and not reg.registered


def test_a_registration_that_cannot_reach_etcd_raises_and_leaves_nothing() -> None:
    from kvxfer.etcd import EtcdUnavailable

    reg = Registration(EtcdClient("http://127.0.0.1:1", timeout=0.5), "reg", ttl=2)
    with pytest.raises(EtcdUnavailable, match="127.0.0.1:1"):
        reg.start(record())
    reg.close()


def _membership(client: EtcdClient, namespace: str, router: Router, **kw: Any) -> Membership:
    m = Membership(client, namespace, router, quiet_s=1.0, **kw)
    m.start()
    return m


def test_membership_adds_refuses_and_removes_workers(client: EtcdClient) -> None:
    ns = "members"
    first = Registration(client, ns, ttl=3)
    first.start(record("prefill", 8001))

    async def go() -> None:
        async with Router([], ["http://127.0.0.1:7000"]) as router:  # one static decode worker
            m = _membership(client, ns, router)
            try:
                assert await m.synced(10)
                assert [e.url for e in router.prefill] == ["http://127.0.0.1:8001"]  # there before the start
                regs = [Registration(client, ns, ttl=3) for _ in range(6)]
                regs[0].start(record("decode", 8002))
                regs[1].start(record("decode", 8003, model="smollm2"))  # another model: refused
                regs[2].start(record("decode", 8004, scope="cd" * 16))  # same name, other weights: refused
                regs[3].start(record("decode", 7000))  # the static worker's URL: refused, and kept
                regs[4].start(record("decode", 8005, backend="ipc"))  # another transport: refused
                regs[5].start(record("decode", 8006, mode="pull"))
                client.put(worker_key(ns, "prefill", "junk:1"), b"not json")
                await until(lambda: len(m.refused) == 6, 10, "six refusals")
                assert sorted(e.url for e in router.decode) == ["http://127.0.0.1:7000", "http://127.0.0.1:8002"]
                reasons = sorted(m.refused.values())
                assert any("serves model 'smollm2', this router 'toy'" in r for r in reasons), reasons
                assert any("other weights or KV dtype" in r for r in reasons), reasons
                assert any("already in the router" in r for r in reasons), reasons
                assert any("not JSON" in r for r in reasons), reasons
                assert "it moves KV with ipc push, this router's workers with nixl push" in reasons, reasons
                assert "it moves KV with nixl pull, this router's workers with nixl push" in reasons, reasons
                state = m.state()
                assert state["synced"] and state["model"] == "toy" and len(state["members"]) == 2

                regs[0].close()   # revoked: gone at once
                regs[3].close()   # the static worker stays
                first.close()
                await until(lambda: not router.prefill and len(router.decode) == 1, 5, "revoked workers removed")
                assert [e.url for e in router.decode] == ["http://127.0.0.1:7000"]
                client.delete(worker_key(ns, "prefill", "junk:1"))
                for r in regs[1:3] + regs[4:]:
                    r.close()
                await until(lambda: not m.refused and not m.members, 5, "refusals forgotten")
            finally:
                m.close()
    asyncio.run(go())


def test_a_lapsed_lease_removes_the_worker_and_a_new_one_rejoins(client: EtcdClient) -> None:
    """A worker whose lease is not refreshed (a stopped process) is removed once its TTL ends."""
    ns = "lapse"

    async def go() -> None:
        async with Router([], []) as router:
            m = _membership(client, ns, router)
            try:
                assert await m.synced(10)
                lease = client.grant(2)  # nobody keeps it alive
                put_at = time.monotonic()
                client.put(record().key(ns), record().encode(), lease=lease)
                await until(lambda: len(router.prefill) == 1, 5, "the worker added")
                took = await until(lambda: not router.prefill, 15, "the lapsed worker removed")
                lapsed = time.monotonic() - put_at
                assert 1.0 < lapsed < 15, (lapsed, took)
                later = dataclasses.replace(record(), started=2.5)
                reg = Registration(client, ns, ttl=3)
                reg.start(later)
                await until(lambda: [e.url for e in router.prefill] == [later.url], 5, "it joins again")
                assert m.members[later.key(ns)] == later
                reg.close()
                await until(lambda: not router.prefill, 5, "revoked")
            finally:
                m.close()
    asyncio.run(go())


def test_a_restarted_worker_on_the_same_url_gets_a_fresh_endpoint(client: EtcdClient) -> None:
    ns = "restart"

    async def go() -> None:
        async with Router([], []) as router:
            m = _membership(client, ns, router)
            try:
                assert await m.synced(10)
                reg = Registration(client, ns, ttl=3)
                reg.start(record())
                await until(lambda: len(router.prefill) == 1, 5, "added")
                endpoint = router.prefill[0]
                endpoint.publisher = {"agent": "old", "run": "old"}
                client.put(reg.key, dataclasses.replace(record(), pid=99, started=9.0).encode(),
                           lease=reg._lease.handle if reg._lease else None)
                await until(lambda: router.prefill and router.prefill[0] is not endpoint, 5, "re-added")
                assert router.prefill[0].publisher is None
                reg.close()
            finally:
                m.close()
    asyncio.run(go())


def test_a_url_refused_while_another_key_holds_it_goes_in_once_that_key_is_gone(client: EtcdClient) -> None:
    """A worker restarted on its port in the other role, while its old key has not lapsed yet."""
    ns = "roles"

    async def go() -> None:
        async with Router([], []) as router:
            m = _membership(client, ns, router)
            try:
                assert await m.synced(10)
                old, new = Registration(client, ns, ttl=3), Registration(client, ns, ttl=3)
                old.start(record("prefill", 8001))
                await until(lambda: len(router.prefill) == 1, 5, "the prefill worker added")
                new.start(record("decode", 8001))
                await until(lambda: len(m.refused) == 1, 5, "the decode key refused")
                assert "already in the router" in next(iter(m.refused.values()))
                old.close()
                await until(lambda: not router.prefill and len(router.decode) == 1, 5, "the decode worker added")
                assert not m.refused
                new.close()
                await until(lambda: not router.decode, 5, "removed")
            finally:
                m.close()
    asyncio.run(go())


def test_a_registration_comes_back_after_etcd_was_away_longer_than_its_ttl(etcd_server: EtcdServer,
                                                                           client: EtcdClient) -> None:
    """Last in the module: it stops etcd for a while."""
    reg = Registration(client, "away", ttl=2, retry_s=0.2)
    reg.start(record())
    try:
        etcd_server.pause()
        try:
            wait_for(lambda: not reg.registered, 20, "the lease given up as lost")
        finally:
            etcd_server.resume()
        wait_for(lambda: reg.registered and reg.registrations == 2, 20, "registered again under a new lease")
        assert WorkerRecord.decode(client.get(reg.key) or b"") == record()
        assert "lease" in reg.state()["error"] or "etcd" in reg.state()["error"]
    finally:
        reg.close()
    assert client.get(reg.key) is None


# --- the command lines ----------------------------------------------------------------------------
def _free_port() -> int:
    import socket

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        return int(held.getsockname()[1])


@pytest.mark.parametrize(("command", "flags", "words"), [
    ("router", ["--etcd", "http://127.0.0.1:{port}"], "--etcd http://127.0.0.1:{port}: etcd does not answer"),
    ("router", ["--etcd", "ftp://x"], "--etcd: etcd endpoint 'ftp://x' is not http://host:port"),
    ("router", ["--etcd", "http://127.0.0.1:1", "--etcd-namespace", "a/b"], "--etcd: etcd namespace 'a/b'"),
    ("serve", ["--etcd", "http://127.0.0.1:{port}"], "--etcd http://127.0.0.1:{port}: etcd does not answer"),
    ("serve", ["--etcd", "http://127.0.0.1:1", "--etcd-ttl", "1"], "--etcd-ttl: an etcd lease TTL must be at least 2 s, not 1"),
])
def test_the_commands_refuse_etcd_flags_that_cannot_work_in_one_line(
        command: str, flags: list[str], words: str, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    from kvxfer.router import serve as router_serve
    from kvxfer.worker import serve as worker_serve

    module = router_serve if command == "router" else worker_serve
    def reached(*args: object) -> None:
        raise AssertionError("went on to serve")
    monkeypatch.setattr(module, "reserve_stdout", reached)
    port = _free_port()
    argv = [f.format(port=port) for f in flags] + (["--role", "prefill"] if command == "serve" else [])
    with pytest.raises(SystemExit) as exc:
        module.main(argv)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert exc.value.code == 2 and "Traceback" not in err, err
    assert lines[-1].startswith(f"kvxfer {command}: error: ") and words.format(port=port) in lines[-1], err


def test_a_router_without_static_workers_needs_etcd(monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    from kvxfer.router import serve as router_serve

    monkeypatch.delenv("NIXL_ETCD_ENDPOINTS", raising=False)
    with pytest.raises(SystemExit):
        router_serve.main([])
    assert "at least one --decode URL is required, or --etcd to discover the workers" in capsys.readouterr().err


def test_a_worker_whose_registration_fails_says_so_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    """etcd went away between the start-up check and the registration: no ready line, exit 2."""
    from kvxfer.worker.serve import _register

    reg = Registration(EtcdClient(f"http://127.0.0.1:{_free_port()}", timeout=0.5), "x", ttl=2)
    assert asyncio.run(_register(reg, record())) is False
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("kvxfer serve: error: --etcd http://127.0.0.1:"), err
    assert "cannot register this worker: etcd lease grant" in err, err
