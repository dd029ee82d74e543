"""IpcBackend's control path under faults that do not mean a dead peer (over
``kvxfer.testing.host_cuda``, no GPU): a descriptor shortage, a full listen backlog, a
progress thread held up past shutdown's join, and many aborted transfers."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator

import pytest

import kvxfer.backends.common.engine as engine
import kvxfer.backends.ipc.backend as ipc
from kvxfer.backends.ipc import IpcBackend
from kvxfer.backends.ipc.channel import Channel, PeerBusy
from kvxfer.contract import Cancelled, InvalidSubmission, TransferMode
from kvxfer.testing import host_cuda
from kvxfer.testing.ipc_pairs import DeviceRows
from kvxfer.testing.ipc_scenarios import views
from kvxfer.testing.waiting import settle

PUSH = TransferMode.PUSH




@pytest.fixture
def pair() -> Iterator[tuple[IpcBackend, IpcBackend, DeviceRows, DeviceRows]]:
    mem_a = DeviceRows((("A0", 256, 64),), cuda=host_cuda)
    mem_d = DeviceRows((("D0", 256, 64),), cuda=host_cuda)
    a = IpcBackend("pre", PUSH, cuda=host_cuda)
    d = IpcBackend("dec", PUSH, cuda=host_cuda)
    a.register(mem_a.regions)
    d.register(mem_d.regions)
    yield a, d, mem_a, mem_d
    try:
        assert d.shutdown() == frozenset() and a.shutdown() == frozenset(), "an attempt was left unquiesced"
        assert not d._progress.is_alive() and not a._progress.is_alive()
    finally:
        mem_a.close()
        mem_d.close()


def test_connect_tells_nobody_there_from_not_now() -> None:
    # A socket nobody listens on: the peer is gone (None). A live peer whose listen backlog is
    # full: PeerBusy, so that nothing takes it for gone.
    channel = Channel("c")
    folder = tempfile.mkdtemp(prefix="kvxfer-test-")
    path = os.path.join(folder, "busy.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    fillers: list[socket.socket] = []
    try:
        assert channel.connect(os.path.join(folder, "nobody.sock").encode()) is None
        listener.bind(path)
        listener.listen(1)  # never accepts
        while True:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.setblocking(False)
            fillers.append(s)
            try:
                s.connect(path)
            except BlockingIOError:
                break
            assert len(fillers) < 64, "the backlog never filled"
        with pytest.raises(PeerBusy, match="now"):
            channel.connect(path.encode())
    finally:
        for s in fillers:
            s.close()
        listener.close()
        channel.close()
        os.unlink(path)
        os.rmdir(folder)


_SHORTAGE = r"""
import errno, json, os
from kvxfer.backends.ipc import IpcBackend
from kvxfer.backends.ipc.channel import PeerBusy
from kvxfer.testing.ipc_pairs import ChildPeer, DeviceRows, PeerSpec
from kvxfer.contract import TransferMode
from kvxfer.testing import host_cuda
from kvxfer.testing.ipc_scenarios import views
from kvxfer.testing.waiting import settle
peer = ChildPeer(PeerSpec(TransferMode.PUSH, emulated=True))  # the publisher, in another process
mem = DeviceRows((("D0", 256, 64),), cuda=host_cuda)
d = IpcBackend("dec", TransferMode.PUSH, cuda=host_cuda)
d.register(mem.regions)
dv, pv, ds, _ = views(mem.regions[0], peer.regions[0], 8, 1, "r1")
hint_p = peer.describe(pv); hint_d = d.describe(dv)
refused = []  # errno of each connection the progress thread could not open
connect = d._channel.connect
def recording(endpoint):
    try:
        return connect(endpoint)
    except PeerBusy as exc:
        refused.append(exc.errno)
        raise
d._channel.connect = recording
held = []
try:
    while True:
        held.append(os.open("/dev/null", os.O_RDONLY))
except OSError:
    pass
waiting = d.fetch(dv, hint_p)  # its progress thread connects to the peer now, with no descriptor left
settle(lambda: refused, 30.0)  # until it tried: the test checks it was told EMFILE
for fd in held:
    os.close(fd)
alive = d._progress.is_alive()
early = repr(waiting.poll())
handle = peer.start("publish", pv, hint_d)
ok = waiting.wait(15.0)
mine, _ = peer.result(handle, 15.0)
print(json.dumps({"refused": errno.errorcode.get(refused[0], refused[0]) if refused else None,
                  "alive": alive, "early": early, "ok": ok, "theirs": repr(waiting.poll()),
                  "mine": type(mine).__name__, "left": len(d.shutdown())}))
