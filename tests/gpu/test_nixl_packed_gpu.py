"""The packed NIXL path over VRAM: the arena in device memory, gather and scatter by the row
kernel on the backend's own stream. The conformance kit with packing forced on (two
processes), byte-exact packed pushes chosen by ``packed="auto"`` (device default: 64
descriptors per chunk), fault masks, slot reuse through a small arena, and the GB/s of
packed against one descriptor per row. Needs CUDA and a NIXL built with it; skipped cleanly
elsewhere. Run on the GPU machine with ``-s`` to see the figures."""

from __future__ import annotations

import json
from collections.abc import Iterator

import numpy as np
import pytest

from kvxfer.contract import CacheKind, Delivered, Failed, LayerGroupRows, MemoryKind, TokenRange, TransferMode, View

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.gpu

from kvxfer.backends.nixl import NixlBackend  # noqa: E402
from kvxfer.backends.nixl.packed import ArenaInfo  # noqa: E402
from kvxfer.testing.conformance import CHECKS  # noqa: E402
from kvxfer.testing.nixl_pairs import ChildPairs, DeviceRows, push_rows_throughput  # noqa: E402
from kvxfer.testing.subprocess_peer import live_children  # noqa: E402


def _need_cuda() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")


@pytest.fixture(scope="module")
def packed_device_pairs() -> Iterator[ChildPairs]:
    _need_cuda()
    yield from ChildPairs.kept(memory_kind="device", packed="always", arena_bytes=8 << 20, packed_chunk_bytes=1 << 20)


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
def test_packed_vram_push_conformance_two_processes(check, packed_device_pairs):  # type: ignore[no-untyped-def]
    check(packed_device_pairs, TransferMode.PUSH)


@pytest.fixture
def ends() -> Iterator[list[tuple[NixlBackend, DeviceRows]]]:
    _need_cuda()
    made: list[tuple[NixlBackend, DeviceRows]] = []
    yield made
    for backend, _ in made:
        assert backend.shutdown() == frozenset()


def _end(made: list[tuple[NixlBackend, DeviceRows]], name: str, **options: object) -> tuple[NixlBackend, DeviceRows]:
    memory = DeviceRows(((f"{name}0", 4096, 1024), (f"{name}1", 2048, 1024)))
    backend = NixlBackend(mode=TransferMode.PUSH, **options)  # type: ignore[arg-type]
    if MemoryKind.DEVICE not in backend.capabilities.memory_kinds:
        backend.shutdown()
        pytest.skip("this NIXL cannot reach device memory")
    backend.register(memory.regions)
    made.append((backend, memory))
    return backend, memory


def _views(pmem: DeviceRows, fmem: DeviceRows, request: str, rows: int, seed: int,
           held: int = 0) -> tuple[View, View]:
    rng = np.random.default_rng(seed)
    out = []
    for memory, skip in ((pmem, 0), (fmem, held)):
        groups = tuple(LayerGroupRows(f"g{i}", CacheKind.PAGED, r,
                                      rng.permutation(r.slots)[:rows][skip:].astype(np.int64),
                                      np.arange(skip, rows, dtype=np.int64)) for i, r in enumerate(memory.regions))
        out.append(View(request, TokenRange(0, rows * 16), groups, b"L"))
    return out[0], out[1]


def _payload(memory: DeviceRows, view: View, seed: int) -> dict[str, bytes]:
    rng = np.random.default_rng(seed)
    data = {}
    for g in view.groups:
        data[g.layer_group] = rng.integers(0, 256, len(g) * g.region.slot_bytes, dtype=np.uint8).tobytes()
        memory.write(g.region.name, g.slots, data[g.layer_group])
    return data


def _push(pub: NixlBackend, pview: View, fet: NixlBackend, fview: View):  # type: ignore[no-untyped-def]
    fhint = fet.describe(fview)
    waiting = fet.fetch(fview, pub.describe(pview))
    sending = pub.publish(pview, fhint)
    assert sending.wait(30.0) and waiting.wait(30.0)
    return sending, waiting, sending.poll(), waiting.poll()


