"""ResumeBounds from filled blocks: first gap, sliding windows with sinks, state, intersection."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvxfer.contract import CacheKind
from kvxfer.lender import ResumeBounds, group_interval, resume_bounds
from kvxfer.pool import LayerGroupSpec

FULL = LayerGroupSpec("full", 1, 4, 1, 8)
SWA = LayerGroupSpec("swa", 1, 4, 1, 8, window=8, sink_blocks=1)
STATE = LayerGroupSpec("ssm", 1, 1, 1, 8, kind=CacheKind.STATE)


def filled(spec: LayerGroupSpec, valid_blocks: list[int], n: int, last: int | None = None) -> np.ndarray:
    """``filled`` for ``n`` blocks of which ``valid_blocks`` are full (``last`` caps the final one)."""
    bt = spec.block_tokens
    f = np.arange(n, dtype=np.int64) * bt
    f[valid_blocks] += bt
    if last is not None:
        f[n - 1] = min(f[n - 1], last)
    return f


def test_full_attention_stops_at_first_gap() -> None:
    assert group_interval(FULL, filled(FULL, [0, 1, 3, 4], 5)) == (0, 8)
    assert group_interval(FULL, filled(FULL, [0, 1, 2], 3, last=10)) == (0, 10)
    assert group_interval(FULL, filled(FULL, [1, 2], 3)) == (0, 0)
    assert group_interval(FULL, np.zeros(0, dtype=np.int64)) == (0, 0)


def test_window_needs_only_window_and_sinks() -> None:
    # blocks 0 (sink) and 3..5 valid, 1..2 missing: resume at p in [12 + 8, 24]
    assert group_interval(SWA, filled(SWA, [0, 3, 4, 5], 6)) == (20, 24)
    # without the sink block nothing but the start works
    assert group_interval(SWA, filled(SWA, [3, 4, 5], 6)) == (0, 0)
    # a run shorter than the window cannot serve; the prefix run can
    assert group_interval(SWA, filled(SWA, [0, 1, 5], 6)) == (0, 8)


def test_state_is_exactly_one_position() -> None:
    assert group_interval(STATE, np.array([17])) == (17, 17)
    assert group_interval(STATE, np.array([-1])) == (0, 0)


def test_intersection_is_most_restrictive_and_empty_means_zero() -> None:
    f = {"full": filled(FULL, [0, 1, 2, 3, 4, 5], 6), "swa": filled(SWA, [0, 3, 4, 5], 6)}
    assert resume_bounds((FULL, SWA), f) == ResumeBounds(24, 20)
    f["full"] = filled(FULL, [0, 1, 2, 3], 6)  # full attention only up to 16 < 20
    assert resume_bounds((FULL, SWA), f) == ResumeBounds(0, 0)
    f2 = {"full": filled(FULL, [0, 1, 2, 3, 4], 5), "ssm": np.array([20])}
    assert resume_bounds((FULL, STATE), f2) == ResumeBounds(20, 20)
    f2["ssm"] = np.array([12])
    assert resume_bounds((FULL, STATE), f2) == ResumeBounds(12, 12)
    assert ResumeBounds(12, 12).allows(12) and not ResumeBounds(12, 12).allows(11)


def test_bounds_validate() -> None:
    with pytest.raises(ValueError, match="restart_floor"):
        ResumeBounds(3, 5)


def _usable_positions(spec: LayerGroupSpec, filled_ends: np.ndarray) -> list[int]:
    """Every position a group can resume at, by brute force over tokens (the oracle)."""
    bt = spec.block_tokens
    tokens = np.arange(filled_ends.size * bt)
    present = filled_ends[tokens // bt] > tokens
    ok = []
    for p in range(tokens.size + 1):
        low = 0 if spec.window is None else max(0, p - spec.window)
        sinks = min(spec.sink_blocks * bt, p)
        if present[low:p].all() and present[:sinks].all():
            ok.append(p)
    return ok


@settings(max_examples=200, deadline=None)
@given(st.sampled_from([FULL, SWA, LayerGroupSpec("swa2", 1, 2, 1, 8, window=5, sink_blocks=2)]),
       st.lists(st.integers(0, 4), min_size=0, max_size=24))
def test_group_interval_is_sound_and_reaches_the_last_usable_position(spec: LayerGroupSpec, fill: list[int]) -> None:
    bt = spec.block_tokens
    ends = np.arange(len(fill), dtype=np.int64) * bt + np.minimum(np.asarray(fill, dtype=np.int64), bt)
    floor, usable = group_interval(spec, ends)
    oracle = _usable_positions(spec, ends)
    assert all(p in oracle for p in range(floor, usable + 1))  # every offered position works
    assert usable == max(oracle)  # and none later is left out
