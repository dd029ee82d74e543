"""End-to-end row integrity on the host movers (loopback, the store): a row whose bytes changed
between the reading end and where they landed is False, with a reason naming it, and never
Delivered; no clean row is ever refused."""

from __future__ import annotations

import time

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvxfer.backends.blob import BlobBackend, MemoryDriver, MemoryStore
from kvxfer.backends.blob.digests import DIGEST_SUFFIX
from kvxfer.backends.common.integrity import DIGEST_K, MISMATCH, row_digests
from kvxfer.backends.loopback import LoopbackBackend, LoopbackFabric
from kvxfer.contract import (
    CacheKind,
    CompletionRecord,
    Delivered,
    Failed,
    LayerGroupRows,
    Outcome,
    RecordStatus,
    TokenRange,
    TransferMode,
    View,
)
from kvxfer.testing.corruption import Corruptor, flip_bit, reverse_row
from kvxfer.testing.memory import HostBuffer
from kvxfer.testing.waiting import settle
from kvxfer.wire import WireError, decode_completion, encode_completion

ROW = 256
KEY = bytes(range(32))


def _reference(row: bytes) -> int:
    """The digest as docs define it, one word at a time (Fletcher's a += x; b += a)."""
    row += bytes(-len(row) % 8)
    a = b = 0
    for i in range(0, len(row), 8):
        a = (a + int.from_bytes(row[i:i + 8], "little")) % 2**64
        b = (b + a) % 2**64
    return (a + DIGEST_K * b) % 2**64


