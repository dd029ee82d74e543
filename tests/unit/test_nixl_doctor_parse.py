"""kvxfer doctor reads UCX's protocol tables: transports per lane, and a loud TCP warning."""

from __future__ import annotations

from kvxfer.doctor import _warnings, lanes_from_tables, parse_proto_info

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
