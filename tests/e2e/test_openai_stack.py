"""The README's OpenAI quick start, as separate processes: two ``kvxfer serve --model smollm2``
workers (NIXL between them), ``kvxfer router`` in front with no --model (it learns the
model, and loads its tokenizer, from the workers), and the official ``openai`` client."""

from __future__ import annotations

import json
import os
import urllib.request
from pathlib import Path

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvxfer.worker.procs import ProcessGroup

CHAT = [{"role": "user", "content": "What is the capital of France?"}]


def test_the_openai_client_talks_to_a_router_in_front_of_real_workers(tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with ProcessGroup(tmp_path) as group:
        workers = [group.start(role, ["serve", "--role", role, "--model", "smollm2", "--port", "0", "--blocks", "128"],
                               env) for role in ("prefill", "decode")]
        group.wait_ready(workers, timeout=180)
        router = group.start("router", ["router", "--port", "0", "--prefill", workers[0].url, "--decode",
                                        workers[1].url, "--log-level", "INFO"], env)
        group.wait_ready([router], timeout=60)
        client = openai.OpenAI(base_url=f"{router.url}/v1", api_key="unused", max_retries=0, timeout=120)
        try:
            assert [m.id for m in client.models.list().data] == ["smollm2"]
            done = client.chat.completions.create(model="smollm2", messages=CHAT, max_tokens=24)  # type: ignore[arg-type]
            text = done.choices[0].message.content or ""
            assert "Paris" in text and done.choices[0].finish_reason == "stop", done
            streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
                model="smollm2", messages=CHAT, max_tokens=24, stream=True) if c.choices)  # type: ignore[arg-type]
            assert streamed == text
            completion = client.completions.create(model="smollm2", prompt="The capital of France is", max_tokens=4)
            assert completion.choices[0].text.startswith(" Paris"), completion
            card = client.models.retrieve("smollm2")
            with urllib.request.urlopen(f"{workers[1].url}/health", timeout=10) as answer:
                positions = json.loads(answer.read())["limits"]["max_positions"]
            assert card.model_extra is not None and card.model_extra["max_model_len"] == positions > 0, card
            with pytest.raises(openai.BadRequestError):
                client.completions.create(model="smollm2", prompt="x", max_tokens=1, extra_body={"bogus": 1})
            # vLLM's series count what was asked: the chat twice (the same tokens streamed), the completion once.
            assert done.usage is not None and completion.usage is not None
            metrics = _samples(f"{router.url}/metrics")
            model = (("model_name", "smollm2"),)
            assert metrics[("vllm:prompt_tokens_total", model)] == 2 * done.usage.prompt_tokens + \
                completion.usage.prompt_tokens
            assert metrics[("vllm:generation_tokens_total", model)] == 2 * done.usage.completion_tokens + \
                completion.usage.completion_tokens
            assert metrics[("vllm:e2e_request_latency_seconds_count", model)] == 3
            prefill = _samples(f"{workers[0].url}/metrics")  # NIXL moved each request's KV once
            assert prefill[("vllm:nixl_xfer_time_seconds_count", model)] == 3
            assert prefill[("vllm:nixl_bytes_transferred_sum", model)] == prefill[("kvxfer_transfer_bytes_total", ())]
        finally:
            client.close()
        log = (tmp_path / "router.log").read_text()
        assert "POST /v1/chat/completions 200" in log, log[-2000:]  # the access log at INFO
        assert "POST /v1/completions 400 " in log and "s: unknown field 'bogus'" in log, log[-2000:]  # and why
        codes = group.stop()
    assert codes == {"router": 0, "decode": 0, "prefill": 0}, codes


def _samples(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(url, timeout=10) as answer:
        text = answer.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}
