"""Which UCX lane a NIXL pull would really use, and where to route it when that is TCP.

docs/performance.md: on one node NIXL's READ silently falls back to TCP (0.5 GB/s on an H200, against
1.2 TB/s for a WRITE). A pull must never run there silently: before the workers start,
``kvxfer pair`` probes the lanes with the doctor's two processes (a 1 MiB buffer, a few
seconds) and, by policy, routes the pair to push, keeps pull with a loud warning, or stops.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from kvxfer import KvxferError

PROBE_BYTES = 1 << 20


class PullOnTcp(enum.Enum):
    PUSH = "push"   # route the pair to push when push has a better lane
    KEEP = "keep"   # run pull anyway, with the warning
    FAIL = "fail"   # refuse to start


class PullOverTcp(KvxferError):
    """The pull lane is TCP and the policy says not to run it."""


@dataclass(frozen=True)
class Lanes:
    """UCX transports the doctor saw per lane for one memory kind."""

    memory: str
    push: tuple[str, ...]
    pull: tuple[str, ...]

    @staticmethod
    def _tcp(transports: tuple[str, ...]) -> bool:
        return any(t.startswith("tcp") for t in transports)

    @property
    def pull_tcp(self) -> bool:
        return self._tcp(self.pull)

    @property
    def push_tcp(self) -> bool:
        return self._tcp(self.push)


def probe_lanes(memory: str, timeout: float, devices: tuple[int, int] = (-1, -1)) -> Lanes:
    """Run the doctor's WRITE/READ probe between two processes and read the lanes UCX chose;
    ``devices``: the initiator's and the target's GPUs (a pull's: decode's, then prefill's)."""
    from kvxfer.doctor import report as doctor  # noqa: PLC0415 (imports NIXL tooling only when a pull is asked for)

    lanes = doctor.probe(memory, PROBE_BYTES, 1, timeout, devices)["lanes"]
    return Lanes(memory, tuple(lanes.get("push", ())), tuple(lanes.get("pull", ())))


def choose_mode(requested: str, lanes: Lanes, policy: PullOnTcp) -> tuple[str, str | None]:
    """The mode to run and, when the pull lane is TCP, the warning to print."""
    if requested != "pull" or not lanes.pull_tcp:
        return requested, None
    seen = f"the {lanes.memory} pull (READ) lane is TCP ({', '.join(lanes.pull)})"
    if policy is PullOnTcp.FAIL:
        raise PullOverTcp(f"{seen}; refusing to run pull (--pull-on-tcp fail). Use --mode push, "
                          "or --backend ipc when both workers share a node")
    if policy is PullOnTcp.KEEP:
        return "pull", f"!!! {seen}: running pull anyway (--pull-on-tcp keep); expect TCP speed"
    if lanes.push_tcp:
        return "pull", (f"!!! {seen}, and so is push ({', '.join(lanes.push)}): routing would not help; "
                        "running pull at TCP speed. On one node use --backend ipc")
    return "push", f"!!! {seen}: routed this pair to push ({', '.join(lanes.push)})"
