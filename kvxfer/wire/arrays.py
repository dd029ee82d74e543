"""Arrays on the wire: rows as little-endian int64 bytes, masks as packed bits.

Both are one numpy call each way (tobytes / frombuffer, packbits / unpackbits), so a hint
of a million rows costs no per-row Python. A mask travels as its row count plus
``ceil(rows / 8)`` bytes, bit ``i`` of the mask being bit ``i % 8`` (least significant
first) of byte ``i // 8``; the unused high bits of the last byte must be zero, so that
each mask has exactly one encoding.
"""

from __future__ import annotations

import functools

import numpy as np

from kvxfer.contract import BoolArray, IndexArray, constant_mask
from kvxfer.contract.arrays import SHARED_MASK_ROWS
from kvxfer.wire.errors import WireError

_LE_INT64 = np.dtype("<i8")


def int64_to_bytes(values: IndexArray) -> bytes:
    return np.ascontiguousarray(values, dtype=_LE_INT64).tobytes()


def int64_from_bytes(data: bytes, what: str, max_rows: int) -> IndexArray:
    """A read-only native int64 array from little-endian bytes (a view on ``data``)."""
    if len(data) // 8 > max_rows:
        raise WireError(f"{what}: {len(data) // 8} rows, the limit is {max_rows}")
    if len(data) % 8:
        raise WireError(f"{what}: {len(data)} bytes is not a whole number of int64 values")
    # On a little-endian host astype(copy=False) keeps the view; the contract copies anyway.
    return np.frombuffer(data, dtype=_LE_INT64).astype(np.int64, copy=False)


def mask_to_bytes(mask: BoolArray) -> bytes:
    n = getattr(mask, "size", SHARED_MASK_ROWS + 1)
    if n <= SHARED_MASK_ROWS and mask is constant_mask(n, True):
        return _all_true_bits(n)  # a whole group's mask, recognised without reading it
    return np.packbits(np.asarray(mask, dtype=np.bool_), bitorder="little").tobytes()


def mask_from_bytes(rows: int, data: bytes, what: str, max_rows: int) -> BoolArray:
    if rows > max_rows:
        raise WireError(f"{what}: {rows} rows, the limit is {max_rows}")
    if len(data) != (rows + 7) // 8:
        raise WireError(f"{what}: {len(data)} bytes of bits for {rows} rows, expected {(rows + 7) // 8}")
    if rows <= SHARED_MASK_ROWS and data == _all_true_bits(rows):
        return constant_mask(rows, True)  # every row (the usual record): a memcmp, a shared mask
    packed = np.frombuffer(data, dtype=np.uint8)
    if rows % 8 and int(packed[-1]) >> (rows % 8):
        raise WireError(f"{what}: bits set beyond row {rows}")
    # unpackbits yields only 0 and 1, which are exactly numpy's bool bytes: a view is the
    # mask (astype(bool) would test each byte again, 13x slower at 262,144 rows).
    mask = np.unpackbits(packed, count=rows, bitorder="little").view(np.bool_)
    mask.flags.writeable = False
    return mask


@functools.lru_cache(maxsize=64)
def _all_true_bits(rows: int) -> bytes:
    return np.packbits(np.ones(rows, dtype=np.bool_), bitorder="little").tobytes()
