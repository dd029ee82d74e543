"""A process that made a NIXL agent exits cleanly on a host with libibverbs but no RDMA
device (this machine, once the Mooncake store's libibverbs1 is installed): importing kvxfer
skips UCX's InfiniBand module there (kvxfer.ucx_env). Without that, UCX inside NIXL crashed
such a process with SIGSEGV at exit."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvxfer.ucx_env import skip_unusable_ib, tcp_liveness, ucx_settings

AGENT = "from nixl._api import nixl_agent, nixl_agent_config; nixl_agent('probe', nixl_agent_config(backends=['UCX']))"


def _run(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if k != "UCX_MODULES"}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**clean, **env})


def test_a_process_with_a_nixl_agent_exits_cleanly_after_importing_kvxfer() -> None:
    done = _run("import kvxfer, os; print(os.environ.get('UCX_MODULES')); " + AGENT)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    if not os.path.isdir("/sys/class/infiniband") or not os.listdir("/sys/class/infiniband"):
        assert done.stdout.splitlines()[0] == "^ib"


def test_the_module_is_skipped_only_without_rdma_devices_and_never_over_the_users_choice(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("UCX_MODULES", raising=False)
    (tmp_path / "mlx5_0").mkdir()
    assert not skip_unusable_ib(str(tmp_path)) and "UCX_MODULES" not in os.environ  # a device: left alone
    assert skip_unusable_ib(str(tmp_path / "absent")) and os.environ["UCX_MODULES"] == "^ib"
    monkeypatch.setenv("UCX_MODULES", "ib,tcp")
    assert not skip_unusable_ib(str(tmp_path / "absent")) and os.environ["UCX_MODULES"] == "ib,tcp"


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
    with ucx_settings({"UCX_TCP_USER_TIMEOUT": "5s", "UCX_TCP_KEEPIDLE": "2"}) as applied:
        assert applied == {"UCX_TCP_KEEPIDLE": "2"}
        assert os.environ["UCX_TCP_USER_TIMEOUT"] == "99s"
        assert os.environ["UCX_TCP_KEEPIDLE"] == "2"
    assert "UCX_TCP_KEEPIDLE" not in os.environ
    assert os.environ["UCX_TCP_USER_TIMEOUT"] == "99s"