def test_auto_packs_scattered_vram_rows_byte_exact_with_prefix_held(ends) -> None:  # type: ignore[no-untyped-def]
    pub, pmem = _end(ends, "P")  # defaults: packed="auto", device floor 64 descriptors per chunk
    fet, fmem = _end(ends, "F")
    info = ArenaInfo.of(fet.describe(_views(pmem, fmem, "probe", 4, 0)[1]))
    assert info is not None and info.memory_kind is MemoryKind.DEVICE
    held, rows = 100, 600
    pview, fview = _views(pmem, fmem, "auto", rows, 1, held=held)
    payload = _payload(pmem, pview, 2)
    sending, waiting, mine, theirs = _push(pub, pview, fet, fview)
    assert isinstance(theirs, Delivered) and theirs.all_delivered, theirs
    assert pub.path_of(sending) == "packed" and fet.path_of(waiting) == "packed"
    for pg, fg in zip(pview.groups, fview.groups):
        size = fg.region.slot_bytes
        assert fmem.read(fg.region.name, fg.slots) == payload[pg.layer_group][held * size:]
    assert fet.stats().bytes_scattered == (rows - held) * (4096 + 2048)


def test_fault_mid_way_vram_masks_exact(ends) -> None:  # type: ignore[no-untyped-def]
    pub, pmem = _end(ends, "P", packed="always", packed_chunk_bytes=64 << 10, arena_bytes=1 << 20,
                     fail_after_rows=37)
    fet, fmem = _end(ends, "F", packed="always", packed_chunk_bytes=64 << 10, arena_bytes=1 << 20)
    pview, fview = _views(pmem, fmem, "fault", 100, 3)
    payload = _payload(pmem, pview, 4)
    _, _, mine, theirs = _push(pub, pview, fet, fview)
    for outcome in (mine, theirs):
        assert isinstance(outcome, Failed) and outcome.rows_delivered == 37, outcome
        assert outcome.masks[0][:37].all() and not outcome.masks[1].any()
    g = fview.groups[0]
    assert fmem.read(g.region.name, g.slots[:37]) == payload["g0"][: 37 * 4096]


def test_small_vram_arena_reuses_slots_bytes_exact(ends) -> None:  # type: ignore[no-untyped-def]
    opts = {"packed": "always", "packed_chunk_bytes": 16 << 10, "arena_bytes": 64 << 10}
    pub, pmem = _end(ends, "P", **opts)
    fet, fmem = _end(ends, "F", **opts)
    pview, fview = _views(pmem, fmem, "credits", 512, 5)
    payload = _payload(pmem, pview, 6)
    _, _, _, theirs = _push(pub, pview, fet, fview)
    assert isinstance(theirs, Delivered) and theirs.all_delivered
    for pg, fg in zip(pview.groups, fview.groups):
        assert fmem.read(fg.region.name, fg.slots) == payload[pg.layer_group]
    assert fet.stats().chunks_scattered == 512 // 4 + 512 // 8  # two landing slots, reused ~100 times each


def test_packed_vs_per_row_vram_64k_rows() -> None:
    _need_cuda()
    # The module's kit fixture keeps its own child alive until teardown: only ours must be gone.
    before = set(live_children())
    figures = {
        "packed": push_rows_throughput("device", run=1, packed="always"),
        "per_row": push_rows_throughput("device", run=1, packed="never"),
    }
    figures["packed_over_per_row"] = figures["packed"]["best_gbps"] / figures["per_row"]["best_gbps"]
    print("\nNIXL VRAM push, 4096 scattered x 64 KiB rows, two processes:\n" + json.dumps(figures, indent=2))
    assert figures["packed_over_per_row"] > 1.0, "packing did not beat one descriptor per row on the GPU"
    assert set(live_children()) <= before