@given(st.binary(min_size=1, max_size=200), st.data())
def test_the_digest_is_the_documented_sum_and_changes_with_any_single_bit(row: bytes, data: st.DataObject) -> None:
    buf = np.frombuffer(row * 3, dtype=np.uint8).copy()
    digests = row_digests(buf.ctypes.data, len(row), np.array([2, 0, 1]))
    assert digests.tolist() == [_reference(row)] * 3
    bit = data.draw(st.integers(0, 8 * len(row) - 1))
    buf[len(row) + bit // 8] ^= 1 << (bit % 8)
    assert row_digests(buf.ctypes.data, len(row), np.array([1]))[0] != digests[0]


def test_record_digests_travel_under_the_mac_and_a_wrong_length_is_refused() -> None:
    masks = [np.array([True, False, True]), np.array([True])]
    digests = [np.array([1, 0, 2**64 - 1], dtype=np.uint64), np.array([7], dtype=np.uint64)]
    record = CompletionRecord("t", "a", "r", RecordStatus.DELIVERED, masks, "", digests)
    back = decode_completion(encode_completion(record, KEY), KEY)
    assert [d.tolist() for d in back.digests] == [[1, 0, 2**64 - 1], [7]]
    assert decode_completion(encode_completion(CompletionRecord("t", "a", "r", RecordStatus.DELIVERED, masks))).digests == ()
    signed = bytearray(encode_completion(record, KEY))
    signed[signed.index((2**64 - 1).to_bytes(8, "little"))] ^= 1  # one bit of a digest, on the wire
    with pytest.raises(WireError, match="wrong MAC"):
        decode_completion(bytes(signed), KEY)
    with pytest.raises(ValueError, match="digest array 1 has shape"):
        CompletionRecord("t", "a", "r", RecordStatus.DELIVERED, masks, "", [digests[0], digests[0]])


# --- loopback -----------------------------------------------------------------------------------
def _view(buf: HostBuffer, slots: list[int], request: str) -> View:
    return View(request, TokenRange(0, 16 * len(slots)),
                (LayerGroupRows("g", CacheKind.PAGED, buf.region, slots, list(range(len(slots)))),), b"L")


def _done(attempt: object) -> Outcome:
    assert settle(lambda: attempt.poll() is not None and attempt.quiesced(), 10.0)  # type: ignore[attr-defined]
    return attempt.poll()  # type: ignore[attr-defined, no-any-return]


class _Loop:
    def __init__(self, mode: TransferMode, corrupt: Corruptor | None, integrity: bool = True) -> None:
        fabric = LoopbackFabric()
        self.fetcher = LoopbackBackend(fabric, "fetcher", mode, integrity=integrity, corrupt_landed=corrupt)
        self.publisher = LoopbackBackend(fabric, "publisher", mode, integrity=integrity)
        self.dst, self.src = HostBuffer("D", ROW, 64), HostBuffer("S", ROW, 64)
        self.fetcher.register([self.dst.region])
        self.publisher.register([self.src.region])
        self.rng = np.random.default_rng(1)

    def move(self, request: str, dst: list[int], src: list[int]) -> tuple[Outcome, Outcome]:
        self.src.array[src] = self.rng.integers(0, 256, (len(src), ROW), dtype=np.uint8)
        vd, vs = _view(self.dst, dst, request), _view(self.src, src, request)
        hd, hs = self.fetcher.describe(vd), self.publisher.describe(vs)
        fetch, publish = self.fetcher.fetch(vd, hs), self.publisher.publish(vs, hd)
        return _done(fetch), _done(publish)

    def close(self) -> None:
        assert self.fetcher.shutdown() == frozenset() and self.publisher.shutdown() == frozenset()


@pytest.mark.parametrize("mode", list(TransferMode))
def test_a_loopback_row_changed_after_landing_is_false_and_named(mode: TransferMode) -> None:
    def corrupt(region: object, slots: np.ndarray) -> None:
        flip_bit(pair.dst.region, 12, 1000)
        reverse_row(pair.dst.region, 14)

    pair = _Loop(mode, corrupt)  # type: ignore[arg-type]
    try:
        fetched, published = pair.move("r", list(range(10, 16)), list(range(6)))
        assert isinstance(fetched, Failed) and fetched.reason.startswith(MISMATCH)
        assert "rows [2, 4]" in fetched.reason
        assert fetched.masks[0].tolist() == [True, True, False, True, False, True]
        assert pair.fetcher.integrity.rows_failed == 2
        if mode is TransferMode.PULL:  # the publisher hears what the fetcher found
            assert isinstance(published, Failed) and published.masks[0].tolist() == fetched.masks[0].tolist()
    finally:
        pair.close()


def test_with_integrity_off_nothing_is_checked() -> None:
    pair = _Loop(TransferMode.PUSH, lambda region, slots: flip_bit(region, int(slots[0]), 3), integrity=False)
    try:
        fetched, _ = pair.move("r", [1, 2], [3, 4])
        assert isinstance(fetched, Delivered) and fetched.all_delivered  # what the flag gives up
    finally:
        pair.close()


@pytest.mark.parametrize("mode", list(TransferMode))
def test_thousands_of_loopback_rows_corrupted_at_random_are_all_caught_and_no_clean_row_is_refused(
        mode: TransferMode) -> None:
    corruptor = Corruptor(seed=7 if mode is TransferMode.PUSH else 8, p_bit=0.05, p_row=0.05)
    pair = _Loop(mode, corruptor)
    rng = np.random.default_rng(3)
    rows = 0
    try:
        for i in range(150):
            n = int(rng.integers(1, 24))
            dst = rng.choice(64, n, replace=False).tolist()
            fetched, _ = pair.move(f"r{i}", dst, rng.choice(64, n, replace=False).tolist())
            changed = {slot for _, slot in corruptor.take()}
            expected = [slot not in changed for slot in dst]
            assert fetched.masks[0].tolist() == expected
            assert isinstance(fetched, Delivered) == all(expected)
            rows += n
        assert rows > 1500 and corruptor.rows_seen == rows
    finally:
        pair.close()


# --- the store ------------------------------------------------------------------------------------
def _store_end(store: MemoryStore, name: str, corrupt: Corruptor | None = None) -> tuple[BlobBackend, HostBuffer]:
    backend = BlobBackend(MemoryDriver(store), name=name, corrupt_landed=corrupt, batch_rows=16)
    buf = HostBuffer(f"{name}0", ROW, 64)
    backend.register([buf.region])
    return backend, buf


def test_the_issues_demonstration_a_flipped_bit_and_a_reversed_row_in_the_store_are_caught() -> None:
    store = MemoryStore()
    (prefill, pm), (decode, dm) = _store_end(store, "prefill"), _store_end(store, "decode")
    try:
        pm.array[:6] = np.random.default_rng(5).integers(0, 256, (6, ROW), dtype=np.uint8)
        view = _view(pm, list(range(6)), "r1")
        assert isinstance(_done(prefill.publish(view, prefill.describe(view))), Delivered)
        keys = sorted(k for k in store.blobs if not k.endswith(DIGEST_SUFFIX))
        names = prefill.describe(view).extra("names:g")
        assert names is not None
        row2, row4 = names[2 * 16:3 * 16], names[4 * 16:5 * 16]
        assert row2 in keys and row4 in keys
        blob2 = bytearray(store.blobs[row2])
        blob2[100] ^= 0x10
        store.blobs[row2] = bytes(blob2)
        store.blobs[row4] = store.blobs[row4][::-1]
        into = _view(dm, list(range(20, 26)), "r1")
        fetched = _done(decode.fetch(into, decode.describe(into)))
        assert isinstance(fetched, Failed) and fetched.reason.startswith(MISMATCH)
        assert fetched.masks[0].tolist() == [True, True, False, True, False, True]
        assert decode.integrity.rows_failed == 2
        assert np.array_equal(dm.array[[20, 21, 23, 25]], pm.array[[0, 1, 3, 5]])
    finally:
        assert prefill.shutdown() == frozenset() and decode.shutdown() == frozenset()


def test_a_stored_row_without_its_digest_is_not_delivered() -> None:
    store = MemoryStore()
    (prefill, pm), (decode, dm) = _store_end(store, "prefill"), _store_end(store, "decode")
    try:
        view = _view(pm, [0, 1, 2], "r1")
        assert isinstance(_done(prefill.publish(view, prefill.describe(view))), Delivered)
        store.lose([k for k in store.blobs if k.endswith(DIGEST_SUFFIX)][:1])
        into = _view(dm, [5, 6, 7], "r1")
        fetched = _done(decode.fetch(into, decode.describe(into)))
        assert isinstance(fetched, Failed) and fetched.reason.startswith(MISMATCH) and fetched.rows_delivered == 2
    finally:
        assert prefill.shutdown() == frozenset() and decode.shutdown() == frozenset()


def test_thousands_of_store_rows_corrupted_at_random_are_all_caught_and_no_clean_row_is_refused() -> None:
    store = MemoryStore()
    corruptor = Corruptor(seed=11, p_bit=0.05, p_row=0.05)
    (prefill, pm), (decode, dm) = _store_end(store, "prefill"), _store_end(store, "decode", corruptor)
    rng = np.random.default_rng(4)
    rows = 0
    start = time.monotonic()
    try:
        for i in range(120):
            n = int(rng.integers(1, 32))
            src, dst = rng.choice(64, n, replace=False).tolist(), rng.choice(64, n, replace=False).tolist()
            pm.array[src] = rng.integers(0, 256, (n, ROW), dtype=np.uint8)
            view = _view(pm, src, f"r{i}")
            assert isinstance(_done(prefill.publish(view, prefill.describe(view))), Delivered)
            into = _view(dm, dst, f"r{i}")
            fetched = _done(decode.fetch(into, decode.describe(into)))
            changed = {slot for _, slot in corruptor.take()}
            expected = [slot not in changed for slot in dst]
            assert fetched.masks[0].tolist() == expected
            assert isinstance(fetched, Delivered) == all(expected)
            ok = np.array(expected)
            assert np.array_equal(dm.array[np.array(dst)[ok]], pm.array[np.array(src)[ok]])
            rows += n
        assert rows > 1500 and time.monotonic() - start < 15
    finally:
        assert prefill.shutdown() == frozenset() and decode.shutdown() == frozenset()
