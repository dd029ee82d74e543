"""Row integrity scenarios for the IPC backend, whose copy kernel checks each row where it
landed (``kvxfer.backends.ipc.rowcheck``), with the peer in a child process: run over
``kvxfer.testing.host_cuda`` by ``tests/twoproc/test_integrity_ipc.py`` and over real CUDA by
``tests/gpu/test_ipc.py`` (``cuda``: None is kvxfer._native). Each raises AssertionError naming
what went wrong, and closes everything it started first."""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import numpy as np

from kvxfer.backends.common.corruption import Corruptor
from kvxfer.backends.ipc import IpcBackend
from kvxfer.contract import Delivered, Failed, Outcome, TransferMode
from kvxfer.testing.ipc_pairs import ChildPeer, DeviceRows, PeerSpec
from kvxfer.testing.ipc_scenarios import move_scattered


@dataclass(frozen=True)
class CheckedMove:
    ours: Outcome | None
    theirs: Outcome | None
    slots: np.ndarray  # where the rows landed, in row order
    source: np.ndarray  # (rows, row_bytes): the bytes sent
    landed: np.ndarray  # the bytes where they landed
    counted: int  # rows our backend counted refused


def checked_move(mode: TransferMode, *, cuda: ModuleType | None, rows: int, row_bytes: int = 4096,
                 local_integrity: bool = True, peer_integrity: bool = True,
                 corrupt: Corruptor | None = None) -> CheckedMove:
    """``rows`` scattered rows moved by this process's backend (the active end: push publishes,
    pull fetches), its kernel damaging the rows ``corrupt`` picks."""
    slots = max(256, 2 * rows)
    peer = ChildPeer(PeerSpec(mode, geometry=(("P", row_bytes, slots),), emulated=cuda is not None,
                              integrity=peer_integrity))
    memory = DeviceRows((("L", row_bytes, slots),), cuda=cuda)
    local = IpcBackend("local", mode, cuda=cuda, integrity=local_integrity,
                       corrupt_rows=None if corrupt is None else corrupt.pick)
    try:
        move = move_scattered(mode, local, memory, peer, rows=rows, row_bytes=row_bytes, seed=3)
        return CheckedMove(move.ours, move.theirs, move.slots,
                           np.frombuffer(move.source, np.uint8).reshape(rows, row_bytes),
                           np.frombuffer(move.landed, np.uint8).reshape(rows, row_bytes), local.integrity.rows_failed)
    finally:
        local.shutdown()
        peer.close()
        memory.close()


def damaged_rows_refused_exactly(mode: TransferMode, *, cuda: ModuleType | None, rows: int,
                                 row_bytes: int = 4096) -> None:
    """Rows the kernel damaged after their store are False at both ends, exactly those; the
    outcomes name the digest mismatch; every row claimed holds the source's bytes; the rows are
    counted where they landed (here for a fetch, at the child for a push)."""
    corrupt = Corruptor(seed=rows, p_bit=0.25)
    move = checked_move(mode, cuda=cuda, rows=rows, row_bytes=row_bytes, corrupt=corrupt)
    damaged = {slot for _, slot in corrupt.take()}
    assert 0 < len(damaged) < rows, damaged
    expected = np.array([int(s) not in damaged for s in move.slots])
    for outcome in (move.ours, move.theirs):
        assert isinstance(outcome, Failed) and "digest mismatch" in outcome.reason, outcome
        assert np.array_equal(outcome.masks[0], expected), (outcome.masks[0], expected)
    assert np.array_equal(move.landed[expected], move.source[expected])
    for i in np.flatnonzero(~expected).tolist():  # one bit flipped where it landed
        assert np.unpackbits(move.landed[i] ^ move.source[i]).sum() == 1, i
    assert move.counted == (len(damaged) if mode is TransferMode.PULL else 0)


def clean_rows_delivered(mode: TransferMode, *, cuda: ModuleType | None, rows: int, row_bytes: int = 4096) -> None:
    move = checked_move(mode, cuda=cuda, rows=rows, row_bytes=row_bytes)
    for outcome in (move.ours, move.theirs):
        assert isinstance(outcome, Delivered) and outcome.all_delivered, outcome
    assert np.array_equal(move.landed, move.source) and move.counted == 0


def checking_fetcher_checked_by_unchecking_publisher(*, cuda: ModuleType | None, rows: int) -> None:
    """Push: the publisher (ours, integrity off) runs the kernel; the fetcher's hint asks for the check."""
    corrupt = Corruptor(seed=9, p_bit=0.3)
    move = checked_move(TransferMode.PUSH, cuda=cuda, rows=rows, local_integrity=False, corrupt=corrupt)
    assert corrupt.take()
    for outcome in (move.ours, move.theirs):
        assert isinstance(outcome, Failed) and "digest mismatch" in outcome.reason, outcome
