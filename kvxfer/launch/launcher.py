"""Place and start the actors of ``kvxfer launch`` on a connected Ray cluster, watch them, stop them.

``Launch(config, line).start()`` runs, in phases (a progress line each):

1. checks the placement against the cluster's nodes (``placement.problems``);
2. etcd: the one ``--etcd`` names, or one started as an actor on the head node;
3. with a placement-group strategy, one placement group per role, waited for as a whole;
4. the workers, one actor each (``KvxferProcess`` running ``kvxfer serve ... --etcd``), all
   started at once and counted as they come up;
5. the router, an actor pinned to the head node, following etcd; then it waits until the router
   lists every worker.

``watch()`` asks each actor whether it and its process live: a worker that is gone is reported
once and not restarted (the router drops it when its etcd lease lapses, or at once when it
stopped gracefully); the router or etcd gone ends the launch. ``stop()`` stops the router, then
the workers (they take themselves out of etcd), then etcd, each actor ending its process tree,
and kills the actors and removes the placement groups. Ray is imported here, not at import time
of the package.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayError
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from kvxfer.contract import KvxferError
from kvxfer.launch.actors import STOP_GRACE_S, EtcdProcess, KvxferProcess, default_log_dir
from kvxfer.launch.placement import RolePlacement, cluster_line, head_node, problems
from kvxfer.progress import Count, Line

ACTOR_CONCURRENCY = 4
"""Calls an actor serves at once: ``stop()`` must not wait behind a ``ready()`` still waiting."""
_ANSWER_S = 10.0


class LaunchError(KvxferError):
    """The launch cannot go on; the message says why (and where the log is)."""


@dataclass
class LaunchConfig:
    namespace: str
    prefill: RolePlacement
    decode: RolePlacement
    strategy: str = ""                      # "" (each actor placed alone) or a placement-group strategy
    etcd: str = "start"                     # "start", or the endpoints workers and router use
    etcd_ttl: int = 10
    router_port: int = 8000
    router_host: str = ""                   # "": the head node's address
    router_argv: list[str] = field(default_factory=list)
    worker_argv: list[str] = field(default_factory=list)
    set_device: bool = True                 # --device from the GPUs Ray gives (unless the worker flags name one)
    env: dict[str, str] = field(default_factory=dict, repr=False)  # holds keys: in no repr
    log_dir: str = ""
    startup_timeout: float = 180.0
    placement_timeout: float = 60.0
    stop_timeout: float = 10.0

    @property
    def roles(self) -> tuple[RolePlacement, RolePlacement]:
        return self.prefill, self.decode


@dataclass
class Member:
    name: str
    role: str                               # prefill, decode, router, etcd
    actor: Any
    info: dict[str, Any] = field(default_factory=dict)
    gone: str = ""                          # why it is gone, once it is


class Launch:
    def __init__(self, config: LaunchConfig, line: Line) -> None:
        self.config = config
        self.line = line
        self.members: dict[str, Member] = {}
        self.groups: list[Any] = []
        self.etcd_url = config.etcd if config.etcd != "start" else ""
        self.router_url = ""

    # --- start --------------------------------------------------------------------------------
    def start(self) -> None:
        nodes = ray.nodes()
        found = problems(self.config.roles, nodes, self.config.strategy)
        if found:
            raise LaunchError("the cluster cannot hold this launch: " + "; ".join(found))
        head = head_node(nodes)
        if head is None:
            raise LaunchError("no live head node in ray.nodes(): the router and etcd are pinned there")
        self.line.say(f"connected to Ray: {cluster_line(nodes)}; head node {head[:8]}; "
                      + ", ".join(r.describe() for r in self.config.roles))
        self._check_names()
        pinned = NodeAffinitySchedulingStrategy(node_id=head, soft=False)
        if self.config.etcd == "start":
            self._start_etcd(pinned)
        strategies = self._placement_groups()
        self._start_workers(strategies)
        self._start_router(pinned)
        self._wait_members()

    def _check_names(self) -> None:
        """Refuse a namespace where actors of these names run (another launch), before anything starts."""
        names = (["etcd"] if self.config.etcd == "start" else []) + [n for r in self.config.roles for n in r.names()]
        for name in [*names, "router"]:
            try:
                ray.get_actor(name)
            except ValueError:
                continue
            raise LaunchError(f"an actor named {name!r} already runs in Ray namespace {self.config.namespace!r} "
                              "(another kvxfer launch?): stop it, or pass another --namespace")

    def _new(self, cls: type, name: str, role: str, options: dict[str, Any], *args: Any, **kwargs: Any) -> Member:
        runtime_env = {"env_vars": dict(self.config.env)} if self.config.env else None
        handle: Any = ray.remote(cls).options(name=name, max_concurrency=ACTOR_CONCURRENCY, max_restarts=0,
                                              runtime_env=runtime_env, **options).remote(*args, **kwargs)
        member = Member(name, role, handle)
        self.members[name] = member
        return member

    def _log_dir(self) -> str:
        return self.config.log_dir or str(default_log_dir(self.config.namespace))

    def _start_etcd(self, pinned: Any) -> None:
        member = self._new(EtcdProcess, "etcd", "etcd", {"num_cpus": 0, "scheduling_strategy": pinned},
                           "etcd", log_dir=self._log_dir())
        self._await([member], "starting etcd on the head node")
        self.etcd_url = member.info["url"]

    def _placement_groups(self) -> dict[str, list[Any]]:
        """Per role, each worker's scheduling strategy (None: Ray places it alone)."""
        strategy = self.config.strategy
        if not strategy:
            return {r.role: [None] * r.count for r in self.config.roles}
        for role in self.config.roles:
            self.groups.append(placement_group([role.bundle()] * role.count, strategy=strategy,
                                               name=f"{self.config.namespace}-{role.role}"))
        out = {}
        for role, group in zip(self.config.roles, self.groups):
            try:
                ray.get(group.ready(), timeout=self.config.placement_timeout)
            except GetTimeoutError:
                raise LaunchError(f"the {role.role} placement group ({strategy}, {role.count} bundles of "
                                  f"{role.bundle()}) was not placed within {self.config.placement_timeout:g} s: "
                                  "the cluster lacks those resources now (ray status shows what is used)") from None
            out[role.role] = [PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=i)
                              for i in range(role.count)]
        self.line.say(f"placement groups ready ({strategy}): "
                      + ", ".join(f"{r.role} {r.count} x {r.bundle()}" for r in self.config.roles))
        return out

    def worker_argv(self, role: str, name: str) -> list[str]:
        c = self.config
        return ["serve", "--role", role, "--name", name, "--etcd", self.etcd_url, "--etcd-namespace", c.namespace,
                "--etcd-ttl", str(c.etcd_ttl), *c.worker_argv]

    def _start_workers(self, strategies: dict[str, list[Any]]) -> None:
        started = []
        for role in self.config.roles:
            for name, strategy in zip(role.names(), strategies[role.role]):
                options = role.actor_options() | ({"scheduling_strategy": strategy} if strategy is not None else {})
                started.append(self._new(KvxferProcess, name, role.role, options, name,
                                         self.worker_argv(role.role, name), log_dir=self._log_dir(),
                                         set_device=self.config.set_device))
        self._await(started, "starting workers")

    def _start_router(self, pinned: Any) -> None:
        c = self.config
        argv = ["router", "--etcd", self.etcd_url, "--etcd-namespace", c.namespace, *c.router_argv]
        member = self._new(KvxferProcess, "router", "router", {"num_cpus": 0, "scheduling_strategy": pinned},
                           "router", argv, log_dir=self._log_dir(), port=c.router_port, host=c.router_host)
        self._await([member], "starting the router on the head node")
        self.router_url = member.info["url"]

    def _await(self, members: list[Member], label: str) -> None:
        """Wait for every member's ``ready()``, counting each as it comes; LaunchError at the first
        that fails, or when some are not ready (nor placed) within the startup timeout."""
        count = Count(self.line, label, len(members), "up", every_step=True)
        pending = {m.actor.ready.remote(self.config.startup_timeout): m for m in members}
        deadline = time.monotonic() + self.config.startup_timeout + _ANSWER_S
        while pending:
            done, _ = ray.wait(list(pending), num_returns=1, timeout=max(deadline - time.monotonic(), 0.0))
            if not done:
                late = ", ".join(m.name for m in pending.values())
                raise LaunchError(f"{late} not up within {self.config.startup_timeout:g} s: not placed (the cluster "
                                  "lacks what they ask, see ray status) or still starting")
            member = pending.pop(done[0])
            try:
                info = ray.get(done[0])
            except RayError as exc:
                raise LaunchError(f"{member.name}'s actor died before it was ready: {_first_line(exc)}") from None
            if not info.get("ok"):
                raise LaunchError(str(info.get("error")))
            member.info = {"role": member.role, **info}
            gpus = f", GPUs {info['cuda_visible_devices']}" if info.get("cuda_visible_devices") else ""
            count.advance(f"{member.name} on node {str(info.get('node_id'))[:8]} at {info.get('url')}{gpus}")

    def _wait_members(self) -> None:
        """Until the router lists every worker (it learns them from etcd)."""
        router = self.members["router"]
        want = {m.info["url"] for m in self.workers()}
        deadline = time.monotonic() + self.config.startup_timeout
        seen: set[str] = set()
        while time.monotonic() < deadline:
            try:
                health = ray.get(router.actor.health.remote(), timeout=_ANSWER_S)
            except GetTimeoutError:
                continue
            except RayError as exc:
                raise LaunchError(f"the router's actor died: {_first_line(exc)}") from None
            body = health.get("body") or {}
            seen = set((body.get("discovery") or {}).get("members", {}).values())
            if want <= seen and body.get("status") == "ok":
                self.line.say(f"router at {self.router_url} lists {len(want)} workers (etcd {self.etcd_url}, "
                              f"namespace {self.config.namespace!r})")
                return
            time.sleep(0.2)
        missing = ", ".join(sorted(want - seen)) or "none"
        raise LaunchError(f"the router lists {len(want & seen)} of {len(want)} workers after "
                          f"{self.config.startup_timeout:g} s (missing: {missing}); its log: "
                          f"{router.info.get('log')}")

    # --- while it serves ------------------------------------------------------------------------
    def workers(self) -> list[Member]:
        return [m for m in self.members.values() if m.role in ("prefill", "decode")]

    def describe(self) -> dict[str, Any]:
        """The ready line: the router's URL, etcd, and where every actor runs."""
        return {"event": "ready", "router": self.router_url, "etcd": self.etcd_url,
                "namespace": self.config.namespace, "strategy": self.config.strategy or None,
                "actors": [m.info for m in self.members.values()]}

    def watch(self) -> str | None:
        """Ask every live actor whether it and its process run; report each that is gone, once.
        Why the launch must end (the router or etcd is gone), or None."""
        live = [m for m in self.members.values() if not m.gone]
        refs = {m.actor.alive.remote(): m for m in live}
        if not refs:
            return "every actor is gone"
        done, _ = ray.wait(list(refs), num_returns=len(refs), timeout=_ANSWER_S)
        for ref in done:
            member = refs[ref]
            try:
                state = ray.get(ref)
            except RayError as exc:
                self._gone(member, f"its actor died ({_first_line(exc)})")
                continue
            if not state.get("alive"):
                self._gone(member, f"its process exited with {state.get('code')} (log {member.info.get('log')})")
        ended = [m for m in self.members.values() if m.gone and m.role in ("router", "etcd")]
        return f"the {ended[0].name} is gone: {ended[0].gone}" if ended else None

    def _gone(self, member: Member, why: str) -> None:
        member.gone = why
        where = f"{member.info.get('url', '?')}, node {str(member.info.get('node_id', '?'))[:8]}"
        after = ""
        if member.role in ("prefill", "decode"):
            after = (f"; not restarted: the router drops it when its etcd lease lapses (within "
                     f"{self.config.etcd_ttl} s), or at once if it stopped cleanly")
        self.line.say(f"{member.name} ({where}) is gone: {why}{after}")

    def serve(self, interval: float) -> int:
        """Watch until the router or etcd is gone (1); interrupted by the caller's signals."""
        while True:
            time.sleep(interval)
            ended = self.watch()
            if ended:
                self.line.say(f"{ended}: stopping")
                return 1

    # --- stop ---------------------------------------------------------------------------------
    def stop(self) -> dict[str, Any]:
        """Router, workers, etcd: each ends its process tree; then the actors are killed and the
        placement groups removed. What each stop returned (an exit code, or why it could not)."""
        if not self.members and not self.groups:
            return {}
        order = [[m for m in self.members.values() if m.role == "router"], self.workers(),
                 [m for m in self.members.values() if m.role == "etcd"]]
        self.line.say(f"stopping {len(self.members)} actors (router, workers, etcd)")
        codes: dict[str, Any] = {}
        for batch in order:
            codes.update(self._stop_batch(batch))
        for member in self.members.values():
            try:
                ray.kill(member.actor, no_restart=True)
            except (RayError, ValueError):
                pass
        for group in self.groups:
            try:
                remove_placement_group(group)
            except (RayError, ValueError):
                pass
        self.members.clear()
        self.groups.clear()
        self.line.say("stopped: " + ", ".join(f"{k} {v}" for k, v in codes.items()))
        return codes

    def _stop_batch(self, batch: list[Member]) -> dict[str, Any]:
        timeout = self.config.stop_timeout
        refs = {m.actor.stop.remote(timeout): m for m in batch if not m.gone}
        codes: dict[str, Any] = {m.name: "gone" for m in batch if m.gone}
        if not refs:
            return codes
        done, late = ray.wait(list(refs), num_returns=len(refs), timeout=STOP_GRACE_S + 2 * timeout + _ANSWER_S)
        for ref in done:
            try:
                codes[refs[ref].name] = ray.get(ref)
            except RayError as exc:
                codes[refs[ref].name] = f"actor gone ({_first_line(exc)})"
        for ref in late:
            codes[refs[ref].name] = "no answer (killed)"
        return codes


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:300] if text else type(exc).__name__
