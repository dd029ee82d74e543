"""TokenRange, SlotRegion, LayerGroupRows and View: validation and snapshot semantics."""

from __future__ import annotations

import numpy as np
import pytest

from kvxfer.contract import CacheKind, LayerGroupRows, MemoryKind, SlotRegion, TokenRange, View


def region(name: str = "r", address: int = 4096, slot_bytes: int = 64, slots: int = 16) -> SlotRegion:
    return SlotRegion(name, address, slot_bytes, slots, MemoryKind.HOST)


class TestTokenRange:
    def test_valid_and_length(self) -> None:
        assert len(TokenRange(3, 10)) == 7
        assert len(TokenRange(5, 5)) == 0

    @pytest.mark.parametrize("start,end", [(-1, 4), (5, 4)])
    def test_invalid(self, start: int, end: int) -> None:
        with pytest.raises(ValueError, match="TokenRange"):
            TokenRange(start, end)

    def test_type_named(self) -> None:
        with pytest.raises(TypeError, match="TokenRange.start"):
            TokenRange(1.5, 4)  # type: ignore[arg-type]


class TestSlotRegion:
    def test_nbytes(self) -> None:
        assert region(slot_bytes=64, slots=16).nbytes == 1024

    @pytest.mark.parametrize(
        "kwargs,match",
        [
            (dict(address=-8), "negative"),
            (dict(slot_bytes=0), "slot_bytes must be positive"),
            (dict(slots=0), "slots must be positive"),
            (dict(address=(1 << 64) - 512, slot_bytes=64, slots=16), "overflows 64 bits"),
        ],
    )
    def test_invalid(self, kwargs: dict[str, int], match: str) -> None:
        with pytest.raises(ValueError, match=match):
            region(**kwargs)

    def test_memory_kind_must_be_enum(self) -> None:
        with pytest.raises(TypeError, match="MemoryKind"):
            SlotRegion("r", 0, 64, 4, "host")  # type: ignore[arg-type]

    def test_overlap_respects_kind_and_device(self) -> None:
        a = SlotRegion("a", 1000, 100, 10, MemoryKind.DEVICE, 0)
        assert a.overlaps(SlotRegion("b", 1999, 1, 1, MemoryKind.DEVICE, 0))
        assert not a.overlaps(SlotRegion("b", 2000, 1, 1, MemoryKind.DEVICE, 0))
        assert not a.overlaps(SlotRegion("b", 1500, 1, 1, MemoryKind.DEVICE, 1))
        assert not a.overlaps(SlotRegion("b", 1500, 1, 1, MemoryKind.HOST, 0))


class TestLayerGroupRows:
    def test_copies_caller_arrays_read_only_int64(self) -> None:
        slots = np.array([3, 1, 2], dtype=np.int32)
        ordinals = [0, 1, 2]
        rows = LayerGroupRows("g", CacheKind.PAGED, region(), slots, ordinals)
        slots[0] = 9
        assert rows.slots.tolist() == [3, 1, 2]
        assert rows.slots.dtype == np.int64 and rows.ordinals.dtype == np.int64
        assert not rows.slots.flags.writeable and not rows.ordinals.flags.writeable
        with pytest.raises(ValueError):
            rows.slots[0] = 5

    def test_lengths_must_agree(self) -> None:
        with pytest.raises(ValueError, match="3 slots but 2 ordinals"):
            LayerGroupRows("g", CacheKind.PAGED, region(), [1, 2, 3], [0, 1])

    @pytest.mark.parametrize("bad", [np.array([1.0, 2.0]), np.array([True, False])])
    def test_non_integer_refused(self, bad: np.ndarray) -> None:
        with pytest.raises(TypeError, match="integers"):
            LayerGroupRows("g", CacheKind.PAGED, region(), bad, [0, 1])

    def test_two_dimensional_refused(self) -> None:
        with pytest.raises(ValueError, match="one-dimensional"):
            LayerGroupRows("g", CacheKind.PAGED, region(), np.zeros((2, 2), np.int64), np.zeros((2, 2), np.int64))


class TestView:
    def make(self, slots: np.ndarray) -> View:
        return View("req", TokenRange(0, 48), (LayerGroupRows("g", CacheKind.PAGED, region(), slots, [0, 1, 2]),))

    def test_mutating_caller_array_changes_nothing(self) -> None:
        slots = np.array([5, 6, 7], dtype=np.int64)
        view = self.make(slots)
        slots[:] = 0
        assert view.groups[0].slots.tolist() == [5, 6, 7]
        assert not view.groups[0].slots.flags.writeable

    def test_row_masks_new_writable_each_call(self) -> None:
        view = View("req", TokenRange(0, 64), (
            LayerGroupRows("a", CacheKind.PAGED, region("x"), [1, 2, 3], [0, 1, 2]),
            LayerGroupRows("b", CacheKind.STATE, region("y", address=1 << 20), [4], [0]),
        ))
        first, second = view.row_masks(), view.row_masks(True)
        assert [m.shape for m in first] == [(3,), (1,)]
        assert all(m.dtype == np.bool_ and m.flags.writeable for m in first + second)
        assert not any(m.any() for m in first) and all(m.all() for m in second)
        first[0][0] = True
        assert not view.row_masks()[0][0]
        assert first[0] is not view.row_masks()[0]

    def test_group_named_twice_refused(self) -> None:
        g = LayerGroupRows("g", CacheKind.PAGED, region(), [1], [0])
        with pytest.raises(ValueError, match="twice"):
            View("req", TokenRange(0, 16), (g, g))

    def test_groups_must_be_rows(self) -> None:
        with pytest.raises(TypeError, match="LayerGroupRows"):
            View("req", TokenRange(0, 16), ("nope",))  # type: ignore[arg-type]

    def test_frozen(self) -> None:
        view = self.make(np.array([1, 2, 3]))
        with pytest.raises(AttributeError):
            view.request = "other"  # type: ignore[misc]
