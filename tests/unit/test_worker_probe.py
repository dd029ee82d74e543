"""The worker's end of `kvxfer doctor --peer` (kvxfer.worker.probe) in this process, with a
real NIXL agent: bodies read by name, one probe at a time, renewal, expiry, freeing (its
agent's threads end), freeing when the event loop ends, and the doctor's own checks."""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
import resource
import socket
import threading
import time

import pytest

from kvxfer.doctor import report as doctor
from kvxfer.worker.probe import (
    MAX_BYTES,
    MIN_BYTES,
    ProbeBusy,
    ProbeHost,
    ProbeInvalid,
    ProbeUnknown,
    parse_open,
)


def _threads() -> int:
    """The process's OS threads (NIXL's and UCX's native ones included), less the event loop's
    executor threads: asyncio.to_thread starts another whenever the last one has not yet
    marked itself idle, which a busy machine makes likely, and none of them is the probe's."""
    executor = sum(1 for t in threading.enumerate() if t.name.startswith("asyncio_"))
    return len(os.listdir(f"/proc/{os.getpid()}/task")) - executor


def _threads_back_to(count: int, timeout: float = 10.0) -> bool:
    """The process's threads (NIXL's and UCX's included) are back to ``count`` or fewer: those
    of a freed agent, and of earlier tests' agents, may take a moment to end."""
    deadline = time.monotonic() + timeout
    while _threads() > count and time.monotonic() < deadline:
        time.sleep(0.05)
    return _threads() <= count


@pytest.mark.parametrize(("body", "needle"), [
    ({}, "'bytes' must be a whole number of bytes, got None"),
    ({"bytes": 1e6}, "'bytes' must be a whole number"),
    ({"bytes": True}, "'bytes' must be a whole number"),
    ({"bytes": "1048576"}, "'bytes' must be a whole number"),
    ({"bytes": MIN_BYTES - 1}, f"must be {MIN_BYTES} to {MAX_BYTES}"),
    ({"bytes": MAX_BYTES + 1}, "a probe borrows the worker's memory"),
    ({"bytes": 1 << 20, "memory": "gpu"}, "'memory' must be 'host' or 'device', got 'gpu'"),
    ({"bytes": 1 << 20, "size": 3}, "unknown field 'size'"),
])
def test_open_bodies_are_refused_by_name(body: dict[str, object], needle: str) -> None:
    with pytest.raises(ProbeInvalid) as caught:
        parse_open(body)
    assert needle in str(caught.value)


def test_open_bodies_read() -> None:
    assert parse_open({"bytes": 1 << 20}) == (1 << 20, "host")
    assert parse_open({"bytes": MAX_BYTES, "memory": "device"}) == (MAX_BYTES, "device")


def test_one_probe_at_a_time_renewed_and_freed_with_its_threads() -> None:
    async def go() -> None:
        host = ProbeHost("w", "cpu", idle_s=30)
        await asyncio.to_thread(lambda: None)  # the loop's executor thread exists before we count
        before = _threads()
        answer = await host.open(1 << 20, "host")
        assert answer["bytes"] == 1 << 20 and answer["memory"] == "host" and answer["device"] == 0
        assert bytes.fromhex(answer["metadata"]) and answer["address"] > 0
        assert answer["host"] == socket.gethostname() and answer["versions"]["ucx"][0].isdigit()
        assert _threads() > before  # the probe agent's progress thread
        assert host.status()["active"]["id"] == answer["id"]
        with pytest.raises(ProbeBusy, match=f"doctor probe {answer['id']} is active .* one probe at a time"):
            await host.open(1 << 20, "host")
        assert host.renew(answer["id"])["expires_in_s"] == 30
        with pytest.raises(ProbeUnknown, match="no doctor probe 'nope'"):
            host.renew("nope")
        with pytest.raises(ProbeUnknown):
            await host.free("nope")
        assert (await host.free(answer["id"]))["freed"] is True
        assert host.status()["active"] is None
        assert _threads_back_to(before)
        with pytest.raises(ProbeUnknown):
            await host.free(answer["id"])
        again = await host.open(MIN_BYTES, "host")  # the slot is free again
        await host.free(again["id"])
    asyncio.run(go())


