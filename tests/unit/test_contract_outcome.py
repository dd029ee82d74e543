"""Outcome masks: dtype, keep-or-copy, masked arrays, shapes against the view."""

from __future__ import annotations

import numpy as np
import pytest

from kvxfer.contract import (
    CacheKind,
    Cancelled,
    Delivered,
    Failed,
    LayerGroupRows,
    MemoryKind,
    SlotRegion,
    TokenRange,
    View,
)


def view_of(*lengths: int) -> View:
    groups = tuple(
        LayerGroupRows(f"g{i}", CacheKind.PAGED, SlotRegion(f"r{i}", 4096 * (i + 1), 8, 64, MemoryKind.HOST),
                       np.arange(n), np.arange(n))
        for i, n in enumerate(lengths)
    )
    return View("req", TokenRange(0, 16 * max(lengths, default=0)), groups)


def read_only(array: np.ndarray) -> np.ndarray:
    array.flags.writeable = False
    return array


@pytest.mark.parametrize("make", [
    lambda m: Delivered([m]),
    lambda m: Failed("boom", [m]),
    lambda m: Cancelled(False, [m]),
])
class TestMaskRules:
    def test_read_only_plain_bool_kept(self, make) -> None:  # type: ignore[no-untyped-def]
        mask = read_only(np.array([True, False]))
        assert make(mask).masks[0] is mask

    def test_writable_copied_and_read_only(self, make) -> None:  # type: ignore[no-untyped-def]
        mask = np.array([True, False])
        kept = make(mask).masks[0]
        assert kept is not mask and not kept.flags.writeable
        mask[1] = True
        assert kept.tolist() == [True, False]

    @pytest.mark.parametrize("dtype", [np.int8, np.uint8, np.int64, np.float32, np.float64])
    def test_other_dtypes_type_error_even_read_only(self, make, dtype) -> None:  # type: ignore[no-untyped-def]
        with pytest.raises(TypeError, match="dtype bool"):
            make(read_only(np.array([1, 0], dtype=dtype)))

    def test_read_only_masked_array_copied_to_plain(self, make) -> None:  # type: ignore[no-untyped-def]
        masked = np.ma.MaskedArray(np.array([True, False, True]), mask=[False, True, False])
        masked.flags.writeable = False
        assert masked.all()  # the trap: all() skips the masked False row
        kept = make(masked).masks[0]
        assert type(kept) is np.ndarray
        assert kept.tolist() == [True, False, True] and not kept.all()
        assert not kept.flags.writeable

    def test_not_an_array(self, make) -> None:  # type: ignore[no-untyped-def]
        with pytest.raises(TypeError):
            make([True, False])


def test_wrong_count_for_view() -> None:
    with pytest.raises(ValueError, match="1 masks for a view of 2 groups"):
        Delivered([np.ones(3, bool)], view=view_of(3, 2))


def test_wrong_length_for_view() -> None:
    with pytest.raises(ValueError, match="has shape"):
        Failed("x", [np.ones(3, bool), np.ones(3, bool)], view=view_of(3, 2))


def test_matching_view_accepted_and_counts() -> None:
    outcome = Cancelled(True, [np.array([True, False, True]), np.array([True, True])], view=view_of(3, 2))
    assert outcome.by_peer and outcome.rows_delivered == 4 and not outcome.all_delivered


def test_failed_needs_reason() -> None:
    with pytest.raises(ValueError, match="reason"):
        Failed("", [])


def test_outcomes_frozen() -> None:
    outcome = Delivered([np.ones(1, bool)])
    with pytest.raises(AttributeError):
        outcome.masks = ()  # type: ignore[misc]
