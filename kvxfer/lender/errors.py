"""The lenders' errors: one branch of kvxfer's error tree (``kvxfer.contract.errors``)."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from kvxfer.contract import KvxferError


class LeaseError(KvxferError):
    """A lease or lender was used wrongly (the message names the misuse)."""


class LendingDisabled(LeaseError):
    """The lender lends no more: its pool's reuse scope was reset, or it was shut down."""


class LenderBusy(LeaseError):
    """Shutdown refused: leases are open or attempts not quiesced (pass force=True to retain)."""


class AlreadyLent(LeaseError):
    """A second lender over memory that a live lender already lends: two lenders would each
    believe they own the pins. Shut the first down (or drop it) before lending again."""


class BlocksBusy(LeaseError):
    """The engine frees blocks that a lease, or an attempt of a released one, may still
    touch; ``blocks`` lists them. Nothing was recorded: free them with ``defer=True`` (the
    lender hands them back through ``reclaim()``) or after the attempts quiesced."""

    def __init__(self, message: str, blocks: Iterable[int]) -> None:
        super().__init__(message)
        self.blocks = np.asarray(list(blocks), dtype=np.int64)
