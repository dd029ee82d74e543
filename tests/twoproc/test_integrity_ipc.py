"""Row integrity over the IPC backend, whose copy kernel checks each row where it landed
(kvxfer.backends.ipc.rowcheck), over kvxfer.testing.host_cuda with the peer in a child process
(tests/gpu/test_ipc.py runs the same scenarios on the real kernel): rows the fault hook damaged
after their store are False, exactly those, at both ends; the outcome names the digest mismatch
and is never Delivered; every row claimed holds the source's bytes; a checking passive end gets
its rows checked by an active end whose own integrity is off."""

from __future__ import annotations

import pytest

from kvxfer.contract import TransferMode
from kvxfer.testing import host_cuda
from kvxfer.testing.ipc_integrity import (
    checking_fetcher_checked_by_unchecking_publisher,
    clean_rows_delivered,
    damaged_rows_refused_exactly,
)


@pytest.mark.parametrize("rows", [24, 96], ids=["inline", "staged"])  # indices in the launch, or uploaded
@pytest.mark.parametrize("mode", list(TransferMode), ids=lambda m: m.value)
def test_rows_damaged_where_they_landed_are_refused_exactly(mode: TransferMode, rows: int) -> None:
    damaged_rows_refused_exactly(mode, cuda=host_cuda, rows=rows)


@pytest.mark.parametrize("mode", list(TransferMode), ids=lambda m: m.value)
def test_clean_rows_are_delivered_checked(mode: TransferMode) -> None:
    clean_rows_delivered(mode, cuda=host_cuda, rows=96)


def test_a_checking_fetcher_gets_its_rows_checked_by_a_publisher_with_integrity_off() -> None:
    checking_fetcher_checked_by_unchecking_publisher(cuda=host_cuda, rows=96)
