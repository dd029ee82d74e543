"""The compiled host row copy against the numpy fallback: identical bytes, named errors."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvxfer import native
from kvxfer.contract import KvxferError

pytest.importorskip("kvxfer._native")


class Space:
    """A host buffer of `slots` slots of `stride` bytes, starting `offset` bytes into an allocation."""

    def __init__(self, slots: int, stride: int, offset: int = 0, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.raw = rng.integers(0, 256, size=slots * stride + offset + 16, dtype=np.uint8)
        self.offset, self.stride, self.slots = offset, stride, slots
        self.base = int(self.raw.ctypes.data) + offset

    def copy(self) -> Space:
        other = Space.__new__(Space)
        other.raw = self.raw.copy()
        other.offset, other.stride, other.slots = self.offset, self.stride, self.slots
        other.base = int(other.raw.ctypes.data) + other.offset
        return other


def run_both(src: Space, dst: Space, src_slots, dst_slots, row_bytes: int, **kw) -> tuple[bytes, bytes]:
    """Run the same copy natively and through the fallback on equal copies of dst."""
    results = []
    for impl in ("native", "fallback"):
        out = dst.copy()
        native.copy_rows(src_base=src.base, src_stride=src.stride, src_slots=src_slots, dst_base=out.base,
                         dst_stride=out.stride, dst_slots=dst_slots, row_bytes=row_bytes, impl=impl, **kw)
        results.append(out.raw.tobytes())
    return results[0], results[1]


def expected(src: Space, dst: Space, src_slots, dst_slots, row_bytes: int) -> bytes:
    out = dst.raw.copy()
    n = len(src_slots) if src_slots is not None else len(dst_slots)
    s_ix = src_slots if src_slots is not None else np.arange(n)
    d_ix = dst_slots if dst_slots is not None else np.arange(n)
    for s, d in zip(s_ix.tolist(), d_ix.tolist()):  # the slow obvious oracle
        a = src.offset + s * src.stride
        b = dst.offset + d * dst.stride
        out[b:b + row_bytes] = src.raw[a:a + row_bytes]
    return out.tobytes()


def test_info_reports_the_compiled_module() -> None:
    state = native.info()
    assert state.compiled and state.host
    assert state.module_path.endswith((".so", ".pyd"))
    if not state.cuda_usable:
        assert state.reason  # says why CUDA is not usable


@pytest.mark.parametrize("row_bytes", [1, 3, 15, 16, 17, 100, 4096, 4099])
@pytest.mark.parametrize("offsets", [(0, 0), (1, 0), (4, 8), (8, 3)])
def test_scattered_rows_match_fallback_and_oracle(row_bytes: int, offsets: tuple[int, int]) -> None:
    stride_s, stride_d = row_bytes + offsets[0], row_bytes + 8
    src, dst = Space(40, stride_s, offsets[0], 1), Space(50, stride_d, offsets[1], 2)
    rng = np.random.default_rng(row_bytes)
    src_slots = rng.permutation(40)[:25].astype(np.int64)
    dst_slots = rng.permutation(50)[:25].astype(np.int64)
    a, b = run_both(src, dst, src_slots, dst_slots, row_bytes, src_limit=40, dst_limit=50)
    assert a == b == expected(src, dst, src_slots, dst_slots, row_bytes)
    assert a != dst.raw.tobytes()


def test_gather_then_scatter_round_trips_rows() -> None:
    rb = 4096 + 5
    pool, buf, back = Space(64, rb, 0, 3), Space(20, rb, 0, 4), Space(64, rb, 0, 5)
    slots = np.array([63, 0, 7, 8, 9, 31, 2, 40, 41, 42, 43, 1, 5, 6, 11, 12, 13, 50, 51, 60], dtype=np.int64)
    for impl in ("native", "fallback"):
        out, restored = buf.copy(), back.copy()
        native.gather_rows(src_base=pool.base, src_stride=rb, src_slots=slots, dst_base=out.base, row_bytes=rb,
                           impl=impl)
        rows = pool.raw[: 64 * rb].reshape(64, rb)
        assert out.raw[: 20 * rb].tobytes() == rows[slots].tobytes()
        native.scatter_rows(src_base=out.base, dst_base=restored.base, dst_stride=rb, dst_slots=slots, row_bytes=rb,
                            impl=impl)
        got = restored.raw[: 64 * rb].reshape(64, rb)
        assert got[slots].tobytes() == rows[slots].tobytes()
        untouched = np.setdiff1d(np.arange(64), slots)
        assert got[untouched].tobytes() == back.raw[: 64 * rb].reshape(64, rb)[untouched].tobytes()


def test_large_copy_uses_threads_and_coalesced_runs_correctly() -> None:
    rb = 64 * 1024
    src, dst = Space(256, rb, 0, 6), Space(256, rb, 0, 7)  # 16 MiB: several threads
    src_slots = np.concatenate([np.arange(0, 100), np.arange(150, 256), np.arange(100, 150)]).astype(np.int64)
    dst_slots = np.roll(np.arange(256), 3).astype(np.int64)
    for threads in (0, 3, 64):
        out = dst.copy()
        native.copy_rows(src_base=src.base, src_stride=rb, src_slots=src_slots, dst_base=out.base, dst_stride=rb,
                         dst_slots=dst_slots, row_bytes=rb, threads=threads, impl="native")
        assert out.raw.tobytes() == expected(src, dst, src_slots, dst_slots, rb)


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(0, 30), row_bytes=st.integers(1, 300), pad=st.integers(0, 20), off=st.integers(0, 15),
    seed=st.integers(0, 2**16),
)
def test_any_geometry_matches_fallback(n: int, row_bytes: int, pad: int, off: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    src, dst = Space(32, row_bytes + pad, off, seed), Space(32, row_bytes + pad + 1, 15 - off, seed + 1)
    src_slots = rng.integers(0, 32, size=n).astype(np.int64)  # repeats allowed on the read side
    dst_slots = rng.permutation(32)[:n].astype(np.int64)
    a, b = run_both(src, dst, src_slots, dst_slots, row_bytes)
    assert a == b == expected(src, dst, src_slots, dst_slots, row_bytes)


@pytest.mark.parametrize("impl", ["native", "fallback"])
def test_errors_are_named(impl: str) -> None:
    src, dst = Space(8, 64), Space(8, 64)
    ok = np.arange(4, dtype=np.int64)
    common = dict(src_base=src.base, src_stride=64, dst_base=dst.base, dst_stride=64, impl=impl)
    with pytest.raises(native.RowCopyError, match="destination index 8 is outside"):
        native.copy_rows(src_slots=ok, dst_slots=np.array([0, 1, 2, 8]), row_bytes=64, dst_limit=8, **common)
    with pytest.raises(native.RowCopyError, match="source index -1"):
        native.copy_rows(src_slots=np.array([0, -1, 2, 3]), dst_slots=ok, row_bytes=64, src_limit=8, **common)
    with pytest.raises(native.RowCopyError, match="exceeds a stride"):
        native.copy_rows(src_slots=ok, dst_slots=ok, row_bytes=65, **common)
    with pytest.raises(native.RowCopyError, match="int64"):
        native.copy_rows(src_slots=ok.astype(np.int32), dst_slots=ok, row_bytes=64, **common)
    with pytest.raises(native.RowCopyError, match="3 rows, the other end 4"):
        native.copy_rows(src_slots=ok, dst_slots=ok[:3], row_bytes=64, **common)
    # A contiguous end is bounded by its limit too (a gather or scatter's buffer end).
    with pytest.raises(native.RowCopyError, match="destination rows 0..9 do not fit its 4 slots"):
        native.copy_rows(src_slots=np.arange(10, dtype=np.int64) % 8, dst_slots=None, row_bytes=64, dst_limit=4,
                         **common)
    # Without a limit, a negative slot or one whose address wraps around int64 is still refused
    # (the native copy read before the base; the fallback wrapped around Python-style).
    with pytest.raises(native.RowCopyError, match="source index -1 is outside"):
        native.copy_rows(src_slots=np.array([-1, 3]), dst_slots=ok[:2], row_bytes=64, **common)
    with pytest.raises(native.RowCopyError, match="past the end of the address space"):
        native.copy_rows(src_slots=np.array([0, 1 << 58]), dst_slots=ok[:2], row_bytes=64, **common)
    with pytest.raises(native.RowCopyError, match="device-resident indices"):
        native.copy_rows(src_slots=native.DeviceIndex(8), dst_slots=native.DeviceIndex(16), n_rows=4, row_bytes=64,
                         src_limit=8, **common)
    assert issubclass(native.RowCopyError, KvxferError)
    assert dst.raw.tobytes() == Space(8, 64).raw.tobytes()  # nothing was written


def test_spin_poll_refuses_a_strided_words_view() -> None:
    backing = np.zeros(16, dtype=np.uint64)
    backing[8] = 1  # outside the view below, which the native spin would have read
    with pytest.raises(ValueError, match="contiguous"):
        native.spin_poll([], 0.0, backing[:8][::-1], np.array([1], dtype=np.int64))


def test_native_module_checks_on_its_own() -> None:
    """The compiled entry points refuse bad input themselves, with a named CopyError."""
    from kvxfer import _native

    src, dst = Space(8, 64), Space(8, 64)
    ix = np.arange(4, dtype=np.int64)
    with pytest.raises(_native.CopyError, match="destination index 9 at row 3 is outside"):
        _native.host_copy_rows(src.base, 64, ix, dst.base, 64, np.array([0, 1, 2, 9]), 4, 64, 0, 8, 8)
    with pytest.raises(_native.CopyError, match="exceeds the source stride"):
        _native.host_copy_rows(src.base, 32, ix, dst.base, 64, ix, 4, 64)
    with pytest.raises(_native.CopyError, match="destination rows 0..4 do not fit its 4 slots"):
        _native.host_copy_rows(src.base, 64, np.arange(5, dtype=np.int64), dst.base, 64, None, 5, 64, 0, 8, 4)
    with pytest.raises(_native.CopyError, match="source index has 4 entries for 5 rows"):
        _native.host_copy_rows(src.base, 64, ix, dst.base, 64, None, 5, 64)
    with pytest.raises(TypeError):
        _native.host_copy_rows(src.base, 64, ix.astype(np.int32), dst.base, 64, ix, 4, 64)


def test_device_copy_without_cuda_names_why() -> None:
    if native.info().cuda_usable:
        pytest.skip("CUDA is usable here; covered by tests/gpu")
    src, dst = Space(8, 64), Space(8, 64)
    ix = np.arange(4, dtype=np.int64)
    with pytest.raises(native.RowCopyError, match="CUDA"):
        native.copy_rows(src_base=src.base, src_stride=64, src_slots=ix, dst_base=dst.base, dst_stride=64,
                         dst_slots=ix, row_bytes=64, memory=native.MemoryKind.DEVICE, impl="native")
    with pytest.raises(native.RowCopyError):
        native.cuda_module()
