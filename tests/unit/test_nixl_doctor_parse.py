"""kvxfer doctor reads UCX's protocol tables: transports per lane, and a loud TCP warning; it
says who computes row digests here and whether a --peer worker checks them."""

from __future__ import annotations

import pytest

from kvxfer import native
from kvxfer.doctor.report import _print, _warnings, integrity_report, lanes_from_tables, parse_proto_info

# Abridged from UCX_PROTO_INFO=y output of a GPU node where the read lane fell back to TCP.
SAMPLE = """\
[1.0] [n:1:0]   | agent-a self cfg#0                                       |
[1.0] [n:1:0]   | remote memory write by ucp_put* from host memory to host |
[1.0] [n:1:0]   | 0..inf | zero-copy   | cma/memory                        |
[1.1] [n:1:0]   | agent-a intra-node cfg#1                                 |
[1.1] [n:1:0]   | remote memory write by ucp_put* from cuda memory to cuda |
[1.1] [n:1:0]   +--------+-------------+-----------------------------------+
[1.1] [n:1:0]   | Range  | Description |              Config               |
[1.1] [n:1:0]   | 0..inf | zero-copy   | cuda_ipc/cuda                     |
[1.2] [n:1:0]   | agent-a intra-node cfg#1                                 |
[1.2] [n:1:0]   | active message by ucp_am_send* from host memory          |
[1.2] [n:1:0]   |   1..16515 | zero-copy          | tcp/lo                 |
[1.3] [n:1:0]   | agent-a intra-node cfg#1                                 |
[1.3] [n:1:0]   | remote memory read by ucp_get*(multi) into cuda memory from cuda |
[1.3] [n:1:0]   |  0..8192 | copy-out | tcp/lo                             |
[1.3] [n:1:0]   | 8193..inf | zero-copy | 50% on tcp/lo and 50% on tcp/eth0 |
[1.4] [n:1:0]   | agent-a intra-node cfg#1                                 |
[1.4] [n:1:0]   | remote memory read by ucp_get* into host memory from host |
[1.4] [n:1:0]   | 0..inf | zero-copy   | cma/memory                        |
"""


def test_lanes_per_memory_kind_skip_self_and_active_messages() -> None:
    tables = parse_proto_info(SAMPLE)
    assert all("self" not in t["endpoint"] for t in tables)
    assert lanes_from_tables(tables, "device") == {"push": ["cuda_ipc/cuda"], "pull": ["tcp/lo", "tcp/eth0"]}
    assert lanes_from_tables(tables, "host") == {"push": [], "pull": ["cma/memory"]}


def test_tcp_lane_gets_a_loud_warning_with_the_remedy() -> None:
    tables = parse_proto_info(SAMPLE)
    report = {"memory": {"device": {"lanes": lanes_from_tables(tables, "device")},
                         "host": {"lanes": lanes_from_tables(tables, "host")}}}
    warnings = _warnings(report)
    tcp = [w for w in warnings if "TCP" in w]
    assert len(tcp) == 1 and tcp[0].startswith("!!! DEVICE PULL lane falls back to TCP")
    assert "push mode" in tcp[0] and "ipc backend" in tcp[0]
    assert any("host push lane" in w and "unknown" in w for w in warnings)
    # A push lane on TCP is not told to use push mode: its remedy is its own.
    pushed = {"memory": {"device": {"lanes": {"push": ["tcp/lo"], "pull": ["cuda_ipc/cuda"]}}}}
    (push_warning,) = _warnings(pushed)
    assert push_warning.startswith("!!! DEVICE PUSH lane falls back to TCP") and "push mode" not in push_warning
    assert "UCX_TLS" in push_warning
    # Both lanes on TCP (issue 27): pull is not told to switch to push, which is TCP as well.
    both = {"memory": {"host": {"lanes": {"push": ["tcp/eth0"], "pull": ["tcp/eth0"]}}}}
    push_warning, pull_warning = _warnings(both)
    assert pull_warning.startswith("!!! HOST PULL lane falls back to TCP") and "use push mode" not in pull_warning
    assert "push is TCP too" in pull_warning and "UCX_TLS" in pull_warning and "UCX_TLS" in push_warning


def test_doctor_refuses_sizes_it_cannot_probe_before_starting_processes(capsys: object) -> None:
    """``--bytes 0`` and ``--reps 0`` used to start both probe processes and end in an IndexError."""
    import pytest

    from kvxfer.doctor import main

    for argv, words in ((["--bytes", "0"], "--bytes must be at least 131072"),
                        (["--reps", "0"], "--reps must be at least 1"),
                        (["--timeout", "-1"], "--timeout must be positive")):
        with pytest.raises(SystemExit) as exc:
            main(argv)
        assert exc.value.code == 2
        assert words in capsys.readouterr().err  # type: ignore[attr-defined]


