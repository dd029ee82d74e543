"""A process that made a NIXL agent exits cleanly on a host with libibverbs but no RDMA
device (this machine, once the Mooncake store's libibverbs1 is installed): kvxfer skips UCX's
InfiniBand module there, for the UCX contexts it makes (kvxfer.ucx_env), and leaves the
process's environment as it was. Without that, UCX inside NIXL crashed such a process with
SIGSEGV at exit."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvxfer.ucx_env import ib_settings, tcp_liveness, ucx_settings

BACKEND = """
import os
from kvxfer.backends.nixl import NixlBackend
backend = NixlBackend("probe")
assert not backend.shutdown()
print(os.environ.get("UCX_MODULES"))
"""


def _no_rdma() -> bool:
    return not os.path.isdir("/sys/class/infiniband") or not os.listdir("/sys/class/infiniband")


def test_a_process_with_a_nixl_backend_exits_cleanly_and_keeps_its_environment() -> None:
    env = {k: v for k, v in os.environ.items() if k != "UCX_MODULES"}
    done = subprocess.run([sys.executable, "-c", BACKEND], capture_output=True, text=True, timeout=120,
                          env={**env, "NIXL_LOG_LEVEL": "WARN"})
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])  # -11 here without the skip
    assert done.stdout.splitlines()[-1] == "None"  # the setting went to NIXL's UCX, not to os.environ


def test_the_module_is_skipped_only_without_rdma_devices(tmp_path: Path) -> None:
    (tmp_path / "mlx5_0").mkdir()
    assert ib_settings(str(tmp_path)) == {}  # a device: left alone
    assert ib_settings(str(tmp_path / "absent")) == {"UCX_MODULES": "^ib"}
    (tmp_path / "empty").mkdir()
    assert ib_settings(str(tmp_path / "empty")) == {"UCX_MODULES": "^ib"}


def test_a_net_device_the_host_lacks_is_named(tmp_path: Path) -> None:
    from kvxfer.ucx_env import net_devices_problem

    net, rdma = tmp_path / "net", tmp_path / "infiniband"
    for d in (net / "eth0", net / "lo", rdma / "mlx5_0"):
        d.mkdir(parents=True)
    for fine in ("", "all", "eth0", "lo,eth0", "mlx5_0:1", "mlx5_*:1, eth0"):
        assert net_devices_problem(fine, net=str(net), rdma=str(rdma)) is None, fine
    problem = net_devices_problem("eth0,eth9,mlx5_3:1", net=str(net), rdma=str(rdma))
    assert problem is not None and "'eth9', 'mlx5_3:1'" in problem and "eth0, lo, mlx5_0" in problem


def test_tcp_timeouts_follow_the_deadline_within_floor_and_ceiling() -> None:
    # Half the deadline, never under 5 s (a loaded host can leave a live peer's data
    # unacknowledged for a while) nor over 60 s.
    assert tcp_liveness(30)["UCX_TCP_USER_TIMEOUT"] == "15000ms"
    assert tcp_liveness(3)["UCX_TCP_USER_TIMEOUT"] == "5000ms"
    assert tcp_liveness(600)["UCX_TCP_USER_TIMEOUT"] == "60000ms"
    for deadline in (3, 10, 30, 120):
        settings = tcp_liveness(deadline)
        idle_s = int(settings["UCX_TCP_KEEPIDLE"]) + int(settings["UCX_TCP_KEEPINTVL"]) * int(settings["UCX_TCP_KEEPCNT"])
        half = int(settings["UCX_TCP_USER_TIMEOUT"].removesuffix("ms")) / 1000
        assert idle_s <= half + 1, (deadline, settings)  # an idle connection is found as fast


def test_ucx_settings_apply_only_what_the_user_left_unset_and_only_inside_the_block(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("UCX_TCP_USER_TIMEOUT", "99s")
    monkeypatch.delenv("UCX_TCP_KEEPIDLE", raising=False)
    monkeypatch.delenv("UCX_MODULES", raising=False)
    with ucx_settings({"UCX_TCP_USER_TIMEOUT": "5s", "UCX_TCP_KEEPIDLE": "2"}) as applied:
        assert applied == {**ib_settings(), "UCX_TCP_KEEPIDLE": "2"}  # the host's settings too
        assert os.environ["UCX_TCP_USER_TIMEOUT"] == "99s"
        assert os.environ["UCX_TCP_KEEPIDLE"] == "2"
        assert os.environ.get("UCX_MODULES") == ("^ib" if _no_rdma() else None)
    assert "UCX_TCP_KEEPIDLE" not in os.environ and "UCX_MODULES" not in os.environ
    assert os.environ["UCX_TCP_USER_TIMEOUT"] == "99s"
    monkeypatch.setenv("UCX_MODULES", "ib,tcp")  # the user's choice wins
    with ucx_settings() as applied:
        assert applied == {} and os.environ["UCX_MODULES"] == "ib,tcp"
