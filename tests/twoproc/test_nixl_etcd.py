"""NIXL between processes with agents' metadata in a real etcd (the ``etcd_server``
fixture), hints carrying only a token: byte-exact push and pull with exact masks, three
agents in three processes of one host at once (no metadata port, none on 8888), a SIGKILLed
peer's key gone within its TTL, a worker whose etcd does not answer failing to start and
naming it, a process that exits promptly with etcd paused, and clean shutdowns that log
nothing of NIXL's own etcd backend ("Failed to invalidate remote metadata")."""

from __future__ import annotations

import os
import secrets
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest

from kvxfer.backends.nixl import EtcdSettings, NixlBackend
from kvxfer.backends.nixl.etcd_metadata import metadata_key, parse_token
from kvxfer.contract import CacheKind, Delivered, LayerGroupRows, SlotRegion, TokenRange, TransferMode, View
from kvxfer.etcd import EtcdClient
from kvxfer.testing.etcd_server import EtcdServer
from kvxfer.testing.memory import HostRows
from kvxfer.testing.nixl_pairs import host_rows
from kvxfer.testing.processes import listening_ports
from kvxfer.testing.subprocess_peer import SubprocessPeer
from kvxfer.testing.waiting import settle
from kvxfer.wire import decode_hint, encode_hint

FACTORY = "kvxfer.testing.nixl_pairs:child_backend"
ROW = 2048
LOCAL = (("L", ROW, 96),)
PEER = [["P", ROW, 80]]
TTL = 3
TIMEOUT = 1.0
SLACK = 3.0  # a loaded 2-core machine
NAMESPACE = f"twoproc-{secrets.token_hex(4)}"


@pytest.fixture(scope="module")
def etcd_env(etcd_server: EtcdServer) -> dict[str, str]:
    return {"NIXL_ETCD_ENDPOINTS": etcd_server.endpoint, "KVXFER_ETCD_NAMESPACE": NAMESPACE}


@pytest.fixture(scope="module")
def client(etcd_server: EtcdServer) -> EtcdClient:
    return EtcdClient(etcd_server.endpoint, timeout=5.0)


def _settings(etcd_server: EtcdServer, **options: Any) -> dict[str, Any]:
    return {"endpoints": etcd_server.endpoint, "namespace": NAMESPACE, "ttl_s": TTL, "timeout_s": TIMEOUT, **options}


@contextmanager
def _child(env: dict[str, str], mode: TransferMode = TransferMode.PUSH) -> Iterator[SubprocessPeer]:
    """A peer process in etcd mode from its environment, as a worker's would be; closed at the end."""
    peer = SubprocessPeer(FACTORY, {"mode": mode.value, "buffers": PEER}, env=env)
    try:
        yield peer
    finally:
        peer.close()


def _local(etcd_server: EtcdServer, mode: TransferMode, memory: HostRows) -> NixlBackend:
    backend = NixlBackend(mode=mode, deadline_s=15.0, etcd=EtcdSettings(**_settings(etcd_server)))
    backend.register(memory.regions)
    return backend


def _view(region: SlotRegion, request: str, slots: np.ndarray, held: int = 0) -> View:
    ordinals = np.arange(slots.size, dtype=np.int64)
    group = LayerGroupRows("g", CacheKind.PAGED, region, slots[held:], ordinals[held:])
    return View(request, TokenRange(0, 16 * slots.size), (group,), b"etcd-twoproc")


def _slots(seed: int, total: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).permutation(total)[:n].astype(np.int64)


