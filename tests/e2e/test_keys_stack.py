"""Keys on the doors, as separate processes: two `kvxfer serve` workers with a cluster key
(one from --cluster-key-file, one from KVXFER_CLUSTER_KEY) and `kvxfer router --api-key-file`
in front, which sends the cluster key it has from its environment. A request with the API key
is served token-identical to colocated generation; without it, or with another, the router
answers 401 in OpenAI's error shape (the official client raises AuthenticationError). A second
router without the cluster key, listening on every interface with no API key, says so at
start, and the workers refuse it: its request fails naming the 401. `kvxfer doctor --peer`
without the key is refused in one line. No log line of any process holds a key."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import openai
import pytest
import torch

from kvxfer.engine import LlamaModel, ModelConfig, colocated_generate
from kvxfer.worker.procs import ProcessGroup

API_KEY = "sk-e2e-api-7f3a9c2e51d04b68"
CLUSTER_KEY = "e2e-cluster-0b1c2d3e4f5a6978"
PROMPT = [5, 17, 99, 3, 42, 8, 61, 7, 23, 11]
NEW = 5


def _http(url: str, method: str = "GET", body: Any = None, key: str | None = None) -> tuple[int, Any]:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=60) as answer:
            text = answer.read().decode()
            status = answer.status
    except urllib.error.HTTPError as exc:
        text, status = exc.read().decode(), exc.code
    lines = [json.loads(line) for line in text.splitlines() if line.strip()]
    return status, lines[-1] if lines else None  # NDJSON: the last event, the completion


def _unauthorized(status: int, answer: Any) -> None:
    assert status == 401, (status, answer)
    assert answer["error"]["type"] == "invalid_request_error" and answer["error"]["code"] == "invalid_api_key"


@pytest.mark.slow  # about 25-35 s on the 2-core machine: two workers, two routers, one doctor
def test_keys_guard_the_router_and_the_workers(tmp_path: Path) -> None:
    torch.set_num_threads(1)
    (tmp_path / "cluster.key").write_text(CLUSTER_KEY + "\n")
    (tmp_path / "api.key").write_text(API_KEY)
    base = {k: v for k, v in os.environ.items() if k not in ("KVXFER_API_KEY", "KVXFER_CLUSTER_KEY")}
    env = {**base, "OMP_NUM_THREADS": "1"}
    keyed = {**env, "KVXFER_CLUSTER_KEY": CLUSTER_KEY}
    expected = colocated_generate(LlamaModel(ModelConfig()), PROMPT, NEW)
    with ProcessGroup(tmp_path / "logs") as group:
        workers = [group.start("prefill", ["serve", "--role", "prefill", "--port", "0", "--blocks", "64",
                                           "--log-level", "INFO", "--cluster-key-file", str(tmp_path / "cluster.key")], env),
                   group.start("decode", ["serve", "--role", "decode", "--port", "0", "--blocks", "64",
                                          "--log-level", "INFO"], keyed)]
        group.wait_ready(workers, timeout=120)
        urls = ["--prefill", workers[0].url, "--decode", workers[1].url]
        router = group.start("router", ["router", "--port", "0", *urls, "--api-key-file", str(tmp_path / "api.key"),
                                        "--log-level", "INFO"], keyed)
        stranger = group.start("stranger", ["router", "--port", "0", "--host", "0.0.0.0", *urls,
                                            "--log-level", "INFO"], env)
        group.wait_ready([router, stranger], timeout=60)

        # The router's door: the API key, or 401.
        body = {"prompt": PROMPT, "max_new_tokens": NEW}
        status, done = _http(f"{router.url}/generate", "POST", body, API_KEY)
        assert status == 200 and done["completion"]["error"] is None, done
        assert done["completion"]["tokens"] == expected
        _unauthorized(*_http(f"{router.url}/generate", "POST", body))
        _unauthorized(*_http(f"{router.url}/generate", "POST", body, "sk-not-it"))
        assert _http(f"{router.url}/health")[0] == 200  # open
        client = openai.OpenAI(base_url=f"{router.url}/v1", api_key=API_KEY, max_retries=0, timeout=60)
        wrong = openai.OpenAI(base_url=f"{router.url}/v1", api_key="sk-not-it", max_retries=0, timeout=60)
        try:
            assert [m.id for m in client.models.list().data] == ["toy"]
            with pytest.raises(openai.AuthenticationError, match="wrong key"):
                wrong.models.list()
        finally:
            client.close()
            wrong.close()

        # The workers' doors: the router without the cluster key is refused, and says why.
        status, done = _http(f"{stranger.url.replace('0.0.0.0', '127.0.0.1')}/generate", "POST", body)
        assert status == 200 and "HTTP 401" in done["completion"]["error"], done
        assert "cluster key" in done["completion"]["error"]
        for url in (workers[0].url, workers[1].url):
            _unauthorized(*_http(f"{url}/reserve", "POST", {"request": "x", "prompt": [1], "max_new_tokens": 1}))
            assert _http(f"{url}/health")[0] == 200

        # kvxfer doctor --peer without the key: one line naming the refusal (with the key:
        # tests/unit/test_http_keys.py, against a worker in that process).
        doctor = [sys.executable, "-m", "kvxfer.cli", "doctor", "--reps", "1", "--peer", workers[1].url]
        run = subprocess.run(doctor, capture_output=True, text=True, timeout=120, env=env)
        assert run.returncode == 2 and "HTTP 401" in run.stderr and "cluster key" in run.stderr, run.stderr
        assert "Traceback" not in run.stderr
        codes = group.stop()
    assert set(codes.values()) == {0}, codes
    logs = {p.name: p.read_text() for p in (tmp_path / "logs").glob("*.log")}
    warned = [line for line in logs["stranger.log"].splitlines() if "warning: listening on 0.0.0.0" in line]
    assert len(warned) == 1 and "no API key" in warned[0], logs["stranger.log"][-2000:]
    assert not any("warning: listening" in logs[name] for name in ("router.log", "prefill.log", "decode.log"))
    assert "POST /generate 401" in logs["router.log"] and "POST /reserve 401" in logs["decode.log"]
    for name, text in logs.items():
        assert API_KEY not in text and CLUSTER_KEY not in text and "sk-not-it" not in text, name
