"""NixlBackend over VRAM between two processes (push): the conformance kit, byte-exact
scattered rows, and GB/s for 64 KiB rows with and without coalescing. Needs CUDA and a
NIXL built with it; skipped cleanly elsewhere. Run on the GPU machine with ``-s`` to see
the figures (they are printed, and the doctor's lanes are checked for a TCP read lane)."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from kvxfer.contract import TransferMode

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.gpu

from kvxfer.testing.conformance import CHECKS  # noqa: E402
from kvxfer.testing.nixl_pairs import ChildPairs, push_rows_throughput  # noqa: E402
from kvxfer.testing.subprocess_peer import live_children  # noqa: E402


@pytest.fixture(scope="module")
def device_pairs() -> Iterator[ChildPairs]:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    yield from ChildPairs.kept(memory_kind="device")


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
def test_nixl_vram_push_conformance_two_processes(check, device_pairs):  # type: ignore[no-untyped-def]
    check(device_pairs, TransferMode.PUSH)


def test_nixl_vram_push_64k_rows_with_and_without_coalescing() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    # The module's kit fixture keeps its own child alive until teardown: only ours must be gone.
    before = set(live_children())
    figures = {
        "coalesced_runs16": push_rows_throughput("device", coalesce=True, run=16),
        "per_row_runs16": push_rows_throughput("device", coalesce=False, run=16),
        "scattered": push_rows_throughput("device", coalesce=True, run=1),
    }
    print("\nNIXL VRAM push, 4096 x 64 KiB rows, two processes:\n" + json.dumps(figures, indent=2))
    assert all(f["best_gbps"] > 0 for f in figures.values())
    assert set(live_children()) <= before


def test_nixl_vram_push_posts_from_publish_by_default() -> None:
    """Device memory on both ends: publish() posts the push's first chunks itself (post_inline
    None), the bytes land exactly (push_rows_throughput compares them); with post_inline=False
    the progress thread posts every chunk."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    before = set(live_children())
    # 4 warm-up and timed pushes of 2,048 contiguous 64 KiB rows (128 MiB): one chunk each.
    inline = push_rows_throughput("device", rows=2048, run=2048, reps=3)
    queued = push_rows_throughput("device", rows=2048, run=2048, reps=3, post_inline=False)
    print(f"\nNIXL VRAM push, 128 MiB contiguous: posted from publish() {inline['best_gbps']:.1f} GB/s, "
          f"by the progress thread {queued['best_gbps']:.1f} GB/s")
    assert inline["chunks_posted_inline"] == 4 and queued["chunks_posted_inline"] == 0
    assert set(live_children()) <= before


def test_doctor_on_the_gpu_machine(tmp_path) -> None:  # type: ignore[no-untyped-def]
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from kvxfer.doctor import main

    path = tmp_path / "doctor.json"
    assert main(["--bytes", str(256 << 20), "--reps", "3", "--json", str(path)]) == 0
    report = json.loads(path.read_text())
    device = report["memory"]["device"]
    print("\ndoctor device lanes:", device["lanes"], "\nwarnings:", report["warnings"])
    assert device["lanes"]["push"], "UCX printed no put table for device memory"
    tcp_lanes = [lane for lane, t in device["lanes"].items() if any(x.startswith("tcp") for x in t)]
    assert all(any(lane.upper() in w and "TCP" in w for w in report["warnings"]) for lane in tcp_lanes)
