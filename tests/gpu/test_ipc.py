"""IpcBackend on one GPU, two processes: the conformance kit, byte-exact rows, dead peers.

Run on the GPU machine: ``python -m pytest -q -m gpu tests/gpu/test_ipc.py``.
"""

from __future__ import annotations

import functools
import threading
import time

import pytest

from kvxfer import native
from kvxfer.contract import TransferMode
from kvxfer.testing.conformance import CHECKS

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not native.info().cuda_usable, reason=f"kvxfer._native CUDA: {native.info().reason}"),
]

from kvxfer.testing.ipc_pairs import ipc_pair  # noqa: E402
from kvxfer.testing.ipc_scenarios import (  # noqa: E402
    dead_peers_fail_by_name,
    doorbells_conclude_waits,
    large_rows_byte_exact,
)


@pytest.mark.parametrize("mode", list(TransferMode), ids=lambda m: m.value)
@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
def test_ipc_conformance(check, mode):  # type: ignore[no-untyped-def]
    check(ipc_pair, mode)


@pytest.mark.parametrize("mode", list(TransferMode), ids=lambda m: m.value)
def test_large_scattered_push_and_pull_byte_exact(mode: TransferMode) -> None:
    large_rows_byte_exact(mode, cuda=None, row_bytes=64 * 1024, slots=600, rows=512)  # 32 MiB of 64 KiB rows


def test_dead_peer_mapping_dropped_and_waits_fail() -> None:
    dead_peers_fail_by_name(cuda=None)


@pytest.mark.parametrize("mode", list(TransferMode), ids=lambda m: m.value)
def test_doorbell_stored_by_the_gpu_ends_the_busy_polling_wait(mode: TransferMode) -> None:
    # The real thing: the peer's /dev/shm ring page-locked here, the word stored by a kernel
    # queued after the row copy, seen by the child's spin before the record arrives.
    doorbells_conclude_waits(mode, cuda=None)


@pytest.mark.parametrize("mode", list(TransferMode), ids=lambda m: m.value)
def test_busy_poll_pair_with_doorbells_keeps_the_contract(mode: TransferMode) -> None:
    for check in CHECKS:
        check(functools.partial(ipc_pair, busy_poll=True), mode)


def test_shutdown_leaves_nothing_running() -> None:
    before = {t.ident for t in threading.enumerate()}
    pair = ipc_pair(TransferMode.PUSH)
    pair.close()
    time.sleep(0.05)
    left = [t for t in threading.enumerate() if t.ident not in before and t.is_alive()]
    assert not left, left
    assert pair.peer._proc.exitcode is not None  # type: ignore[attr-defined]


# --- the copy kernel's row check (kvxfer.backends.ipc.rowcheck) on the real kernel --------------
from kvxfer.testing.ipc_integrity import (  # noqa: E402
    checking_fetcher_checked_by_unchecking_publisher,
    clean_rows_delivered,
    damaged_rows_refused_exactly,
)


@pytest.mark.parametrize("rows,row_bytes", [(24, 4096), (96, 4096), (400, 65536), (9000, 4096), (64, 4100)],
                         ids=["inline", "staged", "64k", "pipelined", "tail"])
@pytest.mark.parametrize("mode", list(TransferMode), ids=lambda m: m.value)
def test_rows_damaged_where_they_landed_are_refused_exactly(mode: TransferMode, rows: int, row_bytes: int) -> None:
    damaged_rows_refused_exactly(mode, cuda=None, rows=rows, row_bytes=row_bytes)


@pytest.mark.parametrize("rows,row_bytes", [(24, 4096), (9000, 4096), (64, 4100), (32, 100)],
                         ids=["inline", "pipelined", "tail", "small-rows"])
@pytest.mark.parametrize("mode", list(TransferMode), ids=lambda m: m.value)
def test_clean_rows_are_delivered_checked(mode: TransferMode, rows: int, row_bytes: int) -> None:
    clean_rows_delivered(mode, cuda=None, rows=rows, row_bytes=row_bytes)


def test_a_checking_fetcher_gets_its_rows_checked_by_a_publisher_with_integrity_off() -> None:
    checking_fetcher_checked_by_unchecking_publisher(cuda=None, rows=96)
