"""The doctor reads which transport ucxx's UCX chose for tag messages from UCX_PROTO_INFO
tables (lines as UCX 1.21 printed them on the CPU machine)."""

from __future__ import annotations

from kvxfer.doctor.ucx import parse_tag_tables

TCP = """\
[1796167608.115175] [vm:24978:0]   +--------------------------------+-----------------------------------------------+--------+
[1796167608.115175] [vm:24978:0]   | ucp_context_0 intra-node cfg#0 | tagged message by ucp_tag_send* from host memory    |
[1796167608.115176] [vm:24978:0]   +--------------------------------+--------------------------------------------+--------+
[1796167608.115176] [vm:24978:0]   |                              0 | eager short                                | tcp/lo |
[1796167608.115177] [vm:24978:0]   |                        1..8191 | eager zero-copy copy-out                   | tcp/lo |
[1796167608.115177] [vm:24978:0]   |                      8K..16352 | (?) rendezvous zero-copy                   | tcp/lo |
"""

SHM_AND_SELF = """\
[1] [vm:1:0]   | ucp_context_0 self cfg#1 | tagged message by ucp_tag_send* from host memory |
[1] [vm:1:0]   |                        0 | eager short                    | self/memory |
[1] [vm:1:0]   | ucp_context_0 intra-node cfg#0 | tagged message by ucp_tag_send* from host memory |
[1] [vm:1:0]   |                          0..92 | eager short                    | sysv/memory |
[1] [vm:1:0]   |                      93..8256 | eager copy-in copy-out         | sysv/memory |
[1] [vm:1:0]   |                       8K..inf | rendezvous zero-copy read      | cma/memory |
[1] [vm:1:0]   | ucp_context_0 intra-node cfg#0 | active message by ucp_am_send* from host memory |
[1] [vm:1:0]   |                          0..92 | eager short                    | tcp/lo |
"""


def test_tcp_lane_is_read() -> None:
    assert parse_tag_tables(TCP) == ["tcp/lo"]


def test_every_size_range_read_and_self_and_other_operations_left_out() -> None:
    assert parse_tag_tables(SHM_AND_SELF) == ["sysv/memory", "cma/memory"]


def test_no_table_no_transport() -> None:
    assert parse_tag_tables("UCX  WARN  something\nno tables here") == []
