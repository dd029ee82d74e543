"""Where a worker runs: ``kvxfer serve --device`` is checked before anything starts, and the
worker hands its pool's device to the backend it makes (an IPC backend serves one GPU)."""

from __future__ import annotations

import asyncio
import os
from typing import Any

import pytest
import torch

from kvxfer.backends.loopback import LoopbackFabric
from kvxfer.engine import ModelConfig
from kvxfer.worker import core, serve
from kvxfer.worker.core import Worker, WorkerConfig

torch.set_num_threads(1)
CFG = ModelConfig(vocab_size=64, hidden=32, layers=1, heads=2, kv_heads=1, head_dim=16, intermediate=64,
                  block_tokens=4)
VISIBLE = torch.cuda.device_count()


def test_resolve_device_names_the_flag_the_index_and_the_visible_count() -> None:
    with pytest.raises(SystemExit) as exc:
        serve.resolve_device("cuda:5" if VISIBLE <= 5 else f"cuda:{VISIBLE}")
    message = str(exc.value.code)
    index = 5 if VISIBLE <= 5 else VISIBLE
    assert message.startswith(f"--device cuda:{index}: CUDA device {index} is not visible")
    assert f"this process sees {VISIBLE} CUDA device" in message


def test_resolve_device_keeps_auto_and_cpu() -> None:
    assert serve.resolve_device("cpu") == "cpu"
    assert serve.resolve_device("auto") == ("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize(("name", "words"), [
    ("cuda:x", "--device cuda:x: not a device; use auto, cpu, cuda or cuda:N"),
    ("meta", "--device meta: KV pools live on cpu or cuda[:N], not meta"),
])
def test_parse_device_refuses_what_a_pool_cannot_live_on(name: str, words: str) -> None:
    with pytest.raises(ValueError) as exc:
        serve.parse_device(name)
    assert str(exc.value) == words


@pytest.mark.skipif(VISIBLE > 0, reason="checks the message of a machine without CUDA")
def test_bare_cuda_without_a_gpu_says_none_is_visible() -> None:
    with pytest.raises(ValueError, match=r"^--device cuda: no CUDA device is visible; this process sees 0 CUDA"):
        serve.check_visible(torch.device("cuda"))


def test_check_visible_names_cuda_visible_devices_when_set(monkeypatch: pytest.MonkeyPatch) -> None:
    # Set to what this process already sees: CUDA, if it starts later, must see the same GPUs.
    same = os.environ.get("CUDA_VISIBLE_DEVICES", ",".join(str(i) for i in range(VISIBLE)))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", same)
    with pytest.raises(ValueError, match="CUDA_VISIBLE_DEVICES="):
        serve.check_visible(torch.device("cuda", 64), "--decode-device")


def test_serve_refuses_an_invisible_device_before_it_starts(capsys: pytest.CaptureFixture[str]) -> None:
    index = max(VISIBLE, 5)
    with pytest.raises(SystemExit) as exc:
        serve.main(["--role", "decode", "--backend", "ipc", "--device", f"cuda:{index}"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "Traceback" not in err
    assert f"--device cuda:{index}: CUDA device {index} is not visible; this process sees {VISIBLE} CUDA" in err


def test_worker_hands_its_pools_device_to_the_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[dict[str, Any]] = []
    real = core.make_backend

    def capture(*args: Any, **kwargs: Any) -> Any:
        seen.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(core, "make_backend", capture)

    async def main() -> str:
        worker = Worker(WorkerConfig(role="decode", model=CFG, num_blocks=16, backend="loopback", device="cpu"),
                        fabric=LoopbackFabric())
        await worker.start()
        try:
            assert worker.pool is not None
            assert seen[0]["device"] == core._cuda_index(worker.pool)
            return worker.device
        finally:
            await worker.close()

    assert asyncio.run(main()) == "cpu"
    assert len(seen) == 1 and seen[0]["device"] == 0  # passed by name: a host pool's answer