def test_doctor_devices_are_checked_before_any_process_starts(capsys: object, monkeypatch: object) -> None:
    """``--devices I,T`` places the device-memory probe; a malformed, contradictory or invisible
    placement is a usage error naming the flag, before a probe process starts."""
    import pytest

    import kvxfer.doctor.report as doctor

    def no_probe(*args: object, **kwargs: object) -> None:
        raise AssertionError("a probe started")

    monkeypatch.setattr(doctor, "probe", no_probe)  # type: ignore[attr-defined]
    monkeypatch.setattr(doctor, "cuda_device_count", lambda: 1)  # type: ignore[attr-defined]
    cases = ((["--devices", "0,x"], "'0,x' must be one or two CUDA device indices"),
             (["--devices", "0,1", "--no-device"], "cannot go with --no-device"),
             (["--devices", "0,1"], "cuda:1 is not visible (this process sees 1 CUDA device: cuda:0..cuda:0)"))
    for argv, words in cases:
        with pytest.raises(SystemExit) as exc:
            doctor.main(argv)
        assert exc.value.code == 2
        err = capsys.readouterr().err  # type: ignore[attr-defined]
        assert "--devices" in err and words in err, err
    monkeypatch.setattr(doctor, "cuda_device_count", lambda: 0)  # type: ignore[attr-defined]
    with pytest.raises(SystemExit):
        doctor.main(["--devices", "0"])
    assert "no CUDA device is visible" in capsys.readouterr().err  # type: ignore[attr-defined]


# Table headers UCX 1.23 printed for a device probe between two H200s (initiator cuda:0, target cuda:1).
TWO_GPUS = """\
[2.0] [n:1:0]   | kvxfer-doctor-initiator-1350 intra-node cfg#2            |
[2.0] [n:1:0]   | remote memory write by ucp_put* from host memory to cuda/dev[2] |
[2.0] [n:1:0]   | 0..inf | zero-copy   | tcp/lo                            |
[2.1] [n:1:0]   | kvxfer-doctor-initiator-1350 intra-node cfg#2            |
[2.1] [n:1:0]   | remote memory write by ucp_put*(multi) from cuda/GPU0 to cuda/dev[3] |
[2.1] [n:1:0]   | 0..inf | zero-copy   | cuda_ipc/cuda                     |
[2.2] [n:1:0]   | kvxfer-doctor-initiator-1350 intra-node cfg#2            |
[2.2] [n:1:0]   | remote memory read by ucp_get*(multi) into cuda/GPU0 from cuda/dev[3] |
[2.2] [n:1:0]   | 0..inf | zero-copy   | cuda_ipc/cuda                     |
"""


def test_a_write_from_host_memory_into_the_gpu_is_not_the_device_lane() -> None:
    """Between two GPUs UCX also prints a host-to-GPU put table (tcp/lo); the rows go GPU to
    GPU (cuda_ipc), so the device push lane is cuda_ipc and no TCP warning is raised."""
    tables = parse_proto_info(TWO_GPUS)
    assert [t["memory"] for t in tables] == ["mixed", "device", "device"]
    lanes = lanes_from_tables(tables, "device")
    assert lanes == {"push": ["cuda_ipc/cuda"], "pull": ["cuda_ipc/cuda"]}
    assert not [w for w in _warnings({"memory": {"device": {"lanes": lanes}}}) if "TCP" in w]


# Table headers of the doctor's device probe on one H200 (both processes on cuda:0), UCX 1.23.
ONE_GPU = """\
[3.0] [n:1:0]   | kvxfer-doctor-initiator-7 intra-node cfg#2               |
[3.0] [n:1:0]   | remote memory write by ucp_put* from host memory to cuda/dev[1] |
[3.0] [n:1:0]   | 0..inf | zero-copy   | tcp/lo                            |
[3.1] [n:1:0]   | kvxfer-doctor-initiator-7 intra-node cfg#2               |
[3.1] [n:1:0]   | remote memory write by ucp_put*(multi) from cuda/GPU0 to cuda/dev[1] |
[3.1] [n:1:0]   | 0..inf | zero-copy   | cuda_ipc/cuda                     |
[3.2] [n:1:0]   | kvxfer-doctor-initiator-7 intra-node cfg#2               |
[3.2] [n:1:0]   | remote memory read by ucp_get*(multi) into cuda/GPU0 from cuda/dev[1] |
[3.2] [n:1:0]   | 0..inf | zero-copy   | tcp/lo                            |
"""


def test_a_tcp_pull_on_one_gpu_is_still_routed_to_push() -> None:
    """The host-to-GPU put table (tcp/lo) must not make push look like TCP too: then
    ``kvxfer pair --mode pull`` would keep pull at TCP speed ("routing would not help")."""
    from kvxfer.pair.lanes import Lanes, PullOnTcp, choose_mode

    lanes = lanes_from_tables(parse_proto_info(ONE_GPU), "device")
    assert lanes == {"push": ["cuda_ipc/cuda"], "pull": ["tcp/lo"]}
    mode, warning = choose_mode("pull", Lanes("device", tuple(lanes["push"]), tuple(lanes["pull"])), PullOnTcp.PUSH)
    assert mode == "push" and warning is not None and "routed this pair to push" in warning


def test_the_report_says_who_digests_rows_here_and_whether_the_peer_checks_them(
        capsys: pytest.CaptureFixture[str]) -> None:
    integrity = integrity_report()
    assert integrity["digests"] == ("native" if native.info().digest else "numpy")
    peer = {"url": "http://w:1", "name": "p0", "role": "prefill", "host": "w", "device": "cpu", "integrity": "off"}
    _print({"versions": {"nixl": "1", "ucx": "1"}, "integrity": integrity, "peer": peer, "memory": {},
            "warnings": [], "host": "h"})
    out = capsys.readouterr().out
    assert f"row integrity (kvxfer serve --integrity, on by default): digests by {integrity['detail']}" in out
    assert "pool on cpu, integrity off:" in out