def _disjoint(seed: int, total: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Two sets of ``n`` scattered slots that share none."""
    order = np.random.default_rng(seed).permutation(total).astype(np.int64)
    return order[:n], order[n:2 * n]


def _token_only(hint_bytes: bytes) -> None:
    endpoint = decode_hint(hint_bytes).endpoint
    assert parse_token(endpoint) is not None and len(endpoint) < 64, endpoint
    assert b"nixlSerDes" not in hint_bytes, "the hint carries NIXL metadata"


# --- rows between two processes -------------------------------------------------------------
@pytest.mark.parametrize("mode", list(TransferMode), ids=lambda m: m.value)
def test_push_and_pull_with_token_hints_are_byte_exact_with_exact_masks(
        mode: TransferMode, etcd_server: EtcdServer, etcd_env: dict[str, str]) -> None:
    with _child(etcd_env, mode) as peer:
        _push_and_pull(mode, etcd_server, peer)


def _push_and_pull(mode: TransferMode, etcd_server: EtcdServer, second: SubprocessPeer) -> None:
    memory = host_rows(LOCAL)
    local = _local(etcd_server, mode, memory)
    try:
        region, peer_region = memory.regions[0], second.regions[0]
        # This end publishes every row; then it fetches while holding a prefix of 10.
        for step, (local_op, held) in enumerate((("publish", 0), ("fetch", 10))):
            n = 40
            lslots, pslots = _slots(2 * step, region.slots, n), _slots(2 * step + 1, peer_region.slots, n)
            request = f"{mode.value}-{local_op}"
            lview, pview = _view(region, request, lslots, held), _view(peer_region, request, pslots)
            payload = np.random.default_rng(step).integers(0, 256, n * ROW, dtype=np.uint8).tobytes()
            if local_op == "publish":
                memory.write("L", lslots, payload)
                second.write("P", pslots, b"\x5a" * len(payload))
            else:
                second.write("P", pslots, payload)
                memory.write("L", lslots, b"\x5a" * len(payload))
            local_hint = encode_hint(local.describe(lview))
            peer_hint = second.describe_bytes(pview)
            _token_only(local_hint)
            _token_only(peer_hint)
            handle = second.start_bytes("fetch" if local_op == "publish" else "publish", pview, local_hint)
            attempt = (local.publish if local_op == "publish" else local.fetch)(lview, decode_hint(peer_hint))
            assert attempt.wait(30), "the local attempt did not conclude and quiesce"
            peer_outcome, quiet = second.result(handle, 30.0)
            outcome = attempt.poll()
            assert quiet and isinstance(outcome, Delivered) and outcome.all_delivered, outcome
            assert isinstance(peer_outcome, Delivered), peer_outcome
            if local_op == "publish":
                assert second.read("P", pslots) == payload
                assert peer_outcome.all_delivered
            else:
                got = memory.read("L", lslots)
                assert got[held * ROW:] == payload[held * ROW:], "the rows fetched differ"
                assert got[:held * ROW] == b"\x5a" * (held * ROW), "rows this end held were written"
                mask = np.asarray(peer_outcome.masks[0])  # the publisher learns exactly which rows were taken
                assert not mask[:held].any() and mask[held:].all()
    finally:
        assert local.shutdown() == frozenset()
        assert second.shutdown() == 0


def test_three_agents_in_three_processes_at_once(etcd_server: EtcdServer, etcd_env: dict[str, str],
                                                 client: EtcdClient) -> None:
    with _child(etcd_env) as second, _child(etcd_env) as third:
        _ring(etcd_server, second, third, client)
    assert settle(lambda: client.get(metadata_key(NAMESPACE, third.agent)) is None, timeout=5), \
        "a cleanly closed agent's key stayed"


def _ring(etcd_server: EtcdServer, second: SubprocessPeer, third: SubprocessPeer, client: EtcdClient) -> None:
    memory = host_rows(LOCAL)
    local = _local(etcd_server, TransferMode.PUSH, memory)
    try:
        names = {local.name, second.agent, third.agent}
        assert len(names) == 3
        keys, _ = client.get_prefix(f"/kvxfer/{NAMESPACE}/nixl/")
        assert {metadata_key(NAMESPACE, n) for n in names} <= set(keys)
        for pid in (os.getpid(), second.pid, third.pid):
            assert 8888 not in listening_ports(pid), f"process {pid} listens on NIXL's port 8888"
        n = 24
        # A ring, all at once: this process -> child 1 -> child 2 -> this process.
        payloads = [np.random.default_rng(10 + i).integers(0, 256, n * ROW, dtype=np.uint8).tobytes() for i in range(3)]
        lslots_out, lslots_in = _disjoint(20, 96, n)
        c1_in, c1_out = _disjoint(21, 80, n)
        c2_in, c2_out = _disjoint(22, 80, n)
        region = memory.regions[0]
        memory.write("L", lslots_out, payloads[0])
        second.write("P", c1_out, payloads[1])
        third.write("P", c2_out, payloads[2])
        # local -> child 1
        v_l_out, v_c1_in = _view(region, "ring-0", lslots_out), _view(second.regions[0], "ring-0", c1_in)
        h_c1_in = second.describe_bytes(v_c1_in)
        f1 = second.start_bytes("fetch", v_c1_in, encode_hint(local.describe(v_l_out)))
        p0 = local.publish(v_l_out, decode_hint(h_c1_in))
        # child 1 -> child 2 (hints straight from one child to the other, as a router carries them)
        v_c1_out, v_c2_in = _view(second.regions[0], "ring-1", c1_out), _view(third.regions[0], "ring-1", c2_in)
        h_c2_in, h_c1_out = third.describe_bytes(v_c2_in), second.describe_bytes(v_c1_out)
        f2 = third.start_bytes("fetch", v_c2_in, h_c1_out)
        p1 = second.start_bytes("publish", v_c1_out, h_c2_in)
        # child 2 -> local
        v_c2_out, v_l_in = _view(third.regions[0], "ring-2", c2_out), _view(region, "ring-2", lslots_in)
        h_l_in = local.describe(v_l_in)
        f0 = local.fetch(v_l_in, decode_hint(third.describe_bytes(v_c2_out)))
        p2 = third.start_bytes("publish", v_c2_out, encode_hint(h_l_in))
        assert p0.wait(30) and f0.wait(30)
        for outcome in (p0.poll(), f0.poll(), *(peer.result(h, 30.0)[0] for peer, h in
                                                ((second, f1), (third, f2), (second, p1), (third, p2)))):
            assert isinstance(outcome, Delivered) and outcome.all_delivered, outcome
        assert second.read("P", c1_in) == payloads[0]
        assert third.read("P", c2_in) == payloads[1]
        assert memory.read("L", lslots_in) == payloads[2]
    finally:
        assert local.shutdown() == frozenset()
        assert second.shutdown() == 0
        assert third.shutdown() == 0


def test_a_sigkilled_peers_key_goes_within_its_ttl(etcd_server: EtcdServer, client: EtcdClient) -> None:
    ttl = 2
    peer = SubprocessPeer(FACTORY, {"mode": "push", "buffers": PEER, "etcd": _settings(etcd_server, ttl_s=ttl)})
    try:
        key = metadata_key(NAMESPACE, peer.agent)
        assert client.get(key) is not None
        time.sleep(2 * ttl)
        assert client.get(key) is not None, "the key went while its process was alive: no keepalive"
        peer.kill()
        killed = time.monotonic()
        assert settle(lambda: client.get(key) is None, timeout=ttl + 10, step=0.1), "the key outlived its TTL"
        gone_after = time.monotonic() - killed
    finally:
        peer.kill()
    print(f"SIGKILLed peer's key gone after {gone_after:.2f} s (TTL {ttl} s)")
    assert gone_after <= ttl + SLACK


def test_a_peer_whose_etcd_does_not_answer_never_starts_and_names_it() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        nobody = f"http://127.0.0.1:{sock.getsockname()[1]}"
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="failed to start") as caught:
        SubprocessPeer(FACTORY, {"mode": "push", "buffers": PEER}, env={"NIXL_ETCD_ENDPOINTS": nobody})
    assert "EtcdUnavailable" in str(caught.value) and nobody in str(caught.value), caught.value
    print(f"refused to start in {time.monotonic() - started:.2f} s (process start included)")


def test_with_etcd_paused_a_peer_still_shuts_down_and_exits_promptly() -> None:
    with EtcdServer() as server:
        options = {"endpoints": server.endpoint, "namespace": "paused", "ttl_s": TTL, "timeout_s": TIMEOUT}
        peer = SubprocessPeer(FACTORY, {"mode": "push", "buffers": PEER, "etcd": options})
        memory = host_rows(LOCAL)
        local = NixlBackend(mode=TransferMode.PUSH, deadline_s=15.0, etcd=EtcdSettings(**options))
        local.register(memory.regions)
        paused = False
        try:
            n = 8
            lslots, pslots = _slots(30, 96, n), _slots(31, 80, n)
            lview, pview = _view(memory.regions[0], "before-pause", lslots), _view(peer.regions[0], "before-pause", pslots)
            peer_hint = peer.describe_bytes(pview)
            handle = peer.start_bytes("fetch", pview, encode_hint(local.describe(lview)))
            attempt = local.publish(lview, decode_hint(peer_hint))
            assert attempt.wait(30) and isinstance(attempt.poll(), Delivered)
            assert isinstance(peer.result(handle, 30.0)[0], Delivered)
            server.pause()
            paused = True
            started = time.monotonic()
            peer.close(timeout=30.0)  # shutdown() in the child, then the process exits
            exited = time.monotonic() - started
            started = time.monotonic()
            assert local.shutdown() == frozenset()
            local_took = time.monotonic() - started
        finally:
            if paused:
                server.resume()
            local.shutdown()
            peer.kill()
    print(f"with etcd paused: peer process exited in {exited:.2f} s, local shutdown {local_took:.2f} s "
          f"(client timeout {TIMEOUT} s)")
    assert peer.process.returncode == 0, "the peer had to be killed"
    assert exited < TIMEOUT + SLACK + 2  # + the interpreter's and NIXL's own exit
    assert local_took < TIMEOUT + SLACK


_CLEAN_RUN = """
import numpy as np
from kvxfer.backends.nixl import NixlBackend
from kvxfer.contract import CacheKind, Delivered, LayerGroupRows, TokenRange, TransferMode, View
from kvxfer.testing.nixl_pairs import host_rows
from kvxfer.testing.subprocess_peer import SubprocessPeer
from kvxfer.wire import decode_hint, encode_hint

memory = host_rows((("L", 512, 16),))
local = NixlBackend(mode=TransferMode.PUSH, deadline_s=15.0)
local.register(memory.regions)
peer = SubprocessPeer("kvxfer.testing.nixl_pairs:child_backend", {"mode": "push", "buffers": [["P", 512, 16]]},
                      env={"NIXL_LOG_LEVEL": "INFO"})
slots = np.arange(8, dtype=np.int64)
def view(region):
    return View("clean", TokenRange(0, 128), (LayerGroupRows("g", CacheKind.PAGED, region, slots, slots),), b"x")
lview, pview = view(memory.regions[0]), view(peer.regions[0])
peer_hint = peer.describe_bytes(pview)
handle = peer.start_bytes("fetch", pview, encode_hint(local.describe(lview)))
attempt = local.publish(lview, decode_hint(peer_hint))
assert attempt.wait(30) and isinstance(attempt.poll(), Delivered)
assert isinstance(peer.result(handle, 30.0)[0], Delivered)
assert local.shutdown() == frozenset()
peer.close()
assert peer.process.returncode == 0
print("CLEAN RUN DONE", flush=True)
"""


def test_a_clean_two_process_shutdown_logs_nothing_of_nixls_etcd_backend(etcd_env: dict[str, str]) -> None:
    env = {**os.environ, **etcd_env, "NIXL_LOG_LEVEL": "INFO"}
    run = subprocess.run([sys.executable, "-c", _CLEAN_RUN], env=env, stdin=subprocess.DEVNULL,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=240, check=False)
    output = run.stdout.decode("utf-8", "replace")
    assert run.returncode == 0 and "CLEAN RUN DONE" in output, output[-3000:]
    assert "Initialized NIXL agent" in output, "NIXL's INFO lines were not captured: the test proves nothing"
    assert "Failed to invalidate remote metadata" not in output
    assert "nixl_etcd_metadata_backend" not in output, "NIXL's own etcd backend ran"
