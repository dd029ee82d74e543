"""Row integrity over device memory for the movers whose bytes pass through no kvxfer kernel
(NIXL, ucx): the CUDA digest (native/cuda_digest.cu) equals the host definition, and rows
damaged where they landed in VRAM are False, clean ones exact, between two processes."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from kvxfer import native
from kvxfer.backends.common.integrity import DIGEST_K, numpy_row_digests, region_digests
from kvxfer.contract import MemoryKind, TransferMode
from kvxfer.testing.corruption import Corruptor, check_corrupted_fetches, corrupting

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.gpu

if not torch.cuda.is_available() or not native.has_device_digests():
    pytest.skip("needs CUDA and kvxfer._native built with its CUDA digest", allow_module_level=True)

from kvxfer.testing.nixl_pairs import DeviceRows  # noqa: E402


@pytest.mark.parametrize("row_bytes", [16, 100, 4096, 65536, 2 << 20 | 8])
def test_the_cuda_digest_equals_the_host_definition(row_bytes: int) -> None:
    """Whole 16-byte vectors and not, small and large rows, slots scattered and repeated."""
    rows = max(8, min(64, (32 << 20) // row_bytes))
    memory = DeviceRows((("d", row_bytes, rows),))
    rng = np.random.default_rng(row_bytes)
    data = rng.integers(0, 256, size=(rows, row_bytes), dtype=np.uint8)
    memory.write("d", np.arange(rows, dtype=np.int64), data.tobytes())
    slots = np.concatenate([rng.permutation(rows), [0, 0, rows - 1]]).astype(np.int64)
    got = region_digests(memory.regions[0], slots)
    host = numpy_row_digests(data.ctypes.data, row_bytes, slots)
    assert got.dtype == np.uint64 and got.tolist() == host.tolist()
    flipped = data.copy()
    flipped[3, row_bytes // 2] ^= 0x10
    memory.write("d", np.array([3], dtype=np.int64), flipped[3].tobytes())
    again = native.device_row_digests(base=memory.regions[0].address, stride=row_bytes,
                                      slots=np.array([3], dtype=np.int64), row_bytes=row_bytes, k=DIGEST_K, device=0)
    assert int(again[0]) != int(host[slots.tolist().index(3)])


def test_a_negative_slot_is_refused_by_name() -> None:
    memory = DeviceRows((("d", 64, 4),))
    with pytest.raises(native.RowCopyError, match="negative"):
        native.device_row_digests(base=memory.regions[0].address, stride=64, slots=np.array([1, -1], dtype=np.int64),
                                  row_bytes=64, k=DIGEST_K, device=0)


CORRUPT = Corruptor(seed=31, p_bit=0.1, p_row=0.1)


@pytest.fixture(scope="module")
def nixl_pairs() -> Iterator[object]:
    pytest.importorskip("nixl")
    from kvxfer.testing.nixl_pairs import ChildPairs, make_backend  # noqa: PLC0415

    yield from corrupting(ChildPairs, make_backend, CORRUPT).kept(memory_kind="device", deadline_s=20.0)


@pytest.mark.parametrize("mode", list(TransferMode), ids=lambda m: m.value)
def test_nixl_vram_rows_damaged_where_they_landed_are_false_and_clean_ones_exact(nixl_pairs, mode) -> None:  # type: ignore[no-untyped-def]
    check_corrupted_fetches(nixl_pairs, mode, 3, CORRUPT)


def test_nixl_packed_vram_push_rows_damaged_where_they_landed_are_false() -> None:
    """Not a second module fixture: one's teardown would find the other's child running."""
    pytest.importorskip("nixl")
    from kvxfer.testing.nixl_pairs import ChildPairs, make_backend  # noqa: PLC0415

    pairs = corrupting(ChildPairs, make_backend, CORRUPT)(memory_kind="device", deadline_s=20.0, packed="always",
                                                          arena_bytes=8 << 20, packed_chunk_bytes=1 << 20)
    try:
        check_corrupted_fetches(pairs, TransferMode.PUSH, 3, CORRUPT)
    finally:
        pairs.close()


@pytest.mark.parametrize("mode", list(TransferMode), ids=lambda m: m.value)
def test_ucx_vram_rows_damaged_where_they_landed_are_false_and_clean_ones_exact(mode: TransferMode) -> None:
    from kvxfer.backends.ucx.transport import ucxx_unavailable  # noqa: PLC0415

    if (missing := ucxx_unavailable()) is not None:
        pytest.skip(missing)
    from kvxfer.backends.ucx import UcxBackend  # noqa: PLC0415
    from kvxfer.testing.ucx_pairs import ChildPairs, make_backend  # noqa: PLC0415

    probe = UcxBackend()
    reach = probe.capabilities.memory_kinds
    probe.shutdown()
    if MemoryKind.DEVICE not in reach:
        pytest.skip("this ucxx has no CUDA support")
    pairs = corrupting(ChildPairs, make_backend, CORRUPT)(memory_kind="device", deadline_s=20.0)
    try:
        check_corrupted_fetches(pairs, mode, 2, CORRUPT)
    finally:
        pairs.close()
