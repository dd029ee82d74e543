"""Snapshots of index arrays: the contract's arrays are read-only int64 copies."""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

IndexArray = npt.NDArray[np.int64]
BoolArray = npt.NDArray[np.bool_]


def frozen_int64(values: Any, what: str) -> IndexArray:
    """Copy ``values`` into a fresh read-only one-dimensional int64 array.

    Integer input of any width is accepted when every value fits; floats, bools and
    objects are refused so that a caller's mistake is named instead of truncated.
    """
    array = np.asarray(values)
    if array.dtype == np.bool_ or not (
        np.issubdtype(array.dtype, np.integer) or (array.size == 0 and array.dtype == np.float64)
    ):
        raise TypeError(f"{what} must hold integers, got dtype {array.dtype}")
    if array.ndim != 1:
        raise ValueError(f"{what} must be one-dimensional, got shape {array.shape}")
    if array.dtype == np.uint64 and array.size and int(array.max()) > np.iinfo(np.int64).max:
        raise ValueError(f"{what} has values beyond int64")
    out = np.array(array, dtype=np.int64, copy=True)
    out.flags.writeable = False
    return out


def all_distinct(values: IndexArray) -> bool:
    """True when no value repeats. Linear for sorted or densely ranged input (the usual
    slots and ordinals); ``np.unique`` is an order of magnitude slower at 100k rows."""
    n = values.size
    if n < 2:
        return True
    steps = np.diff(values)
    if bool((steps > 0).all()) or bool((steps < 0).all()):
        return True
    low, high = int(values.min()), int(values.max())
    span = high - low + 1
    if span <= 4 * n + 4096:
        return int(np.bincount(values - low, minlength=span).max()) <= 1
    ordered = np.sort(values)
    return not bool((ordered[1:] == ordered[:-1]).any())