def test_device_memory_needs_a_pool_on_a_gpu_and_the_limit_holds() -> None:
    async def go() -> None:
        host = ProbeHost("w", "cpu", max_bytes=1 << 20)
        with pytest.raises(ProbeInvalid, match="this worker's pool is on cpu: it has no device memory"):
            await host.open(1 << 20, "device")
        with pytest.raises(ProbeInvalid, match="over this worker's probe limit of 1048576"):
            await host.open(2 << 20, "host")
        assert host.status()["active"] is None
    asyncio.run(go())


def test_a_probe_nobody_renews_expires() -> None:
    async def go() -> None:
        host = ProbeHost("w", "cpu", idle_s=2.0)  # generous: a loaded host may start UCX slowly
        first = await host.open(MIN_BYTES, "host")
        await asyncio.sleep(0.8)
        host.renew(first["id"])  # renewed: it lives on past its first 2 s
        await asyncio.sleep(1.2)
        assert host.status()["active"] is not None
        deadline = time.monotonic() + 5
        while host.status()["active"] is not None and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert host.status()["active"] is None
        with pytest.raises(ProbeUnknown, match="expired after 2s without a word"):
            host.renew(first["id"])
    asyncio.run(go())


def test_a_probe_open_when_the_loop_ends_is_freed_and_close_refuses_more() -> None:
    before = _threads()
    host = ProbeHost("w", "cpu")

    async def leave_open() -> None:
        await host.open(MIN_BYTES, "host")
    asyncio.run(leave_open())  # as `kvxfer serve`'s asyncio.run ends at shutdown
    assert host.status()["active"] is None
    assert _threads_back_to(before)

    async def after_close() -> None:
        host.close()
        with pytest.raises(ProbeBusy, match="shutting down"):
            await host.open(MIN_BYTES, "host")
    asyncio.run(after_close())


def test_peer_flags_are_usage_errors(capsys: pytest.CaptureFixture[str]) -> None:
    for argv, needle in ((["--peer", "10.0.0.2:8101"], "--peer: '10.0.0.2:8101' is not a server's URL"),
                         (["--peer", "http://10.0.0.2"], "give http://HOST:PORT"),
                         (["--peer", "http://127.0.0.1:9", "--devices", "0,1"], "--devices places both ends")):
        with pytest.raises(SystemExit) as exit_:
            doctor.main(argv)
        assert exit_.value.code == 2
        assert needle in capsys.readouterr().err


def test_the_doctor_renews_while_it_waits(monkeypatch: pytest.MonkeyPatch) -> None:
    """Between the initiator's messages the doctor's tick runs (it renews the worker's probe)."""
    monkeypatch.setattr(doctor, "TICK_S", 0.05)
    ours, theirs = socket.socketpair()
    ticks: list[float] = []
    try:
        def later() -> None:
            time.sleep(0.4)
            body = json.dumps({"results": 1}).encode()
            theirs.sendall(len(body).to_bytes(8, "little") + body)
        sender = threading.Thread(target=later)
        sender.start()
        assert doctor._next(ours, 5.0, lambda: ticks.append(time.monotonic())) == {"results": 1}
        sender.join()
        assert len(ticks) >= 3
        with pytest.raises(TimeoutError, match="no word from the initiator process within 0.2s"):
            doctor._next(ours, 0.2, lambda: None)
    finally:
        ours.close()
        theirs.close()


def test_the_doctor_waits_on_a_descriptor_past_select_s_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    """A process with more than 1024 files open (the full test run was one) still hears its
    initiator: select() refuses such a descriptor, poll() does not."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1200:
        pytest.skip(f"this process may open only {hard} files")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1200), hard))
    monkeypatch.setattr(doctor, "TICK_S", 0.05)
    ours, theirs = socket.socketpair()
    # The lowest free descriptor from 1100 up. Not dup2() onto 1100: that closes whatever this
    # process holds there, and once that was a live UCX worker's socket, whose async handler
    # (keyed by the number) then kept the next UCX worker in the process from starting.
    high = socket.socket(fileno=fcntl.fcntl(ours.fileno(), fcntl.F_DUPFD, 1100))
    try:
        body = json.dumps({"results": 2}).encode()
        theirs.sendall(len(body).to_bytes(8, "little") + body)
        assert high.fileno() >= 1100
        assert doctor._next(high, 5.0, lambda: None) == {"results": 2}
    finally:
        for sock in (high, ours, theirs):
            sock.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
