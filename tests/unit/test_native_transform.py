"""The layout transform over host memory: the compiled path and the numpy fallback against a
reference that indexes the layouts as arrays; refusals named, with nothing copied."""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import numpy as np
import pytest

from kvxfer import native
from kvxfer.contract import MemoryKind

IMPLS = [
    pytest.param("native", marks=pytest.mark.skipif(not native.info().transform,
                                                    reason=native.info().reason or "no native transform")),
    "fallback",
]


@dataclass
class Pool:
    """Paged KV of `planes` planes (a layer's K or V) x `blocks` blocks, each block
    `block_tokens` tokens x `heads` heads x `unit` bytes, NHD or HND, in one host buffer that
    starts `offset` bytes into its allocation."""

    layout: str
    planes: int
    blocks: int
    block_tokens: int
    heads: int
    unit: int
    offset: int = 0
    seed: int = 0

    def __post_init__(self) -> None:
        rng = np.random.default_rng(self.seed)
        self.nbytes = self.planes * self.blocks * self.block_tokens * self.heads * self.unit
        self.raw = rng.integers(0, 256, size=self.nbytes + self.offset + 16, dtype=np.uint8)
        self.base = int(self.raw.ctypes.data) + self.offset

    def array(self) -> np.ndarray:
        """(plane, block, token, head, byte) view of the buffer, whatever the layout."""
        flat = self.raw[self.offset:self.offset + self.nbytes]
        if self.layout == "NHD":
            return flat.reshape(self.planes, self.blocks, self.block_tokens, self.heads, self.unit)
        return flat.reshape(self.planes, self.blocks, self.heads, self.block_tokens, self.unit).transpose(0, 1, 3, 2, 4)

    @property
    def strides(self) -> tuple[int, int]:
        if self.layout == "NHD":
            return self.heads * self.unit, self.unit
        return self.unit, self.block_tokens * self.unit

    def address(self, plane: int, block: int, token: int, head: int) -> int:
        ts, hs = self.strides
        block_bytes = self.block_tokens * self.heads * self.unit
        return self.base + (plane * self.blocks + block) * block_bytes + token * ts + head * hs


