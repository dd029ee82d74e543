"""Snapshots of index arrays: the contract's arrays are read-only int64 copies."""

from __future__ import annotations

import functools
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt

IndexArray = npt.NDArray[np.int64]
BoolArray = npt.NDArray[np.bool_]
_T = TypeVar("_T", bound=np.generic)


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
    return sealed(np.ascontiguousarray(array, dtype=np.int64))


def sealed(array: npt.NDArray[_T]) -> npt.NDArray[_T]:
    """A read-only copy of ``array`` that cannot be made writeable again: its memory is an
    immutable bytes object (numpy refuses to set WRITEABLE on such an array, where it lets
    any array that owns its memory be opened again)."""
    return np.frombuffer(np.ascontiguousarray(array).tobytes(), dtype=array.dtype)


SHARED_MASK_ROWS = 1 << 18  # constant masks up to this size are made once and shared


def constant_mask(n: int, value: bool) -> BoolArray:
    """A read-only mask of ``n`` rows, all ``value``. Up to SHARED_MASK_ROWS rows it is one
    shared array per (n, value): most groups move whole, and the wire codec then recognises
    the mask by identity instead of packing its bits."""
    if n <= SHARED_MASK_ROWS:
        return _shared_mask(n, bool(value))
    return sealed(np.full(n, bool(value), dtype=np.bool_))


@functools.lru_cache(maxsize=64)
def _shared_mask(n: int, value: bool) -> BoolArray:
    # Shared by every caller: sealed, so that nobody can make it writeable again.
    return sealed(np.full(n, value, dtype=np.bool_))


_SMALL = 128  # below this a Python set beats numpy's per-call overhead (a small request's rows)


def bounds(values: IndexArray) -> tuple[int, int] | None:
    """(min, max), or None for an empty array."""
    if values.size == 0:
        return None
    if values.size <= _SMALL:  # numpy's per-call overhead dominates small requests
        listed = values.tolist()
        return min(listed), max(listed)
    return int(values.min()), int(values.max())


def is_positions(values: IndexArray) -> bool:
    """True when ``values`` is exactly 0, 1, ..., n-1: every block of a request, in order."""
    n = values.size
    if n == 0:
        return True
    if int(values[0]) != 0 or int(values[-1]) != n - 1:
        return False
    if n <= _SMALL:
        return bool(values.tolist() == list(range(n)))
    return bool((np.diff(values) == 1).all())


def all_distinct(values: IndexArray) -> bool:
    """True when no value repeats. Linear for sorted or densely ranged input (the usual
    slots and ordinals); ``np.unique`` is an order of magnitude slower at 100k rows."""
    n = values.size
    if n < 2:
        return True
    if n <= _SMALL:
        return len(set(values.tolist())) == n
    # Compared, not subtracted: a difference of int64 values can wrap around and look sorted.
    if bool((values[1:] > values[:-1]).all()) or bool((values[1:] < values[:-1]).all()):
        return True
    low, high = int(values.min()), int(values.max())
    span = high - low + 1
    if span <= 4 * n + 4096:
        return int(np.bincount(values - low, minlength=span).max()) <= 1
    ordered = np.sort(values)
    return not bool((ordered[1:] == ordered[:-1]).any())
