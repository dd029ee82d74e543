"""``kvxfer launch`` on a local multi-node Ray cluster (``ray.cluster_utils.Cluster``: a head
and two worker nodes, all on this machine, each with a custom resource), the toy model over
NIXL in host memory, etcd started by the launcher on the head node:

- every actor runs where its placement says (prefill on the prefill node, decode on the decode
  node, router and etcd on the head), its process in a session of its own, with the GPUs Ray
  gave it as CUDA_VISIBLE_DEVICES (the decode node offers one GPU as configuration: no GPU
  here, the workers run on cpu) and the launcher's ``--env`` in its environment;
- completions through the router are token-identical to colocated generation and use both
  prefill workers;
- a prefill worker killed as a node death would (its process tree SIGKILLed, its actor
  ``ray.kill``ed) leaves the router within its etcd TTL, requests go on succeeding meanwhile
  (policy recompute) and then all go to the other prefill worker; the launcher reports it;
- SIGTERM to the launcher stops every actor's process tree and exits 0; ``cluster.shutdown()``
  leaves no Ray process behind (the per-module check in tests/conftest.py, and a scan of
  /proc for the cluster's temp folder).

One cluster and one launch serve the module (a cluster's lifecycle takes 15-25 s here).
Facts this relies on: Ray 2.60, plain ``ray``; never ``ray stop --force`` (it ends every Ray
process of the machine, other people's too), never a node address of 127.0.0.1 (``ray.init``
then hangs for minutes); RAY_TMPDIR is a short folder of the module's, removed at the end.
"""

from __future__ import annotations

import json
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

ray = pytest.importorskip("ray", reason="kvxfer[ray] is not installed (the dev extra installs it)")

from kvxfer.engine import LlamaModel, ModelConfig, colocated_generate, synthetic_prompts  # noqa: E402
from kvxfer.testing.etcd_server import etcd_binary  # noqa: E402

if etcd_binary() is None:  # the launches start etcd on the head node
    pytest.skip("etcd is not installed (ci/setup.sh installs etcd-server)", allow_module_level=True)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

NAMESPACE = "kvxfer-launch-test"
TTL_S = 3
NEW = 6
MODEL = LlamaModel(ModelConfig())
PROMPTS = synthetic_prompts(6, 20, 70, MODEL.config.vocab_size, seed=27)


@pytest.fixture(autouse=True)
def no_child_left_behind() -> Iterator[None]:
    """Overrides tests/e2e/conftest.py's per-test check: the module's Ray cluster and launcher
    are children of this process from the first test to the last. The module-level check of
    tests/conftest.py still holds: nothing outlives the module."""
    yield


@dataclass
class RayCluster:
    address: str
    tmp: Path
    head: str
    prefill_node: str
    decode_node: str


def _ray_processes(tmp: Path) -> list[str]:
    """Live processes whose command line names the cluster's temp folder (gcs_server, raylets,
    agents, workers), as ``pid command``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if str(tmp).encode() in cmdline and state != "Z":
            found.append(f"{entry.name} {cmdline[:120].decode(errors='replace')}")
    return found


@pytest.fixture(scope="module")
def cluster() -> Iterator[RayCluster]:
    from ray.cluster_utils import Cluster

    tmp = Path(tempfile.mkdtemp(prefix="kr", dir="/tmp"))  # short: Ray's socket paths must fit 107 bytes
    with pytest.MonkeyPatch.context() as env:
        env.setenv("RAY_TMPDIR", str(tmp))
        env.setenv("RAY_USAGE_STATS_ENABLED", "0")
        started = time.monotonic()
        made = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
        try:
            made.add_node(num_cpus=2, resources={"prefill_node": 1})
            made.add_node(num_cpus=2, num_gpus=1, resources={"decode_node": 1})  # a GPU as configuration only
            made.wait_for_nodes()
            ray.init(address=made.address, namespace=NAMESPACE, log_to_driver=False)
            print(f"\nRay cluster of 3 nodes up in {time.monotonic() - started:.1f} s", flush=True)
            nodes = {name: n["NodeID"] for n in ray.nodes() if n["Alive"] for name in n["Resources"]}
            yield RayCluster(made.address, tmp, nodes["node:__internal_head__"], nodes["prefill_node"],
                             nodes["decode_node"])
        finally:
            ray.shutdown()
            made.shutdown()
            deadline = time.monotonic() + 15
            while _ray_processes(tmp) and time.monotonic() < deadline:
                time.sleep(0.2)
            left = _ray_processes(tmp)
            shutil.rmtree(tmp, ignore_errors=True)
    assert not left, f"Ray processes outlived cluster.shutdown(): {left}"


@dataclass
class Launched:
    proc: subprocess.Popen[str]
    ready: dict[str, Any]
    stderr: Path

    def actor(self, name: str) -> dict[str, Any]:
        return next(a for a in self.ready["actors"] if a["name"] == name)

    def urls(self, role: str) -> list[str]:
        return [a["url"] for a in self.ready["actors"] if a["role"] == role]


def _read_ready(proc: subprocess.Popen[str], stderr: Path, timeout: float) -> dict[str, Any]:
    """The launcher's ready line (its stdout holds nothing else)."""
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    line = ""
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        while time.monotonic() < deadline and not line:
            if sel.select(1.0):
                line = proc.stdout.readline() or "(end of stdout)"
    try:
        ready = json.loads(line)
    except ValueError:
        ready = None
    if isinstance(ready, dict) and ready.get("event") == "ready":
        return ready
    raise AssertionError(f"kvxfer launch gave no ready line (stdout {line[:300]!r}, exit {proc.poll()}); "
                         f"its stderr:\n{stderr.read_text()[-6000:]}")


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True


