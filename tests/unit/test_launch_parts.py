"""``kvxfer launch``'s parts without a Ray cluster: what each role asks of Ray and the placements
refused up front (``kvxfer.launch.placement``), the command's checks of its flags, the process
trees its actors run (``kvxfer.launch.actors``: stop() ends the whole tree, etcd starts and is
removed), and the guard that ends etcd when its actor is gone. The cluster itself:
tests/e2e/test_launch_ray.py."""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from kvxfer.launch import cli
from kvxfer.launch.actors import EtcdProcess, ProcessTree
from kvxfer.launch.guard import exit_status
from kvxfer.launch.placement import NODE_SHARE, RolePlacement, cluster_line, head_node, problems
from kvxfer.testing.etcd_server import etcd_binary


def _node(node_id: str, **resources: float) -> dict[str, Any]:
    return {"NodeID": node_id, "Alive": True, "Resources": resources}


NODES = [_node("head", CPU=1, **{"node:__internal_head__": 1}), _node("p", CPU=2, prefill_node=1),
         _node("d", CPU=2, GPU=1, decode_node=1), {"NodeID": "dead", "Alive": False, "Resources": {"CPU": 64}}]


def test_a_role_asks_for_cpus_gpus_and_a_share_of_its_node_resource() -> None:
    role = RolePlacement("decode", 2, cpus=1, gpus=1, node_resource="decode_node")
    assert role.names() == ["decode0", "decode1"]
    assert role.resources() == {"CPU": 1.0, "GPU": 1.0, "decode_node": NODE_SHARE}
    assert role.bundle() == role.resources()
    assert role.actor_options() == {"num_cpus": 1.0, "num_gpus": 1.0, "resources": {"decode_node": NODE_SHARE}}
    assert RolePlacement("prefill", 1, cpus=0).bundle() == {"CPU": NODE_SHARE}  # Ray refuses an empty bundle
    assert "2 decode workers (CPU 1, GPU 1 each) on nodes with 'decode_node'" == role.describe()


@pytest.mark.parametrize(("kwargs", "says"), [
    ({"count": 0}, "--prefill must be at least 1"),
    ({"count": 1, "gpus": 1.5}, "whole number"),
    ({"count": 1, "cpus": -1}, "must not be negative"),
])
def test_a_role_refuses_what_ray_could_not_place(kwargs: dict[str, Any], says: str) -> None:
    with pytest.raises(ValueError, match=says):
        RolePlacement("prefill", **kwargs)


def test_the_cluster_is_read_from_its_live_nodes() -> None:
    assert head_node(NODES) == "head"
    assert head_node(NODES[1:]) is None
    assert cluster_line(NODES) == "3 nodes, 5 CPUs, 1 GPU"


def test_a_placement_the_nodes_can_hold_passes() -> None:
    roles = [RolePlacement("prefill", 2, node_resource="prefill_node"),
             RolePlacement("decode", 1, gpus=1, node_resource="decode_node")]
    assert problems(roles, NODES) == []
    assert problems(roles, NODES, "STRICT_PACK") == []


@pytest.mark.parametrize(("role", "strategy", "says"), [
    (RolePlacement("prefill", 1, node_resource="fast_node"), "", "no node offers the resource 'fast_node'"),
    (RolePlacement("decode", 1, gpus=2, node_resource="decode_node"), "", "no node with 'decode_node' has what"),
    (RolePlacement("prefill", 1, cpus=8), "", "CPU 8"),
    (RolePlacement("prefill", 2, node_resource="prefill_node"), "STRICT_SPREAD", "1 node can hold one"),
    (RolePlacement("prefill", 3, node_resource="prefill_node"), "STRICT_PACK", "no node has 3 times"),
])
def test_a_placement_no_node_could_hold_is_refused_by_name(role: RolePlacement, strategy: str, says: str) -> None:
    found = problems([role], NODES, strategy)
    assert len(found) == 1 and says in found[0], found


def test_worker_flags_are_split_off_and_checked_as_kvxfer_serve_would() -> None:
    assert cli.split_argv(["--prefill", "2", "--", "--model", "toy"]) == (["--prefill", "2"], ["--model", "toy"])
    assert cli.split_argv(["--decode", "1"]) == (["--decode", "1"], [])
    assert cli.check_worker_argv(["--device", "cpu", "--blocks", "64"]) == {"device", "blocks"}
    with pytest.raises(ValueError, match="unrecognized arguments: --blokcs"):
        cli.check_worker_argv(["--blokcs", "64"])


@pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="kvxfer[ray] is not installed")
@pytest.mark.parametrize(("argv", "says"), [
    (["--", "--port", "9000"], "--port (0: each picks one)"),
    (["--", "--etcd", "http://x:2379", "--role", "decode"], "--etcd --etcd, --role --prefill/--decode"),
    (["--prefill", "0"], "--prefill must be at least 1"),
    (["--etcd", "ftp://x"], "--etcd: etcd endpoint 'ftp://x' is not http://host:port"),
    (["--namespace", "a/b"], "--namespace"),
    (["--etcd-ttl", "1"], "--etcd-ttl must be at least 2"),
    (["--env", "NOVALUE"], "--env 'NOVALUE': give NAME=VALUE"),
    (["--placement-group", "TIGHT"], "invalid choice"),
])
def test_the_command_refuses_bad_flags_before_it_connects(argv: list[str], says: str,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stopped:
        cli.main(argv)
    assert stopped.value.code == 2
    assert says in capsys.readouterr().err


def test_without_ray_the_command_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray now raises ImportError
    assert cli.main(["--prefill", "1"]) == 2
    assert "pip install 'kvxfer[ray]'" in capsys.readouterr().err


def test_the_keys_and_env_flags_reach_the_actors(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVXFER_HINT_KEY", "00" * 16)
    monkeypatch.setenv("KVXFER_CLUSTER_KEY", "c" * 20)
    monkeypatch.setenv("KVXFER_API_KEY", "sk-local")
    env = cli.actor_env(cli.build_parser(), ["A=1", "B=x=y"])
    assert env == {"KVXFER_HINT_KEY": "00" * 16, "KVXFER_CLUSTER_KEY": "c" * 20, "KVXFER_API_KEY": "sk-local",
                   "A": "1", "B": "x=y"}
    assert not cli.key_made([])


def test_a_launch_without_a_cluster_key_makes_one_and_a_bad_one_is_refused_by_name(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    for name in ("KVXFER_HINT_KEY", "KVXFER_CLUSTER_KEY", "KVXFER_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    first, second = (cli.actor_env(cli.build_parser(), []) for _ in range(2))
    assert len(first["KVXFER_CLUSTER_KEY"]) == 64 and first["KVXFER_CLUSTER_KEY"] != second["KVXFER_CLUSTER_KEY"]
    assert set(first) == {"KVXFER_CLUSTER_KEY"} and cli.key_made([])
    assert cli.actor_env(cli.build_parser(), ["KVXFER_CLUSTER_KEY=mine"])["KVXFER_CLUSTER_KEY"] == "mine"
    assert not cli.key_made(["KVXFER_CLUSTER_KEY=mine"])
    with pytest.raises(SystemExit):
        cli.actor_env(cli.build_parser(), ["KVXFER_CLUSTER_KEY=two words"])
    err = capsys.readouterr().err
    assert "KVXFER_CLUSTER_KEY holds a space" in err and "two words" not in err


class _Sleeper(ProcessTree):
    """A process tree of its own: a parent that ignores ``ignore`` and a grandchild."""

    def __init__(self, log_dir: Path, ignore: str = "") -> None:
        super().__init__("sleeper", log_dir)
        code = ("import signal, subprocess, sys, time\n"
                f"{'signal.signal(signal.SIG' + ignore + ', signal.SIG_IGN)' if ignore else ''}\n"
                "child = subprocess.Popen(['sleep', '60'])\n"
                "print(child.pid, flush=True, file=sys.stderr)\n"
                "time.sleep(60)\n")
        self._start([sys.executable, "-c", code], dict(os.environ))

    def _check_ready(self) -> dict[str, Any] | None:
        text = self.log_path.read_text().strip()
        return {"grandchild": int(text)} if text else None


def _dead(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


@pytest.mark.parametrize("ignore", ["", "TERM"])
def test_stop_ends_the_whole_process_tree(tmp_path: Path, ignore: str) -> None:
    tree = _Sleeper(tmp_path, ignore)
    ready = tree.ready(10)
    assert ready["ok"], ready
    assert os.getsid(ready["pid"]) == ready["pid"]  # a session of its own, so killpg reaches all of it
    started = time.monotonic()
    code = tree.stop(timeout=0.5)
    assert code == (-signal.SIGKILL if ignore else -signal.SIGTERM)
    assert time.monotonic() - started < 5
    deadline = time.monotonic() + 5
    while not _dead(ready["grandchild"]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _dead(ready["grandchild"]), "the grandchild outlived stop()"
    assert tree.alive() == {"alive": False, "code": code}
    assert tree.ready(1)["ok"] is False  # stopped: says so, never raises


def test_ready_reports_a_process_that_exits_with_its_log(tmp_path: Path) -> None:
    class Failing(ProcessTree):
        def __init__(self) -> None:
            super().__init__("failing", tmp_path)
            self._start([sys.executable, "-c", "import sys; print('bad flag', file=sys.stderr); sys.exit(2)"],
                        dict(os.environ))

        def _check_ready(self) -> dict[str, Any] | None:
            return None

    tree = Failing()
    ready = tree.ready(10)
    assert ready["ok"] is False
    assert "failing exited with 2 before it was ready" in ready["error"] and "bad flag" in ready["error"]
    assert tree.stop() == 2


def test_the_guard_ends_its_command_when_stdin_closes() -> None:
    guard = subprocess.Popen([sys.executable, "-m", "kvxfer.launch.guard", "sleep", "60"], stdin=subprocess.PIPE)
    time.sleep(0.5)
    assert guard.poll() is None
    assert guard.stdin is not None
    guard.stdin.close()
    assert guard.wait(10) == 0  # sleep ended by the SIGTERM asked for: a clean stop
    assert exit_status(-signal.SIGTERM, asked=False) == 128 + signal.SIGTERM
    assert exit_status(3, asked=True) == 3


@pytest.mark.skipif(etcd_binary() is None, reason="etcd is not installed (ci/setup.sh installs etcd-server)")
def test_an_etcd_actor_serves_and_leaves_nothing(tmp_path: Path) -> None:
    etcd = EtcdProcess("etcd", log_dir=tmp_path)
    try:
        ready = etcd.ready(30)
        assert ready["ok"], ready
        assert ready["url"].startswith("http://127.0.0.1:")  # outside Ray: loopback
        data = Path(etcd.data_dir)
        assert data.is_dir()
    finally:
        code = etcd.stop()
    assert code == 0
    assert not data.exists()


def test_etcd_missing_on_the_node_is_named(tmp_path: Path) -> None:
    etcd = EtcdProcess("etcd", log_dir=tmp_path, binary="no-such-etcd-binary")
    ready = etcd.ready(1)
    assert ready["ok"] is False and "--etcd http://HOST:PORT" in ready["error"]
    assert etcd.stop() is None
