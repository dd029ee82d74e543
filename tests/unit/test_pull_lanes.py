"""Where a pull whose UCX lane is TCP runs: the decision table of kvxfer.pair.lanes."""

from __future__ import annotations

import pytest

from kvxfer.pair.lanes import Lanes, PullOnTcp, PullOverTcp, choose_mode

FAST = ("cuda_ipc/cuda",)
TCP = ("tcp/lo",)


@pytest.mark.parametrize("policy", list(PullOnTcp))
def test_push_or_a_fast_pull_lane_is_left_alone(policy: PullOnTcp) -> None:
    assert choose_mode("push", Lanes("device", TCP, TCP), policy) == ("push", None)
    assert choose_mode("pull", Lanes("device", FAST, FAST), policy) == ("pull", None)


def test_tcp_pull_is_routed_to_a_faster_push() -> None:
    mode, warning = choose_mode("pull", Lanes("device", FAST, TCP), PullOnTcp.PUSH)
    assert mode == "push"
    assert warning is not None and "TCP" in warning and "routed this pair to push" in warning


def test_routing_is_pointless_when_push_is_tcp_too() -> None:
    mode, warning = choose_mode("pull", Lanes("host", TCP, TCP), PullOnTcp.PUSH)
    assert mode == "pull" and warning is not None and "so is push" in warning and "ipc" in warning


def test_keep_warns_and_fail_refuses() -> None:
    mode, warning = choose_mode("pull", Lanes("device", FAST, TCP), PullOnTcp.KEEP)
    assert mode == "pull" and warning is not None and "anyway" in warning
    with pytest.raises(PullOverTcp, match="pull .READ. lane is TCP .tcp/lo.; refusing"):
        choose_mode("pull", Lanes("device", FAST, TCP), PullOnTcp.FAIL)
