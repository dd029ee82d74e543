"""Prefill on one GPU, decode on another (issue 8): the IPC backend over peer access and
NixlBackend over VRAM across devices, each end in its own process; the conformance kit,
byte-exact scattered rows both ways, and the bench's peer-copy reference. Needs two CUDA
devices; skipped cleanly elsewhere. Run on the two-GPU machine:
``python -m pytest -q -m gpu tests/gpu/test_two_gpus.py``.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvxfer import native
from kvxfer.contract import TransferMode
from kvxfer.testing.conformance import CHECKS

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(native.info().device_count < 2,
                       reason=f"needs two CUDA devices (kvxfer._native sees {native.info().device_count}"
                              f"{': ' + native.info().reason if native.info().reason else ''})"),
]

from kvxfer.testing.ipc_pairs import ipc_pair  # noqa: E402
from kvxfer.testing.ipc_scenarios import large_rows_byte_exact  # noqa: E402
from kvxfer.testing.subprocess_peer import live_children  # noqa: E402


@pytest.mark.parametrize("mode", list(TransferMode), ids=lambda m: m.value)
@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
def test_ipc_conformance_across_two_gpus(check, mode):  # type: ignore[no-untyped-def]
    check(functools.partial(ipc_pair, device=0, peer_device=1), mode)


@pytest.mark.parametrize("mode", list(TransferMode), ids=lambda m: m.value)
def test_ipc_busy_poll_across_two_gpus_keeps_the_contract(mode: TransferMode) -> None:
    # The doorbell word lives in host memory: the kernel on the other GPU stores it too.
    for check in CHECKS:
        check(functools.partial(ipc_pair, device=0, peer_device=1, busy_poll=True), mode)


@pytest.mark.parametrize("devices", [(0, 1), (1, 0)], ids=lambda d: f"cuda{d[0]}-cuda{d[1]}")
@pytest.mark.parametrize("mode", list(TransferMode), ids=lambda m: m.value)
def test_ipc_large_scattered_rows_byte_exact_across_gpus(mode: TransferMode, devices: tuple[int, int]) -> None:
    large_rows_byte_exact(mode, cuda=None, row_bytes=64 * 1024, slots=600, rows=512, devices=devices)


@pytest.fixture(scope="module")
def nixl_pairs() -> Iterator[object]:
    pytest.importorskip("torch")
    try:
        import nixl._api  # noqa: F401
    except Exception as exc:  # the wheel raises ImportError or OSError on a broken install
        pytest.skip(f"nixl does not import: {exc}")
    from kvxfer.testing.nixl_pairs import ChildPairs

    yield from ChildPairs.kept(memory_kind="device", devices=(0, 1))


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
def test_nixl_vram_push_conformance_across_two_gpus(check, nixl_pairs):  # type: ignore[no-untyped-def]
    check(nixl_pairs, TransferMode.PUSH)


def test_bench_two_gpu_rows_verified_against_the_peer_copy(tmp_path: Path) -> None:
    """A small gpu2 run: the reference is the peer copy cuda:0 -> cuda:1, and the IPC figures
    cross devices with their bytes verified; the JSON says where each end was."""
    from kvxfer.bench.cli import main

    out = tmp_path / "gpu2.json"
    rc = main(["--preset", "gpu2", "--cases", "local_copy,ipc_kernel,ipc", "--row-sizes", "64K",
               "--request-bytes", "32M", "--slots", "scattered", "--no-latency", "--reps", "3", "--warmup", "1",
               "--json", str(out), "--no-progress"])
    assert rc == 0
    result = json.loads(out.read_text())
    assert result["config"]["devices"] == [0, 1]
    by_case = {f["case"]: f for f in result["figures"] if f["mode"] == "throughput"}
    assert {"local_copy", "ipc_kernel", "ipc"} <= set(by_case), sorted(by_case)
    for case, figure in by_case.items():
        assert figure["status"] == "ok", (case, figure.get("reason"))
        assert figure["facts"]["devices"] == [0, 1], (case, figure["facts"])
    assert "peer copy" in by_case["local_copy"]["facts"]["how"]
    assert by_case["ipc"]["facts"]["verified"] and by_case["ipc_kernel"]["facts"]["verified"]
    assert [t for t in result["targets"] if "peer copy" in t["threshold"]], result["targets"]


def test_doctor_probes_the_lanes_between_two_gpus(tmp_path: Path) -> None:
    """``kvxfer doctor --devices 0,1``: the device-memory initiator on cuda:0 and its target on
    cuda:1, said in the report; both lanes have a transport and figures."""
    from kvxfer.doctor import main

    before = set(live_children())
    path = tmp_path / "doctor.json"
    assert main(["--devices", "0,1", "--bytes", str(64 << 20), "--reps", "2", "--json", str(path)]) == 0
    device = json.loads(path.read_text())["memory"]["device"]
    print("\ndoctor lanes between cuda:0 and cuda:1:", device["lanes"])
    assert device["devices"] == [0, 1]
    assert device["lanes"]["push"] and device["lanes"]["pull"], device["lanes"]
    assert all(f["best_gbps"] > 0 for by_size in device["figures"]["lanes"].values() for f in by_size.values())
    assert set(live_children()) <= before


def test_default_streams_of_two_devices_ring_their_own_doorbells() -> None:
    # Stream 0 is each device's own default stream: a small copy that rings a doorbell counts its
    # finished blocks in a counter of its own device. One counter per stream handle alone would
    # have device 1's kernel count into device 0's memory, and alternating devices would leave a
    # stale count that rings early or never.
    import numpy as np
    import torch

    cuda = native.cuda_module()
    rows, row_bytes = 48, 4096
    word = np.zeros(1, dtype=np.uint64)
    word_dev = cuda.host_register(0, word.ctypes.data, 8)  # portable and mapped: one address for both
    try:
        rng = np.random.default_rng(7)
        for round_, device in enumerate([0, 1, 0, 1, 1, 0]):
            with torch.cuda.device(device):
                src = torch.randint(0, 256, (rows * 2 * row_bytes,), dtype=torch.uint8, device=f"cuda:{device}")
                dst = torch.zeros_like(src)
                torch.cuda.synchronize(device)
            s_ix = rng.permutation(rows * 2)[:rows].astype(np.int64)
            d_ix = rng.permutation(rows * 2)[:rows].astype(np.int64)
            word[0] = 0
            bell_err, event_err = cuda.cuda_copy_rows_then(
                src.data_ptr(), row_bytes, s_ix, dst.data_ptr(), row_bytes, d_ix, rows, row_bytes, 0, device,
                word_dev, 500 + round_, 0)  # rows <= 64: the kernel rings the doorbell itself
            assert bell_err == "" and event_err == ""
            cuda.stream_synchronize(0, device)
            assert int(word[0]) == 500 + round_, f"round {round_} on cuda:{device}: doorbell word {int(word[0])}"
            want = src.view(rows * 2, row_bytes)[torch.from_numpy(s_ix).to(src.device)]
            got = dst.view(rows * 2, row_bytes)[torch.from_numpy(d_ix).to(dst.device)]
            assert torch.equal(got, want), f"round {round_} on cuda:{device}: rows differ"
    finally:
        cuda.host_unregister(0, word.ctypes.data)
