"""A closed ucx Transport, and a shut-down UcxBackend, let go of their UCX worker: every socket,
pipe and shared-memory file UCX opened for it is closed once the objects are dropped, whatever
the peer does after. A worker left behind keeps them, and UCX's async handlers (a table keyed
by descriptor number, one per process), for the life of the process: a test worker under
xdist held over 1,100 such descriptors, and a later UCX worker could not start ("Element
already exists") once a descriptor of a leaked worker had been closed under it."""

from __future__ import annotations

import functools
import gc
import os
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from kvxfer.backends.ucx.transport import ucxx_unavailable
from kvxfer.contract import TransferMode

if (missing := ucxx_unavailable()) is not None:  # not importorskip: importing ucxx changes os.environ
    pytest.skip(missing, allow_module_level=True)

from kvxfer.backends.ucx.transport import Transport  # noqa: E402
from kvxfer.testing.conformance.delivery_checks import (  # noqa: E402
    check_cancel_before_peer_starts,
    check_round_trip_exact,
)
from kvxfer.testing.ucx_pairs import ucx_pair  # noqa: E402


def _open_files() -> set[str]:
    """What this process's descriptors refer to, by identity ("socket:[inode]", a path...).
    Epoll and other anonymous inodes all read alike, so they are left out."""
    files = set()
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue  # the listing's own descriptor, closed already
        if not target.startswith("anon_inode:"):
            files.add(target)
    return files


def _opened_by(make: Callable[[], Any]) -> tuple[Any, set[str]]:
    before = _open_files()
    made = make()
    opened = _open_files() - before
    assert any(f.startswith("socket:") for f in opened)  # UCX's own (tcp, the async thread's)
    return made, opened


def _exchange(a: Transport, b: Transport) -> None:
    """A message each way, so that each worker has an endpoint to the other."""
    for sender, receiver, to in ((a, b, "b"), (b, a, "a")):
        payload = np.arange(256, dtype=np.uint8)
        send = sender.send(to, receiver.address, payload, 7)
        deadline = time.monotonic() + 5.0
        while (probe := receiver.probe(7, (1 << 64) - 1)) is None:
            sender.progress()
            receiver.progress()
            assert time.monotonic() < deadline, "the message did not arrive"
        buffer = np.zeros(256, np.uint8)
        recv = receiver.receive(probe, buffer)
        while not (send.completed and recv.completed):
            sender.progress()
            receiver.progress()
            assert time.monotonic() < deadline, "the message did not complete"
        assert sender.state(send) == "DONE" and receiver.state(recv) == "DONE"
        assert np.array_equal(buffer, payload)


def test_closed_transports_close_their_files_though_the_peer_no_longer_progresses() -> None:
    (a, b), opened = _opened_by(lambda: (Transport(), Transport()))
    _exchange(a, b)
    a.close()  # b is not progressed while a closes: it never answers a close handshake
    b.close()
    del a, b
    gc.collect()
    assert not opened & _open_files()


@pytest.mark.parametrize(("check", "mode"), [(check_round_trip_exact, TransferMode.PUSH),
                                           (check_cancel_before_peer_starts, TransferMode.PULL)],
                         ids=["round-trip", "cancelled-pull"])
def test_a_shut_down_backend_pair_closes_its_files(check: Callable[..., None], mode: TransferMode) -> None:
    """Both ends in this process, shut down one after the other (as the kit's pairs are); in
    the cancelled pull, the fetcher's last control messages are still going at its shutdown."""
    before = _open_files()
    check(functools.partial(ucx_pair), mode)
    gc.collect()
    left = {f for f in _open_files() - before if f.startswith("socket:") or "ucx_shm" in f}
    assert not left
