"""`kvxfer pair` with the prefill worker on cuda:0 and the decode worker on cuda:1: every
completion token-identical to colocated generation, bytes moved across the GPUs, each worker
announcing the device its pool is really on. Needs two CUDA devices; skipped cleanly
elsewhere. Run on the two-GPU machine:
``python -m pytest -q -m gpu tests/gpu/test_pair_two_gpus.py``.
"""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2,
                       reason=f"needs two CUDA devices (torch sees {torch.cuda.device_count()})"),
]

from kvxfer import native  # noqa: E402
from kvxfer.engine import LlamaModel, ModelConfig  # noqa: E402
from kvxfer.worker.core import Worker, WorkerConfig  # noqa: E402

REQUESTS = 6
NEW_TOKENS = 8
CFG = ModelConfig(vocab_size=128, hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, intermediate=96,
                  block_tokens=4)


def _require(backend: str) -> None:
    if backend == "ipc" and not native.info().cuda_usable:
        pytest.skip(f"kvxfer._native CUDA: {native.info().reason}")
    if backend == "nixl":
        try:
            import nixl._api  # noqa: F401, PLC0415
        except Exception as exc:  # the wheel raises ImportError or OSError on a broken install
            pytest.skip(f"nixl does not import: {exc}")


def _counter(text: str, name: str) -> float:
    match = re.search(rf"^{name} (\S+)$", text, re.MULTILINE)
    assert match is not None, f"{name} missing from the metrics"
    return float(match.group(1))


# nixl pull: the lane probe runs on the workers' two GPUs, where READ has a fast lane (on one
# GPU it is TCP and the pair would be routed to push: config["mode"] would say so).
@pytest.mark.parametrize(("backend", "mode"), [("ipc", "push"), ("ipc", "pull"), ("nixl", "push"), ("nixl", "pull")],
                         ids=lambda v: str(v))
def test_pair_prefill_on_cuda0_decode_on_cuda1_token_identical(backend: str, mode: str, tmp_path: Path) -> None:
    _require(backend)
    report_path, logs = tmp_path / "report.json", tmp_path / "logs"
    proc = subprocess.run(
        [sys.executable, "-m", "kvxfer.cli", "pair", "--requests", str(REQUESTS), "--min-len", "3", "--max-len",
         "64", "--max-new-tokens", str(NEW_TOKENS), "--prefill-device", "cuda:0", "--decode-device", "cuda:1",
         "--backend", backend, "--mode", mode, "--json", str(report_path), "--log-dir", str(logs), "--quiet"],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(report_path.read_text())
    config = report["config"]
    assert (config["prefill_device"], config["decode_device"], config["mode"]) == ("cuda:0", "cuda:1", mode)
    announced = {p["name"]: p.get("device") for p in config["processes"]}
    assert announced["prefill0"] == "cuda:0" and announced["decode0"] == "cuda:1"
    assert "prefill on cuda:0, decode on cuda:1" in proc.stdout
    assert report["requests"] == report["matched"] == REQUESTS and report["failed"] == 0
    assert all(r["tokens"] == r["expected"] and len(r["tokens"]) == NEW_TOKENS for r in report["results"])
    assert all(r["transfer"]["status"] == "delivered" for r in report["results"])
    assert report["transfers"] == REQUESTS and report["rows"] > 0 and report["transfer_bytes"] > 0
    decode = (logs / "decode0.metrics").read_text()
    assert f'kvxfer_transfers_total{{status="delivered"}} {REQUESTS + 1}.0\n' in decode  # + the warm-up
    assert _counter(decode, "kvxfer_transfer_bytes_total") >= report["transfer_bytes"]
    assert _counter((logs / "prefill0.metrics").read_text(), "kvxfer_transfer_bytes_total") > 0
    assert "kvxfer_open_leases 0.0\n" in decode and "kvxfer_quarantined_slots 0.0\n" in decode


def test_worker_on_cuda1_runs_its_ipc_backend_and_engine_thread_there() -> None:
    """The backend used to be made for device 0 whatever the pool's: register refused the pool."""
    _require("ipc")

    async def main() -> tuple[int, int, str]:
        worker = Worker(WorkerConfig(role="decode", model=CFG, num_blocks=16, backend="ipc", device="cuda:1",
                                     name="d1"))
        await worker.start()
        try:
            assert worker.backend is not None and worker.pool is not None
            engine_device = await worker._run(torch.cuda.current_device)
            return worker.backend.device, engine_device, str(worker.pool.storage(CFG.group_spec().name).device)
        finally:
            await worker.close()

    assert asyncio.run(main()) == (1, 1, "cuda:1")


def test_worker_refuses_a_model_on_another_gpu_than_its_pool() -> None:
    with pytest.raises(ValueError, match="model on cuda:0, pool on cuda:1"):
        Worker(WorkerConfig(role="decode", model=CFG, num_blocks=16, backend="loopback", device="cuda:1"),
               model=LlamaModel(CFG, device="cuda:0"))
