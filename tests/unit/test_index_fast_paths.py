"""The linear-time index checks agree with brute force on every path they take."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvxfer.backends.common.matching import _pair_ordinals
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


# Arrays past the small-array threshold (128) take the numpy paths; below it, Python sets.
def _array(kind: str, n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if kind == "positions":
        a = np.arange(n, dtype=np.int64)
    elif kind == "permutation":
        a = rng.permutation(n).astype(np.int64)
    elif kind == "repeat":
        a = rng.integers(0, max(1, n // 2), size=n).astype(np.int64)
    elif kind == "gap":
        a = np.arange(n, dtype=np.int64)
        a[n // 2:] += 1  # increasing, distinct, but not 0..n-1
    else:
        a = np.sort(rng.choice(1 << 40, size=n, replace=False)).astype(np.int64)
    return a


kinds = st.sampled_from(["positions", "permutation", "repeat", "gap", "sparse"])
sizes = st.one_of(st.integers(0, 140), st.integers(120, 5000))


@settings(max_examples=300, deadline=None)
@given(kinds, sizes, st.integers(0, 2**32 - 1))
def test_index_facts_match_brute_force(kind: str, n: int, seed: int) -> None:
    from kvxfer.contract.arrays import bounds, is_positions

    a = _array(kind, n, seed)
    assert all_distinct(a) == (np.unique(a).size == a.size)
    assert is_positions(a) == bool(np.array_equal(a, np.arange(n)))
    assert bounds(a) == ((int(a.min()), int(a.max())) if n else None)


@settings(max_examples=100, deadline=None)
@given(kinds, sizes, st.integers(0, 2**32 - 1))
def test_group_facts_are_computed_once_and_survive_pickling(kind: str, n: int, seed: int) -> None:
    import pickle

    from kvxfer.contract import CacheKind, HintGroup, LayerGroupRows, MemoryKind, SlotRegion

    ordinals = _array(kind, n, seed)
    slots = np.arange(n, dtype=np.int64)
    region = SlotRegion("r", 4096, 64, max(n, 1), MemoryKind.HOST)
    group = LayerGroupRows("g", CacheKind.PAGED, region, slots, ordinals)
    positions = bool(np.array_equal(ordinals, np.arange(n)))
    distinct = np.unique(ordinals).size == n
    assert group.ordinals_are_positions == positions
    assert group.ordinals_distinct == distinct
    assert group.slots_distinct
    assert group.slot_bounds == ((0, n - 1) if n else None)
    again = pickle.loads(pickle.dumps(group))
    assert (again.ordinals_are_positions, again.ordinals_distinct) == (positions, distinct)
    if distinct:
        hint = HintGroup("g", CacheKind.PAGED, "r", 4096, 64, max(n, 1), MemoryKind.HOST, 0, slots, ordinals)
        assert hint.ordinals_are_positions == positions
        assert pickle.loads(pickle.dumps(hint)).ordinals_are_positions == positions


def test_unpickled_groups_are_rebuilt_read_only_and_validated() -> None:
    import pickle

    from kvxfer.contract import CacheKind, HintGroup, LayerGroupRows, MemoryKind, SlotRegion

    slots = np.array([3, 1, 2], dtype=np.int64)
    ordinals = np.arange(3, dtype=np.int64)
    group = LayerGroupRows("g", CacheKind.PAGED, SlotRegion("r", 4096, 64, 8, MemoryKind.HOST), slots, ordinals)
    assert group.slot_bounds == (1, 3)
    back = pickle.loads(pickle.dumps(group))
    assert not back.slots.flags.writeable and not back.ordinals.flags.writeable
    assert back == group and back.slot_bounds == (1, 3)
    hint = HintGroup("g", CacheKind.PAGED, "r", 4096, 64, 8, MemoryKind.HOST, 0, slots, ordinals)
    again = pickle.loads(pickle.dumps(hint))
    assert not again.slots.flags.writeable and again.ordinals_are_positions
    # A pickle whose slots lie outside the region is refused on loading, as the constructor would.
    object.__setattr__(hint, "slots", np.array([3, 1, 9], dtype=np.int64))
    data = pickle.dumps(hint)
    try:
        pickle.loads(data)
    except ValueError as exc:
        assert "slot outside" in str(exc)
    else:
        raise AssertionError("an out-of-range hint group was unpickled")


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 300), st.sampled_from(["positions", "same-order", "shuffled"]), st.integers(0, 2**32 - 1))
def test_match_rows_pairs_equal_ordinals_and_shares_whole_requests(n: int, kind: str, seed: int) -> None:
    from kvxfer.backends.common.matching import match_rows
    from kvxfer.contract import (
        CacheKind,
        Hint,
        HintGroup,
        LayerGroupRows,
        MemoryKind,
        SlotRegion,
        TokenRange,
        TransferMode,
        View,
    )

    rng = np.random.default_rng(seed)
    ordinals = np.arange(n, dtype=np.int64) + (0 if kind == "positions" else 5)
    peer_ordinals = ordinals if kind != "shuffled" else rng.permutation(ordinals)
    slots, peer_slots = rng.permutation(2 * n + 1)[:n], rng.permutation(2 * n + 1)[:n]
    region = SlotRegion("r", 4096, 64, 2 * n + 1, MemoryKind.HOST)
    view = View("q", TokenRange(0, 16), (LayerGroupRows("g", CacheKind.PAGED, region, slots, ordinals),))
    hint = Hint(backend="x", mode=TransferMode.PUSH, agent="a", request="q", transfer_id="t", layout=b"",
                groups=(HintGroup("g", CacheKind.PAGED, "p", 4096, 64, 2 * n + 1, MemoryKind.HOST, 0, peer_slots,
                                  peer_ordinals),))
    (m,) = match_rows(view, hint)
    assert m.local_rows.size == n
    assert np.array_equal(ordinals[m.local_rows], peer_ordinals[m.peer_rows])  # each pair names one block
    assert np.array_equal(m.local_slots, slots[m.local_rows]) and np.array_equal(m.peer_slots, peer_slots[m.peer_rows])
    for a in (m.local_rows, m.peer_rows, m.local_slots, m.peer_slots):
        assert not a.flags.writeable
