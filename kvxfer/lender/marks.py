"""The rules every lender's ``mark_arrived`` keeps, in one place.

A write lease takes one report of arrival, before it is released, as bool masks aligned
with its view's groups (an outcome's ``masks``). Anything else is refused by name and
counts nothing: a mask of ints or floats (``[1, 1, 0]``) is not a mask, a second report
could overstate arrival, and a report after release may describe memory reused since.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from kvxfer.contract import BoolArray, InvalidSubmission, View
from kvxfer.contract.outcome import check_masks, freeze_mask
from kvxfer.lender.errors import LeaseError, LendingDisabled


def check_markable(lease: Any, *, write: bool, arrived: bool, released: bool, disabled: str | None) -> None:
    """LeaseError (LendingDisabled once the lender is shut down) unless ``lease`` may take
    its arrival report now."""
    if not write:
        raise LeaseError(f"{lease!r} is a read lease; only write leases take mark_arrived")
    if arrived:
        raise LeaseError(f"{lease!r}: mark_arrived was already called (it is once per lease)")
    if released:
        raise LeaseError(f"{lease!r} is released; mark arrival before release")
    if disabled is not None:  # its memory is retained: nothing is counted
        raise LendingDisabled(f"{lease!r}: {disabled}; arrival is no longer counted")


def arrival_masks(lease: Any, view: View, masks: Sequence[Any]) -> list[BoolArray]:
    """``masks`` as read-only bool arrays, one per group of ``view``, of its length; else
    InvalidSubmission naming the lease and what is wrong (its cause the TypeError or
    ValueError). Only numpy bool arrays are masks: ``[1, 1, 0]`` and float arrays are not."""
    try:
        if isinstance(masks, np.ndarray) or not isinstance(masks, Sequence):
            raise TypeError("masks must be a sequence of bool arrays, one per view group")
        frozen = [freeze_mask(m, i) for i, m in enumerate(masks)]
        check_masks(view, frozen)
    except (TypeError, ValueError) as exc:
        raise InvalidSubmission(f"{lease!r}: malformed masks: {exc}") from exc
    return frozen