@dataclass
class Transfer:
    """`n_tokens` logical tokens of every plane, heads [src_head, +heads) of the source to
    [dst_head, +heads) of the destination, through each end's block table."""

    src: Pool
    dst: Pool
    n_tokens: int
    heads: int
    src_head: int
    dst_head: int
    src_table: np.ndarray
    dst_table: np.ndarray

    def segments(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        src_addr, dst_addr, tokens = [], [], []
        for plane in range(self.src.planes):
            p = 0
            while p < self.n_tokens:
                s_off, d_off = p % self.src.block_tokens, p % self.dst.block_tokens
                n = min(self.src.block_tokens - s_off, self.dst.block_tokens - d_off, self.n_tokens - p)
                src_addr.append(self.src.address(plane, int(self.src_table[p // self.src.block_tokens]), s_off,
                                                 self.src_head))
                dst_addr.append(self.dst.address(plane, int(self.dst_table[p // self.dst.block_tokens]), d_off,
                                                 self.dst_head))
                tokens.append(n)
                p += n
        return np.array(src_addr, np.int64), np.array(dst_addr, np.int64), np.array(tokens, np.int64)

    def expected(self) -> bytes:
        src, out = self.src.array(), self.dst.array().copy()
        for p in range(self.n_tokens):
            sb, st = int(self.src_table[p // self.src.block_tokens]), p % self.src.block_tokens
            db, dt = int(self.dst_table[p // self.dst.block_tokens]), p % self.dst.block_tokens
            out[:, db, dt, self.dst_head:self.dst_head + self.heads] = \
                src[:, sb, st, self.src_head:self.src_head + self.heads]
        return out.tobytes()

    def run(self, impl: str, **kw) -> bytes:
        src_addr, dst_addr, tokens = self.segments()
        native.transform_copy(src_addr, dst_addr, tokens, heads=self.heads, unit_bytes=self.src.unit,
                              src_strides=self.src.strides, dst_strides=self.dst.strides, impl=impl, **kw)
        return self.dst.array().tobytes()


def make_transfer(src_layout: str, dst_layout: str, blocks: tuple[int, int], heads: tuple[int, int, int], unit: int,
                  n_tokens: int, seed: int, offsets: tuple[int, int] = (0, 0), planes: int = 3) -> Transfer:
    """heads: (heads moved, heads held at the source, heads held at the destination)."""
    moved, held_src, held_dst = heads
    rng = np.random.default_rng(seed)
    n_src, n_dst = -(-n_tokens // blocks[0]), -(-n_tokens // blocks[1])
    src = Pool(src_layout, planes, n_src + 3, blocks[0], held_src, unit, offsets[0], seed)
    dst = Pool(dst_layout, planes, n_dst + 3, blocks[1], held_dst, unit, offsets[1], seed + 1)
    return Transfer(src, dst, n_tokens, moved, int(rng.integers(0, held_src - moved + 1)),
                    int(rng.integers(0, held_dst - moved + 1)), rng.permutation(src.blocks)[:n_src],
                    rng.permutation(dst.blocks)[:n_dst])


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("src_layout,dst_layout", [("NHD", "NHD"), ("NHD", "HND"), ("HND", "NHD"), ("HND", "HND")])
@pytest.mark.parametrize("blocks,heads", [
    ((16, 16), (4, 4, 4)),   # same geometry: whole segments coalesce where the layouts agree
    ((16, 32), (4, 8, 4)),   # a head slice of the source, larger destination blocks
    ((12, 8), (2, 4, 6)),    # slices at both ends, blocks that do not divide each other
    ((1, 16), (1, 1, 1)),    # one token per source block, one head
])
@pytest.mark.parametrize("unit", [256, 6, 16])  # head_dim 128 fp16, 3 fp16, 8 fp16
def test_layouts_match_the_reference(impl: str, src_layout: str, dst_layout: str, blocks: tuple[int, int],
                                     heads: tuple[int, int, int], unit: int) -> None:
    seed = zlib.crc32(repr((src_layout, dst_layout, blocks, heads, unit)).encode())
    t = make_transfer(src_layout, dst_layout, blocks, heads, unit, n_tokens=37, seed=seed)
    want = t.expected()
    before = t.dst.array().tobytes()
    assert t.run(impl) == want
    assert want != before


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("offsets", [(1, 3), (4, 8), (2, 0)])
def test_unaligned_buffers(impl: str, offsets: tuple[int, int]) -> None:
    t = make_transfer("NHD", "HND", (16, 8), (3, 4, 5), 6, n_tokens=21, seed=7, offsets=offsets)
    want = t.expected()
    assert t.run(impl) == want


@pytest.mark.parametrize("threads", [0, 1, 3, 8])
def test_native_threads_cover_every_segment(threads: int) -> None:
    if not native.info().transform:
        pytest.skip("no native transform")
    # 10 MiB over 16-token blocks of 4 heads x 256 B, some runs split between blocks.
    t = make_transfer("NHD", "HND", (16, 24), (4, 4, 4), 256, n_tokens=1300, seed=3, planes=2)
    want = t.expected()
    assert t.run("native", threads=threads) == want


def test_native_threads_split_one_large_segment() -> None:
    if not native.info().transform:
        pytest.skip("no native transform")
    t = make_transfer("HND", "NHD", (4096, 4096), (2, 2, 3), 512, n_tokens=4000, seed=5, planes=1)
    assert len(t.segments()[2]) == 1
    assert t.run("native", threads=4) == t.expected()


@pytest.mark.parametrize("impl", IMPLS)
def test_many_small_segments(impl: str) -> None:
    """20000 one-token segments: the native check is shared by helper threads past 16384."""
    rng = np.random.default_rng(13)
    src = rng.integers(0, 256, size=20000 * 32, dtype=np.uint8)
    dst = np.zeros(20000 * 48, dtype=np.uint8)
    order = rng.permutation(20000).astype(np.int64)
    src_addr, dst_addr = src.ctypes.data + order * 32, dst.ctypes.data + np.arange(20000, dtype=np.int64) * 48
    tokens = np.ones(20000, np.int64)
    kw = dict(heads=2, unit_bytes=16, src_strides=(32, 16), dst_strides=(48, 24), impl=impl)
    bad = tokens.copy()
    bad[19999] = -3
    with pytest.raises(native.RowCopyError, match=r"tokens\[19999\] = -3 is negative"):
        native.transform_copy(src_addr, dst_addr, bad, **kw)
    assert not dst.any()
    native.transform_copy(src_addr, dst_addr, tokens, **kw)
    want = np.zeros((20000, 48), dtype=np.uint8)
    want[:, :16], want[:, 24:40] = src.reshape(20000, 32)[order, :16], src.reshape(20000, 32)[order, 16:]
    assert dst.tobytes() == want.tobytes()


def test_arbitrary_strides_match_the_formula() -> None:
    """Strides that are no block layout (padding, a zero stride on a source broadcast)."""
    rng = np.random.default_rng(11)
    src = rng.integers(0, 256, size=1 << 16, dtype=np.uint8)
    heads, unit, sts, shs, dts, dhs = 3, 10, 70, 20, 40, 12
    src_off = np.array([0, 1000, 5000, 9000], np.int64)
    dst_off = np.array([0, 2000, 4000, 6000], np.int64)
    tokens = np.array([5, 0, 7, 1], np.int64)
    results = []
    for impl in ("native", "fallback") if native.info().transform else ("fallback",):
        dst = np.zeros(1 << 14, dtype=np.uint8)
        native.transform_copy(src.ctypes.data + src_off, dst.ctypes.data + dst_off, tokens, heads=heads,
                              unit_bytes=unit, src_strides=(sts, shs), dst_strides=(dts, dhs), impl=impl)
        results.append(dst.tobytes())
    want = np.zeros(1 << 14, dtype=np.uint8)
    for so, do, n in zip(src_off.tolist(), dst_off.tolist(), tokens.tolist()):
        for tok in range(n):
            for h in range(heads):
                d, s = do + tok * dts + h * dhs, so + tok * sts + h * shs
                want[d:d + unit] = src[s:s + unit]
    assert results and all(r == want.tobytes() for r in results)


@pytest.mark.parametrize("impl", IMPLS)
def test_empty_calls_copy_nothing(impl: str) -> None:
    buf = np.zeros(64, dtype=np.uint8)
    empty = np.zeros(0, np.int64)
    kw = dict(heads=2, unit_bytes=8, src_strides=(16, 8), dst_strides=(16, 8), impl=impl)
    native.transform_copy(empty, empty, empty, **kw)
    native.transform_copy([], [], [], **kw)
    # A segment with no tokens moves nothing, so its addresses are never looked at.
    native.transform_copy(np.array([0, buf.ctypes.data], np.int64), np.array([0, buf.ctypes.data], np.int64),
                          np.array([0, 0], np.int64), **kw)
    assert not buf.any()


def _refusal(impl: str, seg1_src: int | None = None, seg1_dst: int | None = None, **change) -> str:
    """The message of the refusal of a valid call altered by `change` (seg1_*: segment 1's
    address); the destination must be untouched: segment 0 stays valid, so a check made
    after its copy would show."""
    src = np.arange(256, dtype=np.uint8)
    dst = np.zeros(256, dtype=np.uint8)
    src_addr = np.array([src.ctypes.data, src.ctypes.data + 64], np.int64)
    dst_addr = np.array([dst.ctypes.data, dst.ctypes.data + 64], np.int64)
    if seg1_src is not None:
        src_addr[1] = seg1_src
    if seg1_dst is not None:
        dst_addr[1] = seg1_dst
    call = dict(src_addr=src_addr, dst_addr=dst_addr, tokens=np.array([2, 2], np.int64), heads=2, unit_bytes=16,
                src_strides=(32, 16), dst_strides=(32, 16), impl=impl)
    call.update(change)
    with pytest.raises(native.RowCopyError) as err:
        native.transform_copy(call.pop("src_addr"), call.pop("dst_addr"), call.pop("tokens"), **call)
    assert not dst.any(), "a refused call copied bytes"
    return str(err.value)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("change,words", [
    (dict(tokens=np.array([2, 2, 2], np.int64)), "one entry per segment"),
    (dict(tokens=np.array([2, -1], np.int64)), "tokens[1] = -1 is negative"),
    (dict(tokens=np.array([2.0, 2.0])), "tokens must be a one-dimensional integer array"),
    (dict(src_addr=np.zeros((2, 1), np.int64)), "src_addr must be a one-dimensional integer array"),
    (dict(unit_bytes=0), "unit_bytes must be at least 1, got 0"),
    (dict(heads=0), "heads must be at least 1, got 0"),
    (dict(src_strides=(-32, 16)), "src_token_stride is negative"),
    (dict(dst_strides=(32, -16)), "dst_head_stride is negative"),
    (dict(dst_strides=(32,)), "dst_strides must be (token stride, head stride)"),
    (dict(src_strides=(32.0, 16)), "must be integers"),
    (dict(dst_strides=(32, 8)), "destination heads overlap"),
    (dict(dst_strides=(8, 64)), "destination tokens overlap"),
    (dict(seg1_dst=0), "dst_addr[1] = 0 is not an address"),
    (dict(seg1_src=-5), "src_addr[1] = -5 is not an address"),
    (dict(seg1_src=(1 << 63) - 40), "segment 1's source runs past the end of the address space"),
    (dict(impl="fast"), "impl must be auto, native or fallback"),
])
def test_refusals_are_named_and_copy_nothing(impl: str, change: dict, words: str) -> None:
    assert words in _refusal(**{"impl": impl, **change})


def test_info_reports_the_transform() -> None:
    state = native.info()
    assert state.transform == (state.compiled and hasattr(native._NATIVE, "host_transform_copy"))
    assert state.cuda_transform == (state.transform and state.cuda_usable)


def test_device_transform_without_cuda_is_refused_by_name() -> None:
    if native.info().cuda_usable:
        pytest.skip("CUDA is usable here: tests/gpu/test_native_transform_gpu.py covers it")
    seg = np.array([1 << 20], np.int64)
    kw = dict(heads=1, unit_bytes=16, src_strides=(16, 16), dst_strides=(16, 16), memory=MemoryKind.DEVICE)
    with pytest.raises(native.RowCopyError):
        native.transform_copy(seg, seg + 4096, np.array([1], np.int64), impl="native", **kw)
    with pytest.raises(native.RowCopyError, match="device transform|CUDA"):
        native.transform_copy(seg, seg + 4096, np.array([1], np.int64), impl="fallback", **kw)
