"""Where ``kvxfer launch`` asks Ray to put each actor, as plain data (no Ray import here).

A role (prefill, decode) asks per worker for CPUs, GPUs and, optionally, a *node resource*: a
custom resource that marks the nodes meant for that role (``ray start --resources
'{"prefill_node": 1}'``). Each worker takes ``NODE_SHARE`` of it, so the resource is a label,
not a count: how many workers a node holds is set by its CPUs and GPUs.

Without a strategy each worker is its own actor request and Ray's scheduler places it. With a
placement-group strategy each role gets one placement group, a bundle per worker, reserved as
a whole before any worker starts: ``STRICT_PACK`` puts all of a role's workers on one node,
``STRICT_SPREAD`` each on a node of its own, ``PACK``/``SPREAD`` prefer those. Prefill on one
node group and decode on another is a node resource per role, with either path.

``problems()`` refuses, by name, what no node of the cluster could give (a resource no node
has, more GPUs than any node has, a strict spread wider than the nodes); what is only busy now
is left to Ray, and to the launcher's timeouts.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

ROLES = ("prefill", "decode")
STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
NODE_SHARE = 0.001
"""How much of its role's node resource each worker takes: the resource marks nodes, it does not count workers."""
HEAD_RESOURCE = "node:__internal_head__"
"""The resource Ray gives the head node alone."""


@dataclass(frozen=True)
class RolePlacement:
    """What each of a role's ``count`` workers asks of Ray."""

    role: str
    count: int
    cpus: float = 1.0
    gpus: float = 0.0
    node_resource: str = ""

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, not {self.role!r}")
        if self.count < 1:
            raise ValueError(f"--{self.role} must be at least 1, got {self.count}")
        if self.cpus < 0 or self.gpus < 0:
            raise ValueError(f"a {self.role} worker's CPUs and GPUs must not be negative")
        if self.gpus > 1 and self.gpus != int(self.gpus):
            raise ValueError(f"--{self.role}-gpus above 1 must be a whole number, got {self.gpus:g}")

    def names(self) -> list[str]:
        return [f"{self.role}{i}" for i in range(self.count)]

    def resources(self) -> dict[str, float]:
        """Per worker: CPU, GPU (when asked) and the node resource (when given)."""
        out = {"CPU": float(self.cpus)}
        if self.gpus:
            out["GPU"] = float(self.gpus)
        if self.node_resource:
            out[self.node_resource] = NODE_SHARE
        return out

    def bundle(self) -> dict[str, float]:
        """One worker's placement-group bundle (Ray refuses a bundle of zeros: a worker of no
        CPU and no GPU reserves a node-resource share, or a token CPU share)."""
        out = {k: v for k, v in self.resources().items() if v > 0}
        return out or {"CPU": NODE_SHARE}

    def actor_options(self) -> dict[str, Any]:
        """``ray.remote(...).options(**these)``, without a scheduling strategy."""
        options: dict[str, Any] = {"num_cpus": float(self.cpus), "num_gpus": float(self.gpus)}
        if self.node_resource:
            options["resources"] = {self.node_resource: NODE_SHARE}
        return options

    def describe(self) -> str:
        asked = ", ".join(f"{k} {v:g}" for k, v in self.resources().items() if k != self.node_resource)
        where = f" on nodes with {self.node_resource!r}" if self.node_resource else ""
        return f"{self.count} {self.role} worker{'s' if self.count != 1 else ''} ({asked} each){where}"


def alive_nodes(nodes: Iterable[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """``ray.nodes()`` without the dead ones."""
    return [n for n in nodes if n.get("Alive", n.get("alive", False))]


def head_node(nodes: Iterable[Mapping[str, Any]]) -> str | None:
    """The head node's id (the router and a started etcd live there), or None."""
    for node in alive_nodes(nodes):
        if HEAD_RESOURCE in node.get("Resources", {}):
            return str(node["NodeID"])
    return None


def _fits(node: Mapping[str, Any], need: Mapping[str, float], times: int = 1) -> bool:
    have = node.get("Resources", {})
    return all(float(have.get(k, 0.0)) + 1e-9 >= v * times for k, v in need.items())


def problems(roles: Iterable[RolePlacement], nodes: Iterable[Mapping[str, Any]], strategy: str = "") -> list[str]:
    """Why no node of the cluster could ever hold these workers (each a sentence), or [].
    Judged on the nodes' total resources: what others use now is not seen here."""
    live = alive_nodes(nodes)
    out = []
    for role in roles:
        marked = [n for n in live if not role.node_resource or role.node_resource in n.get("Resources", {})]
        if not marked:
            out.append(f"no node offers the resource {role.node_resource!r} that --{role.role}-node-resource "
                       f"names (give nodes it: ray start --resources '{{\"{role.node_resource}\": 1}}')")
            continue
        need = role.resources()
        able = [n for n in marked if _fits(n, need)]
        if not able:
            out.append(f"no node{' with ' + repr(role.node_resource) if role.node_resource else ''} has what one "
                       f"{role.role} worker asks ({_resources_text(need, role.node_resource)})")
        elif strategy == "STRICT_SPREAD" and len(able) < role.count:
            out.append(f"STRICT_SPREAD puts each of {role.count} {role.role} workers on a node of its own, but "
                       f"{len(able)} node{'s' if len(able) != 1 else ''} can hold one")
        elif strategy == "STRICT_PACK" and not any(_fits(n, need, role.count) for n in able):
            out.append(f"STRICT_PACK puts all {role.count} {role.role} workers on one node, but no node has "
                       f"{role.count} times ({_resources_text(need, role.node_resource)})")
    return out


def _resources_text(need: Mapping[str, float], label: str) -> str:
    return ", ".join(f"{k} {v:g}" for k, v in need.items() if k != label)


def cluster_line(nodes: Iterable[Mapping[str, Any]]) -> str:
    """``3 nodes, 5 CPUs, 1 GPU`` for the launcher's first progress line."""
    live = alive_nodes(nodes)
    cpus = sum(float(n.get("Resources", {}).get("CPU", 0)) for n in live)
    gpus = sum(float(n.get("Resources", {}).get("GPU", 0)) for n in live)
    return (f"{len(live)} node{'s' if len(live) != 1 else ''}, {cpus:g} CPU{'s' if cpus != 1 else ''}, "
            f"{gpus:g} GPU{'s' if gpus != 1 else ''}")