peer.close(); mem.close()
"""


def test_a_moment_without_descriptors_neither_kills_the_thread_nor_fails_the_wait() -> None:
    # In a child process (it uses up every descriptor, until the fetch's connection to its
    # peer has failed with EMFILE: the child records the refusal). Before, the progress thread
    # died of it and every attempt hung; now the wait stays open, connects once descriptors
    # are back, and the push lands.
    out = subprocess.run([sys.executable, "-c", _SHORTAGE], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["theirs"].startswith("Delivered"), (result, out.stderr[-2000:])
    result["theirs"] = "Delivered"
    assert result == {"refused": "EMFILE", "alive": True, "early": "None", "ok": True, "theirs": "Delivered",
                      "mine": "Delivered", "left": 0}, (result, out.stderr[-2000:])


def test_withdrawn_transfers_and_early_records_are_bounded(
        pair: tuple[IpcBackend, IpcBackend, DeviceRows, DeviceRows], monkeypatch: pytest.MonkeyPatch) -> None:
    # Every request aborted before its prefill published leaves the publisher a withdrawn
    # transfer: the table keeps the newest KEPT, and the newest is still refused.
    a, d, mem_a, mem_d = pair
    monkeypatch.setattr(engine, "KEPT", 4)
    hints = []
    for i in range(7):
        lv, dv, _, _ = views(mem_a.regions[0], mem_d.regions[0], 4, i, f"abort{i}")
        hint_d = d.describe(dv)
        waiting = d.fetch(dv, a.describe(lv))
        waiting.cancel()
        assert waiting.wait(5.0) and isinstance(waiting.poll(), Cancelled)
        hints.append((lv, hint_d))
    assert settle(lambda: len(a._revoked) == 4), len(a._revoked)
    with pytest.raises(InvalidSubmission, match="withdrew"):
        a.publish(*hints[-1])


def test_a_shutdown_whose_join_timed_out_is_finished_by_the_next(monkeypatch: pytest.MonkeyPatch) -> None:
    # The owner holds a lock that the wait's wake callback needs while it shuts down, so the
    # progress thread outlives shutdown()'s join. A later shutdown(), once the thread is
    # gone, gives back what the backend holds (its socket is removed) and still names the
    # wait it could not prove quiesced.
    monkeypatch.setattr(ipc, "SHUTDOWN_JOIN_S", 0.3)
    mem_a = DeviceRows((("A0", 256, 64),), cuda=host_cuda)
    mem_d = DeviceRows((("D0", 256, 64),), cuda=host_cuda)
    a = IpcBackend("pre", PUSH, cuda=host_cuda)
    d = IpcBackend("dec", PUSH, cuda=host_cuda)
    engine = threading.Lock()

    def wake() -> None:
        with engine:
            pass

    try:
        a.register(mem_a.regions)
        d.register(mem_d.regions)
        lv, dv, _, _ = views(mem_a.regions[0], mem_d.regions[0], 4, 1, "slow")
        d.describe(dv)
        waiting = d.fetch(dv, a.describe(lv), wake=wake)
        # Its progress thread has connected to the peer.
        assert settle(lambda: all(w.watching for w in list(d._waits.by_id.values()))), "the wait never connected"
        engine.acquire()
        try:
            assert d.shutdown() == {waiting} and d._progress.is_alive()  # the join timed out: the thread is in wake()
            assert os.path.exists(d._channel.path)
        finally:
            engine.release()  # only once the first shutdown returned, however long it took
        assert settle(lambda: not d._progress.is_alive())
        assert d.shutdown() == {waiting} and not waiting.quiesced()
        assert not os.path.exists(d._channel.path), "the second shutdown did not give the channel back"
        assert d.shutdown() == {waiting}  # and again: nothing released twice
    finally:
        assert a.shutdown() == frozenset()
        mem_a.close()
        mem_d.close()


def test_a_peer_slow_to_read_delays_frames_and_is_not_taken_for_gone(monkeypatch: pytest.MonkeyPatch) -> None:
    # The peer accepts but does not read: the first frame that fills the socket waits the send
    # timeout, then its rest is kept for flush(); later frames queue behind it at once. The
    # peer is not dropped, and once it reads, every frame arrives whole and in order.
    import kvxfer.backends.ipc.channel as ipc_channel

    monkeypatch.setattr(ipc_channel, "SEND_TIMEOUT_S", 1.0)  # the first send waits it out
    channel = Channel("c")
    folder = tempfile.mkdtemp(prefix="kvxfer-test-")
    path = os.path.join(folder, "slow.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(1)
    try:
        frames = [bytes([i]) * (4 << 20) for i in range(3)]  # more than the socket buffers hold
        started = time.monotonic()
        assert channel.send(path.encode(), frames[0])
        assert time.monotonic() - started >= 1.0  # waited the timeout once
        # Later sends queue at once: with a long timeout now, waiting it again would show.
        monkeypatch.setattr(ipc_channel, "SEND_TIMEOUT_S", 60.0)
        quick = time.monotonic()
        assert channel.send(path.encode(), frames[1]) and channel.send(path.encode(), frames[2])
        assert time.monotonic() - quick < 30.0  # queued, without waiting the timeout again
        assert path.encode() in channel._outbound, "a slow peer was taken for gone"
        peer, _ = listener.accept()
        got = bytearray()
        expected = sum(4 + len(f) for f in frames)
        peer.settimeout(0.05)
        end = time.monotonic() + 10
        while len(got) < expected and time.monotonic() < end:
            assert channel.flush() == []
            try:
                got += peer.recv(1 << 20)
            except TimeoutError:
                pass
        assert bytes(got) == b"".join(len(f).to_bytes(4, "big") + f for f in frames)
        peer.close()
    finally:
        listener.close()
        channel.close()
        os.unlink(path)
        os.rmdir(folder)
