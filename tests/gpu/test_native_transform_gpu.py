"""The CUDA layout-transform kernel and the torch fallback against a torch reference that
indexes the layouts as arrays, on the GPU machine.

Run: ``python -m pytest -q -m gpu tests/gpu/test_native_transform_gpu.py``.
"""

from __future__ import annotations

import mmap
import zlib
from dataclasses import dataclass

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from kvxfer import native  # noqa: E402
from kvxfer.contract import MemoryKind  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(not native.info().cuda_transform,
                       reason=f"kvxfer._native CUDA transform: {native.info().reason or 'not built'}"),
]


@dataclass
class DevPool:
    """Paged KV on the GPU: planes x blocks x (block_tokens x heads x unit bytes), NHD or HND,
    starting `offset` bytes into a random uint8 buffer."""

    layout: str
    planes: int
    blocks: int
    block_tokens: int
    heads: int
    unit: int
    offset: int
    seed: int

    def __post_init__(self) -> None:
        g = torch.Generator().manual_seed(self.seed)
        self.nbytes = self.planes * self.blocks * self.block_tokens * self.heads * self.unit
        self.raw = torch.randint(0, 256, (self.nbytes + self.offset + 64,), dtype=torch.uint8, generator=g).cuda()
        self.base = self.raw.data_ptr() + self.offset

    def array(self, raw: torch.Tensor | None = None) -> torch.Tensor:
        """(plane, block, token, head, byte) view of `raw` (default: the pool's buffer)."""
        flat = (self.raw if raw is None else raw)[self.offset:self.offset + self.nbytes]
        if self.layout == "NHD":
            return flat.view(self.planes, self.blocks, self.block_tokens, self.heads, self.unit)
        return flat.view(self.planes, self.blocks, self.heads, self.block_tokens, self.unit).permute(0, 1, 3, 2, 4)

    @property
    def strides(self) -> tuple[int, int]:
        return (self.heads * self.unit, self.unit) if self.layout == "NHD" else (self.unit, self.block_tokens * self.unit)

    def address(self, plane: int, block: int, token: int, head: int) -> int:
        ts, hs = self.strides
        return self.base + (plane * self.blocks + block) * self.block_tokens * self.heads * self.unit + token * ts + \
            head * hs