@pytest.fixture(scope="module")
def launched(cluster: RayCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Launched]:
    tmp = tmp_path_factory.mktemp("launch")
    stderr = tmp / "launch.stderr"
    argv = [sys.executable, "-m", "kvxfer.cli", "launch", "--address", cluster.address, "--namespace", NAMESPACE,
            "--prefill", "2", "--decode", "1", "--prefill-node-resource", "prefill_node",
            "--decode-node-resource", "decode_node", "--decode-gpus", "1", "--placement-group", "STRICT_PACK",
            "--etcd", "start", "--etcd-ttl", str(TTL_S), "--router-port", "0", "--on-failure", "recompute",
            "--check-interval", "1", "--env", "KVXFER_LAUNCH_TEST=reached", "--log-dir", str(tmp / "logs"),
            "--", "--device", "cpu", "--blocks", "256", "--transfer-timeout", "20"]
    started = time.monotonic()
    with open(stderr, "w") as err:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=err, text=True,
                                env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        ready = _read_ready(proc, stderr, 180)
        print(f"kvxfer launch ready in {time.monotonic() - started:.1f} s", flush=True)
        yield Launched(proc, ready, stderr)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(90)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = proc.wait(10)
        assert proc.stdout is not None
        proc.stdout.close()
    text = stderr.read_text()
    assert code == 0, f"kvxfer launch exited {code}:\n{text[-4000:]}"
    assert "stopped: router 0" in text, text[-2000:]
    pids = [a["pid"] for a in ready["actors"]]
    deadline = time.monotonic() + 15
    while not all(_gone(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert all(_gone(p) for p in pids), f"processes left after the launcher stopped: {[p for p in pids if not _gone(p)]}"


def _generate(router: str, prompt: list[int]) -> dict[str, Any]:
    body = json.dumps({"prompt": prompt, "max_new_tokens": NEW}).encode()
    ask = urllib.request.Request(f"{router}/generate", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(ask, timeout=60) as answer:
        events = [json.loads(line) for line in answer.read().splitlines() if line.strip()]
    return dict(next(e for e in events if e.get("event") == "done")["completion"])


def _health(router: str) -> dict[str, Any]:
    try:
        with urllib.request.urlopen(f"{router}/health", timeout=10) as answer:
            return dict(json.loads(answer.read()))
    except urllib.error.HTTPError as exc:
        return dict(json.loads(exc.read()))


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode(errors="replace").partition("=")[::2] for item in raw if b"=" in item)


def test_each_actor_runs_on_its_intended_node(launched: Launched, cluster: RayCluster) -> None:
    placed = {a["name"]: a for a in launched.ready["actors"]}
    assert sorted(placed) == ["decode0", "etcd", "prefill0", "prefill1", "router"]
    assert placed["prefill0"]["node_id"] == placed["prefill1"]["node_id"] == cluster.prefill_node
    assert placed["decode0"]["node_id"] == cluster.decode_node
    assert placed["router"]["node_id"] == placed["etcd"]["node_id"] == cluster.head
    assert placed["decode0"]["gpu_ids"] == ["0"] and placed["prefill0"]["gpu_ids"] == []
    for name, actor in placed.items():
        assert os.getsid(actor["pid"]) == actor["pid"], f"{name} is not in a session of its own"
        env = _environ(actor["pid"])
        assert env.get("KVXFER_LAUNCH_TEST") == "reached", name  # runtime_env reached the actor's process
        if name != "etcd":  # etcd's guard passes its environment on as it is
            assert env.get("CUDA_VISIBLE_DEVICES") == actor["cuda_visible_devices"], name
    assert _environ(placed["decode0"]["pid"])["CUDA_VISIBLE_DEVICES"] == "0"
    assert {placed[n]["device"] for n in ("prefill0", "prefill1", "decode0")} == {"cpu"}
    assert launched.ready["strategy"] == "STRICT_PACK"


def test_completions_are_token_identical_to_colocated_generation(launched: Launched) -> None:
    prefills = set()
    for prompt in PROMPTS:
        done = _generate(launched.ready["router"], prompt)
        assert done["error"] is None, done
        assert list(done["tokens"]) == colocated_generate(MODEL, prompt, NEW), done
        assert done["path"] == "disaggregated", done
        prefills.add(done["prefill"])
    assert prefills == set(launched.urls("prefill"))  # round robin over both


def test_a_killed_worker_leaves_the_router(launched: Launched) -> None:
    router = launched.ready["router"]
    victim, survivor = launched.actor("prefill0"), launched.actor("prefill1")
    os.killpg(victim["pgid"], signal.SIGKILL)  # as a node death would: no deregistration
    ray.kill(ray.get_actor("prefill0", namespace=NAMESPACE), no_restart=True)
    killed = time.monotonic()
    served = 0
    while True:
        health = _health(router)
        listed = set(health.get("prefill", {})) | set(health.get("discovery", {}).get("members", {}).values())
        if victim["url"] not in listed:
            break
        assert time.monotonic() - killed < TTL_S + 15, f"the router still lists {victim['url']}: {health}"
        prompt = PROMPTS[served % len(PROMPTS)]
        done = _generate(router, prompt)  # meanwhile: recomputed where prefill0 was picked, never lost
        assert done["error"] is None and list(done["tokens"]) == colocated_generate(MODEL, prompt, NEW), done
        served += 1
    dropped = time.monotonic() - killed
    print(f"router dropped the killed worker {dropped:.1f} s after the kill (etcd TTL {TTL_S} s; "
          f"{served} requests served meanwhile)", flush=True)
    assert survivor["url"] in health["prefill"]
    for prompt in PROMPTS[:4]:
        done = _generate(router, prompt)
        assert done["error"] is None and list(done["tokens"]) == colocated_generate(MODEL, prompt, NEW), done
        assert done["path"] == "disaggregated" and done["prefill"] == survivor["url"], done
    deadline = time.monotonic() + 15
    while "prefill0 (" not in launched.stderr.read_text() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert "is gone" in launched.stderr.read_text(), launched.stderr.read_text()[-2000:]


def test_a_launcher_killed_outright_leaves_no_process(launched: Launched, cluster: RayCluster,
                                                      tmp_path: Path) -> None:
    """A second launch on the first one's etcd (``--etcd URL``, a namespace of its own), its
    workers asking for no CPU, placed by Ray alone; its driver SIGKILLed: Ray ends its actors,
    and their processes stop with them (parent watch; etcd's guard)."""
    argv = [sys.executable, "-m", "kvxfer.cli", "launch", "--address", cluster.address, "--namespace", "second",
            "--prefill-cpus", "0", "--decode-cpus", "0", "--etcd", launched.ready["etcd"], "--router-port", "0",
            "--log-dir", str(tmp_path / "logs"), "--quiet", "--", "--device", "cpu", "--blocks", "64"]
    stderr = tmp_path / "launch.stderr"
    with open(stderr, "w") as err:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=err, text=True,
                                env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        ready = _read_ready(proc, stderr, 120)
    finally:
        proc.kill()
        proc.wait(10)
        assert proc.stdout is not None
        proc.stdout.close()
    assert ready["etcd"] == launched.ready["etcd"] and "etcd" not in {a["name"] for a in ready["actors"]}
    first = _health(launched.ready["router"])["discovery"]["members"]
    assert not {a["url"] for a in ready["actors"]} & set(first.values())  # namespaces keep launches apart
    pids = [a["pid"] for a in ready["actors"]]
    deadline = time.monotonic() + 30
    while not all(_gone(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert all(_gone(p) for p in pids), f"left after the launcher's SIGKILL: {[p for p in pids if not _gone(p)]}"


def test_a_second_launch_into_a_namespace_in_use_is_refused(launched: Launched, cluster: RayCluster) -> None:
    argv = [sys.executable, "-m", "kvxfer.cli", "launch", "--address", cluster.address, "--namespace", NAMESPACE,
            "--prefill-cpus", "0", "--decode-cpus", "0", "--router-port", "0", "--quiet", "--", "--device", "cpu"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    assert f"an actor named 'etcd' already runs in Ray namespace {NAMESPACE!r}" in done.stderr, done.stderr[-2000:]
    assert _health(launched.ready["router"])["status"] == "ok"  # the running launch is untouched
