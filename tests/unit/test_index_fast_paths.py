"""The linear-time index checks agree with brute force on every path they take."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvxfer.backends.matching import _pair_ordinals
from kvxfer.contract.arrays import all_distinct

values = st.one_of(
    st.lists(st.integers(0, 50), max_size=60),                       # dense, repeats likely
    st.lists(st.integers(-(2**63), 2**63 - 1), max_size=30),         # sparse: the sort path
    st.lists(st.integers(0, 10_000), max_size=40, unique=True).map(sorted),  # increasing
)


@settings(max_examples=300, deadline=None)
@given(values)
def test_all_distinct_matches_unique(xs: list[int]) -> None:
    a = np.array(xs, dtype=np.int64)
    assert all_distinct(a) == (np.unique(a).size == a.size)


distinct = st.one_of(
    st.lists(st.integers(0, 80), max_size=50, unique=True),
    st.lists(st.integers(-(2**62), 2**62), max_size=30, unique=True),
)


@settings(max_examples=300, deadline=None)
@given(distinct, distinct, st.booleans())
def test_pair_ordinals_matches_brute_force(local: list[int], peer: list[int], same: bool) -> None:
    if same:
        peer = list(local)
    if not local or not peer:
        return
    la, pa = np.array(local, dtype=np.int64), np.array(peer, dtype=np.int64)
    local_rows, peer_rows = _pair_ordinals(la, pa)
    where = {o: i for i, o in enumerate(peer)}
    expected = [(i, where[o]) for i, o in enumerate(local) if o in where]
    assert list(zip(local_rows.tolist(), peer_rows.tolist())) == expected
