"""Doorbells (kvxfer.backends.ipc.doorbells) between two processes over kvxfer.testing.host_cuda:
the store that tells a busy-polling waiter its rows are in place, and everything around it
that must not change what the waiter concludes."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from collections.abc import Iterator

import numpy as np
import pytest

from kvxfer.backends.ipc import IpcBackend
from kvxfer.backends.ipc.doorbells import BELL_BYTES, BELL_WORDS, EXTRA_BELL, parse_bell
from kvxfer.contract import Delivered, Failed, Hint, InvalidSubmission, TransferMode
from kvxfer.testing import host_cuda
from kvxfer.testing.ipc_pairs import ChildPeer, DeviceRows, PeerSpec
from kvxfer.testing.ipc_scenarios import close_all, doorbells_conclude_waits, views

DELAY = host_cuda.DELAY_ENV  # deferred mode: copies land this long after queueing



@pytest.mark.parametrize("delay", ["0", "0.003"], ids=["at-once", "in-flight"])
@pytest.mark.parametrize("mode", list(TransferMode), ids=lambda m: m.value)
def test_doorbell_ends_the_busy_polling_wait(mode: TransferMode, delay: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(DELAY, delay)
    doorbells_conclude_waits(mode, cuda=host_cuda)


def test_without_doorbells_the_hint_names_none_and_records_end_the_wait() -> None:
    doorbells_conclude_waits(TransferMode.PUSH, cuda=host_cuda, doorbell=False)


@contextlib.contextmanager
def _pair(*, local_busy_poll: bool = False, child_busy_poll: bool = True) -> Iterator[tuple[IpcBackend, ChildPeer,
                                                                                            DeviceRows]]:
    """An IpcBackend here over 64 rows of 256 B, its peer in a child; everything closed after,
    and no attempt left unquiesced."""
    peer = ChildPeer(PeerSpec(TransferMode.PUSH, emulated=True, busy_poll=child_busy_poll))
    memory = DeviceRows((("L0", 256, 64),), cuda=host_cuda)
    local = IpcBackend("local", TransferMode.PUSH, busy_poll=local_busy_poll, cuda=host_cuda)
    try:
        local.register(memory.regions)
        yield local, peer, memory
    finally:
        close_all(local, [peer], memory)


def _with_bell(hint: Hint, data: bytes) -> Hint:
    extras = tuple((k, v) for k, v in hint.extras if k != EXTRA_BELL) + ((EXTRA_BELL, data),)
    return dataclasses.replace(hint, extras=extras)


def _push(local: IpcBackend, peer: ChildPeer, memory: DeviceRows, seed: int, fill: bytes,
          bell: bytes | None = None) -> tuple:
    """One push of 8 rows into the child's fetch (its hint's doorbell replaced by ``bell``):
    (our outcome, the child's, the child's quiescence, the bytes in the child's rows)."""
    lv, pv, ls, ps = views(memory.regions[0], peer.regions[0], 8, seed, f"r{seed}")
    memory.write("L0", ls, fill * 256 * 8)
    hint = peer.describe(pv)
    handle = peer.start("fetch", pv, local.describe(lv))
    attempt = local.publish(lv, hint if bell is None else _with_bell(hint, bell))
    assert attempt.wait(10)
    theirs, quiet = peer.result(handle, 10)
    return attempt.poll(), theirs, quiet, peer.read("P0", ps)


def test_a_malformed_doorbell_is_refused_by_name_and_nothing_moves() -> None:
    with _pair() as (local, peer, memory):
        lv, pv, ls, ps = views(memory.regions[0], peer.regions[0], 8, 1)
        memory.write("L0", ls, b"\x07" * 256 * 8)
        hint = peer.describe(pv)
        local.describe(lv)
        ring_path = (hint.extra(EXTRA_BELL) or b"")[4:]
        assert local._copies.peer_bell(hint) is not None  # the ring's path is now known: only the slot is read
        for bad, named in ((b"\x01", "too short"), ((5000).to_bytes(4, "little") + b"/dev/shm/x", "word 5000"),
                           ((BELL_WORDS).to_bytes(4, "little") + ring_path, f"word {BELL_WORDS}"),
                           ((1).to_bytes(4, "little") + b"/home/user/.bashrc", "not a kvxfer doorbell ring")):
            with pytest.raises(InvalidSubmission, match=named):
                local.publish(lv, _with_bell(hint, bad))
        assert peer.read("P0", ps) == bytes(256 * 8), "a refused publish wrote the peer's rows"


def test_an_unusable_ring_costs_only_the_doorbell() -> None:
    # A well-formed name of a ring that does not exist (its maker died, say): the rows move
    # and the record ends the peer's wait as without doorbells.
    missing = (9).to_bytes(4, "little") + b"/dev/shm/kvxfer-bell-1-000000000000"
    with _pair() as (local, peer, memory):
        for i in range(2):
            mine, theirs, quiet, landed = _push(local, peer, memory, i, bytes([i + 3]), bell=missing)
            assert isinstance(mine, Delivered) and isinstance(theirs, Delivered) and theirs.all_delivered and quiet
            assert landed == bytes([i + 3]) * 256 * 8
        assert peer.bells_rung() == 0


def test_a_foreign_value_in_the_word_is_cleared_and_does_not_end_the_wait() -> None:
    # This process waits (it fetches, busy-polling); the child publishes. A value that is not
    # the transfer's token, stored in its word before the copy, must neither conclude the
    # wait nor stop the real doorbell from doing so afterwards.
    with _pair(local_busy_poll=True, child_busy_poll=False) as (local, peer, memory):
        lv, pv, ls, ps = views(memory.regions[0], peer.regions[0], 8, 2)
        peer.write("P0", ps, b"\x05" * 256 * 8)
        own_hint = local.describe(lv)
        path, slot = parse_bell(own_hint.extra(EXTRA_BELL) or b"")
        ring = np.memmap(path, dtype=np.uint64, mode="r+", shape=(BELL_BYTES // 8,))
        attempt = local.fetch(lv, peer.describe(pv))
        ring[slot] = 12345
        deadline = time.monotonic() + 5
        while ring[slot] != 0 and time.monotonic() < deadline:
            time.sleep(0.001)
        assert ring[slot] == 0, "the progress thread did not clear a foreign value"
        assert attempt.poll() is None, f"a foreign value concluded the wait: {attempt.poll()!r}"
        handle = peer.start("publish", pv, own_hint)
        assert attempt.wait(10) and isinstance(attempt.poll(), Delivered) and attempt.poll().all_delivered
        theirs, quiet = peer.result(handle, 10)
        assert isinstance(theirs, Delivered) and quiet
        assert memory.read("L0", ls) == b"\x05" * 256 * 8
        assert local.bells_rung == 1
        del ring


def test_shutdown_removes_the_ring() -> None:
    memory = DeviceRows((("L0", 256, 64),), cuda=host_cuda)
    local = IpcBackend("local", TransferMode.PUSH, busy_poll=True, cuda=host_cuda)
    try:
        local.register(memory.regions)
        lv, _, _, _ = views(memory.regions[0], memory.regions[0], 4, 0)
        path, _slot = parse_bell(local.describe(lv).extra(EXTRA_BELL) or b"")
        assert path.startswith("/dev/shm/kvxfer-bell-") and os.path.exists(path)
    finally:
        assert local.shutdown() == frozenset()
        memory.close()
    assert not os.path.exists(path)


def test_an_event_that_cannot_be_recorded_fails_the_push_by_name_after_the_copy(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # The event goes in the same native call as the last kernel and the doorbell store. If it
    # cannot be recorded, the stream is drained and the copied rows are reported as such.
    def refuse(*args: object) -> None:
        raise host_cuda.CopyError("cudaEventRecord: cudaErrorInvalidResourceHandle")

    monkeypatch.setattr(host_cuda, "event_record", refuse)  # this process only: the publisher
    with _pair() as (local, peer, memory):
        mine, theirs, quiet, landed = _push(local, peer, memory, 4, b"\x09")
        assert isinstance(mine, Failed) and "cannot record a completion event" in mine.reason, mine
        assert all(m.all() for m in mine.masks), "the stream was drained: every queued row is in place"
        assert theirs is not None and all(m.all() for m in theirs.masks) and quiet
        assert landed == b"\x09" * 256 * 8


def test_a_last_kernel_that_cannot_be_queued_rings_no_doorbell(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **check: object) -> tuple[str, str]:
        raise host_cuda.CopyError("launching the row copy kernel: cudaErrorLaunchOutOfResources")

    monkeypatch.setattr(host_cuda, "cuda_copy_rows_then", refuse)
    with _pair() as (local, peer, memory):
        mine, theirs, quiet, landed = _push(local, peer, memory, 5, b"\x0a")
        assert isinstance(mine, Failed) and "row copy launch failed" in mine.reason, mine
        assert isinstance(theirs, Failed) and not any(m.any() for m in theirs.masks) and quiet, theirs
        assert landed == bytes(256 * 8) and peer.bells_rung() == 0


def test_without_a_place_for_the_ring_the_waiter_uses_sockets_only(monkeypatch: pytest.MonkeyPatch,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    import functools

    import kvxfer.backends.ipc.waits as ipc_waits
    from kvxfer.backends.ipc.doorbells import BellRing

    monkeypatch.setattr(ipc_waits, "BellRing", functools.partial(BellRing, "/nonexistent/kvxfer-shm"))
    with _pair(local_busy_poll=True, child_busy_poll=False) as (local, peer, memory):
        lv, pv, ls, ps = views(memory.regions[0], peer.regions[0], 8, 3)
        peer.write("P0", ps, b"\x06" * 256 * 8)
        with caplog.at_level("WARNING", logger="kvxfer.backends.ipc"):
            own_hint = local.describe(lv)
        assert own_hint.extra(EXTRA_BELL) is None and not local.doorbell
        assert any("no doorbell ring" in r.getMessage() for r in caplog.records)
        attempt = local.fetch(lv, peer.describe(pv))
        handle = peer.start("publish", pv, own_hint)
        assert attempt.wait(10) and isinstance(attempt.poll(), Delivered) and attempt.poll().all_delivered
        theirs, quiet = peer.result(handle, 10)
        assert isinstance(theirs, Delivered) and quiet and local.bells_rung == 0
        assert memory.read("L0", ls) == b"\x06" * 256 * 8
