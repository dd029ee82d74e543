"""The compiled row digest against the numpy definition: equal digests for any rows, slots,
row sizes and alignments, rows read where they lie; errors named."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvxfer import native
from kvxfer.backends.common.integrity import DIGEST_K, numpy_row_digests, row_digests

pytestmark = pytest.mark.skipif(not native.info().digest, reason=native.info().reason or "no native row digest")


@settings(max_examples=200, deadline=None)
@given(row_bytes=st.integers(1, 300), offset=st.integers(0, 15), n_slots=st.integers(1, 12), data=st.data())
def test_native_digests_equal_numpys_for_any_rows_slots_and_alignment(row_bytes: int, offset: int, n_slots: int,
                                                                       data: st.DataObject) -> None:
    seed = data.draw(st.integers(0, 2**32 - 1))
    raw = np.random.default_rng(seed).integers(0, 256, size=offset + n_slots * row_bytes, dtype=np.uint8)
    base = int(raw.ctypes.data) + offset  # unaligned when offset is not a multiple of 8
    slots = np.array(data.draw(st.lists(st.integers(0, n_slots - 1), min_size=0, max_size=24)), dtype=np.int64)
    got = native.row_digests(base=base, stride=row_bytes, slots=slots, row_bytes=row_bytes, k=DIGEST_K)
    assert got.dtype == np.uint64
    assert got.tolist() == numpy_row_digests(base, row_bytes, slots).tolist()
    assert row_digests(base, row_bytes, slots).tolist() == got.tolist()


@pytest.mark.parametrize("row_bytes", [8 * 64 * 8, 65536 + 24, 1 << 20])
def test_native_digests_equal_numpys_on_large_scattered_rows_across_threads(row_bytes: int) -> None:
    n = (8 << 20) // row_bytes + 3
    raw = np.random.default_rng(row_bytes).integers(0, 256, size=n * row_bytes, dtype=np.uint8)
    slots = np.random.default_rng(1).permutation(n).astype(np.int64)
    want = numpy_row_digests(raw.ctypes.data, row_bytes, slots).tolist()
    for threads in (1, 3, 0):
        got = native.row_digests(base=raw.ctypes.data, stride=row_bytes, slots=slots, row_bytes=row_bytes,
                                 k=DIGEST_K, threads=threads)
        assert got.tolist() == want


def test_a_row_shorter_than_its_stride_is_digested_alone() -> None:
    raw = np.random.default_rng(3).integers(0, 256, size=4 * 96, dtype=np.uint8)
    slots = np.array([3, 1], dtype=np.int64)
    got = native.row_digests(base=raw.ctypes.data, stride=96, slots=slots, row_bytes=40, k=DIGEST_K)
    rows = raw.reshape(4, 96)[:, :40].copy()
    assert got.tolist() == numpy_row_digests(rows.ctypes.data, 40, slots).tolist()


def test_bad_slots_are_refused_by_name() -> None:
    raw = np.zeros(64, dtype=np.uint8)
    with pytest.raises(native.RowCopyError, match="slot -1 at row 1 is negative"):
        native.row_digests(base=raw.ctypes.data, stride=8, slots=np.array([0, -1]), row_bytes=8, k=DIGEST_K)
    with pytest.raises(native.RowCopyError, match="one-dimensional int64"):
        native.row_digests(base=raw.ctypes.data, stride=8, slots=np.array([0.0]), row_bytes=8,  # type: ignore[arg-type]
                           k=DIGEST_K)
    assert native.row_digests(base=raw.ctypes.data, stride=8, slots=np.array([], dtype=np.int64), row_bytes=8,
                              k=DIGEST_K).tolist() == []