class Transfer:
    """n_tokens logical tokens of every plane, `moved` heads from a slice of the source to a
    slice of the destination, through random block tables."""

    def __init__(self, layouts: tuple[str, str], blocks: tuple[int, int], heads: tuple[int, int, int], unit: int,
                 n_tokens: int, planes: int = 3, offsets: tuple[int, int] = (0, 0)) -> None:
        seed = zlib.crc32(repr((layouts, blocks, heads, unit, n_tokens, planes, offsets)).encode())
        rng = np.random.default_rng(seed)
        self.moved, held_src, held_dst = heads
        n_src, n_dst = -(-n_tokens // blocks[0]), -(-n_tokens // blocks[1])
        self.src = DevPool(layouts[0], planes, n_src + 2, blocks[0], held_src, unit, offsets[0], seed)
        self.dst = DevPool(layouts[1], planes, n_dst + 2, blocks[1], held_dst, unit, offsets[1], seed + 1)
        self.n_tokens = n_tokens
        self.src_head = int(rng.integers(0, held_src - self.moved + 1))
        self.dst_head = int(rng.integers(0, held_dst - self.moved + 1))
        self.src_table = rng.permutation(self.src.blocks)[:n_src]
        self.dst_table = rng.permutation(self.dst.blocks)[:n_dst]
        self.initial = self.dst.raw.clone()

    def segments(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        src_addr, dst_addr, tokens = [], [], []
        bs, bd = self.src.block_tokens, self.dst.block_tokens
        for plane in range(self.src.planes):
            p = 0
            while p < self.n_tokens:
                n = min(bs - p % bs, bd - p % bd, self.n_tokens - p)
                src_addr.append(self.src.address(plane, int(self.src_table[p // bs]), p % bs, self.src_head))
                dst_addr.append(self.dst.address(plane, int(self.dst_table[p // bd]), p % bd, self.dst_head))
                tokens.append(n)
                p += n
        return np.array(src_addr, np.int64), np.array(dst_addr, np.int64), np.array(tokens, np.int64)

    def expected(self) -> torch.Tensor:
        out = self.initial.clone()
        p = torch.arange(self.n_tokens)
        bs, bd = self.src.block_tokens, self.dst.block_tokens
        sb, st = torch.from_numpy(self.src_table)[p // bs].cuda(), (p % bs).cuda()
        db, dt = torch.from_numpy(self.dst_table)[p // bd].cuda(), (p % bd).cuda()
        want = self.dst.array(out)
        want[:, db, dt, self.dst_head:self.dst_head + self.moved] = \
            self.src.array()[:, sb, st, self.src_head:self.src_head + self.moved]
        return out

    def run(self, impl: str, stream: torch.cuda.Stream, device: int = 0) -> torch.Tensor:
        self.dst.raw.copy_(self.initial)
        torch.cuda.synchronize()
        src_addr, dst_addr, tokens = self.segments()
        native.transform_copy(src_addr, dst_addr, tokens, heads=self.moved, unit_bytes=self.src.unit,
                              src_strides=self.src.strides, dst_strides=self.dst.strides, memory=MemoryKind.DEVICE,
                              device=device, stream=stream.cuda_stream, impl=impl)
        stream.synchronize()
        return self.dst.raw.clone()


LAYOUTS = [("NHD", "NHD"), ("NHD", "HND"), ("HND", "NHD"), ("HND", "HND")]


@pytest.mark.parametrize("layouts", LAYOUTS, ids="->".join)
@pytest.mark.parametrize("blocks,heads", [((16, 16), (4, 4, 4)), ((16, 32), (4, 8, 4)), ((12, 8), (2, 4, 6)),
                                          ((1, 16), (1, 1, 1))])
@pytest.mark.parametrize("unit", [256, 128, 16, 6, 4])  # head_dim 128, 64, 8, 3, 2 in fp16
@pytest.mark.parametrize("n_tokens", [37, 600])  # segments in the launch parameters, and staged
def test_kernel_matches_fallback_and_reference(layouts: tuple[str, str], blocks: tuple[int, int],
                                               heads: tuple[int, int, int], unit: int, n_tokens: int) -> None:
    t = Transfer(layouts, blocks, heads, unit, n_tokens)
    want = t.expected()
    assert not torch.equal(want, t.initial)
    stream = torch.cuda.Stream()
    assert torch.equal(t.run("native", stream), want)
    assert torch.equal(t.run("fallback", stream), want)


@pytest.mark.parametrize("layouts", LAYOUTS, ids="->".join)
@pytest.mark.parametrize("offsets", [(2, 6), (1, 3), (8, 4)])  # 2-, 1- and 4-byte vectors
def test_unaligned_pools(layouts: tuple[str, str], offsets: tuple[int, int]) -> None:
    t = Transfer(layouts, (16, 8), (3, 4, 5), 6, 45, offsets=offsets)
    want = t.expected()
    stream = torch.cuda.Stream()
    assert torch.equal(t.run("native", stream), want)
    assert torch.equal(t.run("fallback", stream), want)


@pytest.mark.parametrize("layouts", LAYOUTS, ids="->".join)
def test_large_calls(layouts: tuple[str, str]) -> None:
    """16 MiB in 16-token blocks (4-vector chunks, many blocks), and one 8 MiB segment."""
    stream = torch.cuda.Stream()
    for t in (Transfer(layouts, (16, 16), (4, 4, 4), 256, 4096, planes=4),
              Transfer(layouts, (8192, 8192), (8, 8, 8), 128, 8192, planes=1)):
        assert torch.equal(t.run("native", stream), t.expected())


@pytest.mark.parametrize("n", [128, 129, 1280, 1281, 5000])  # launch-parameter tiers, then staging
def test_segment_count_tiers(n: int) -> None:
    """One segment per token (one-token source blocks): every tier of how segments reach the kernel."""
    t = Transfer(("NHD", "HND"), (1, 8), (2, 2, 3), 16, n, planes=1)
    assert len(t.segments()[2]) == n
    stream = torch.cuda.Stream()
    assert torch.equal(t.run("native", stream), t.expected())


@pytest.mark.parametrize("big", [20000, 1 << 18])
@pytest.mark.parametrize("heads,unit", [(2, 64), (1, 4)])  # 4-vector units, and one 4-byte vector
def test_segments_of_very_different_sizes(big: int, heads: int, unit: int) -> None:
    """One large segment among many one-token ones: the host cuts it before launching."""
    tokens = np.array([1] * 700 + [big] + [3] * 300, np.int64)
    offsets = np.concatenate([[0], np.cumsum(tokens)[:-1]]) * heads * unit
    total = int(tokens.sum()) * heads * unit
    src = torch.randint(0, 256, (total,), dtype=torch.uint8, device="cuda")
    dst = torch.zeros(total + 4096, dtype=torch.uint8, device="cuda")
    order = np.random.default_rng(big).permutation(tokens.size)
    dst_offsets = np.concatenate([[0], np.cumsum(tokens[order])[:-1]]) * heads * unit
    dst_at = np.empty_like(dst_offsets)
    dst_at[order] = dst_offsets
    native.transform_copy(src.data_ptr() + offsets, dst.data_ptr() + 4096 + dst_at, tokens, heads=heads,
                          unit_bytes=unit, src_strides=(heads * unit, unit), dst_strides=(heads * unit, unit),
                          memory=MemoryKind.DEVICE)
    torch.cuda.synchronize()
    want = torch.zeros_like(dst)
    for i in order.tolist():
        n = int(tokens[i]) * heads * unit
        want[4096 + int(dst_at[i]):4096 + int(dst_at[i]) + n] = src[int(offsets[i]):int(offsets[i]) + n]
    assert torch.equal(dst, want)


def test_default_stream_and_current_device() -> None:
    t = Transfer(("NHD", "HND"), (16, 16), (4, 4, 4), 256, 100)
    want = t.expected()
    src_addr, dst_addr, tokens = t.segments()
    t.dst.raw.copy_(t.initial)
    torch.cuda.synchronize()
    native.transform_copy(src_addr, dst_addr, tokens, heads=4, unit_bytes=256, src_strides=t.src.strides,
                          dst_strides=t.dst.strides, memory=MemoryKind.DEVICE)
    torch.cuda.synchronize()
    assert torch.equal(t.dst.raw, want)


@pytest.mark.parametrize("impl", ["native", "fallback"])
def test_empty_calls_queue_nothing(impl: str) -> None:
    buf = torch.zeros(256, dtype=torch.uint8, device="cuda")
    stream = torch.cuda.Stream()
    kw = dict(heads=2, unit_bytes=16, src_strides=(32, 16), dst_strides=(32, 16), memory=MemoryKind.DEVICE,
              stream=stream.cuda_stream, impl=impl)
    native.transform_copy(np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64), **kw)
    addr = np.array([0, buf.data_ptr()], np.int64)
    native.transform_copy(addr, addr, np.zeros(2, np.int64), **kw)
    stream.synchronize()
    assert not buf.any()


def test_refusal_on_device_copies_nothing() -> None:
    src = torch.arange(256, dtype=torch.int32, device="cuda").to(torch.uint8)
    dst = torch.zeros(256, dtype=torch.uint8, device="cuda")
    with pytest.raises(native.RowCopyError, match=r"tokens\[1\] = -1 is negative"):
        native.transform_copy(np.array([src.data_ptr()] * 2, np.int64), np.array([dst.data_ptr()] * 2, np.int64),
                              np.array([2, -1], np.int64), heads=2, unit_bytes=16, src_strides=(32, 16),
                              dst_strides=(32, 16), memory=MemoryKind.DEVICE)
    torch.cuda.synchronize()
    assert not dst.any()


def test_then_rings_the_doorbell_and_records_the_event() -> None:
    """The IPC backend's entry: kernel, doorbell store and event in one call on its stream."""
    mod = native.cuda_module()
    t = Transfer(("HND", "NHD"), (16, 16), (4, 8, 4), 256, 64)
    want = t.expected()
    src_addr, dst_addr, tokens = t.segments()
    page = mmap.mmap(-1, mmap.PAGESIZE)
    words = np.frombuffer(page, dtype=np.uint64)
    host = words.ctypes.data
    bell = mod.host_register(0, host, mmap.PAGESIZE)
    stream = mod.stream_create(0)
    event = mod.event_create(0)
    try:
        t.dst.raw.copy_(t.initial)
        torch.cuda.synchronize()
        bell_err, event_err = mod.cuda_transform_copy_then(
            src_addr, dst_addr, tokens, 4, 256, *t.src.strides, *t.dst.strides, stream, 0, bell + 8, 77, event)
        assert (bell_err, event_err) == ("", "")
        mod.event_synchronize(event)
        assert int(words[1]) == 77
        assert torch.equal(t.dst.raw, want)
    finally:
        mod.stream_synchronize(stream)
        mod.event_destroy(event)
        mod.stream_destroy(stream)
        mod.host_unregister(0, host)
        del words
        page.close()
