"""``kvxfer launch``: prefill workers, decode workers and the router as actors of a Ray cluster.

    kvxfer launch --address auto --prefill 2 --decode 1 --prefill-gpus 1 --decode-gpus 1 \\
        --prefill-node-resource prefill_node --decode-node-resource decode_node \\
        --placement-group STRICT_PACK -- --model smollm2 --backend nixl

Each worker is an actor running ``kvxfer serve`` on its node's address, registered in etcd;
the router is an actor on the head node that follows etcd. The flags after ``--`` go to every
worker's ``kvxfer serve`` (the model, the backend, ...). Once every worker is up and the router
lists them all, one JSON line on stdout says where the router and each actor are; progress
goes to stderr. SIGINT or SIGTERM stops every actor's processes, then disconnects. Exit status:
0 after a stop asked for, 1 when the router or etcd died, 2 when the launch could not start,
130 when interrupted while starting.
"""

from __future__ import annotations

import argparse
import logging
import os
import secrets
import signal
import sys
from types import FrameType
from typing import Any

from kvxfer.etcd import etcd_endpoints
from kvxfer.launch.placement import STRATEGIES, RolePlacement
from kvxfer.progress import Line
from kvxfer.serving.announce import announce, reserve_stdout
from kvxfer.serving.command import CommandParser
from kvxfer.serving.keys import API_KEY_ENV, CLUSTER_KEY_ENV, BearerKey, InvalidKey
from kvxfer.wire import ENV_KEY as HINT_KEY_ENV

INSTALL_HINT = "pip install 'kvxfer[ray]'"
FORWARDED_ENV = (HINT_KEY_ENV, CLUSTER_KEY_ENV, API_KEY_ENV)
"""Variables of the launcher's environment that every actor's process gets (workers must share
the keys). Without a cluster key, the launcher makes one for the launch: its workers listen on
their nodes' addresses, and never without a key."""
OWNED = {"role": "--prefill/--decode", "host": "(each worker's node address)", "port": "(0: each picks one)",
         "port_file": "(the actor reads it)", "name": "(prefill0, decode0, ...)", "parent_watch": "(always on)",
         "etcd": "--etcd", "etcd_namespace": "--namespace", "etcd_ttl": "--etcd-ttl"}
"""kvxfer serve flags the launcher sets itself, and where to set them instead."""


class _Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM: stop every actor, then exit."""


def build_parser() -> argparse.ArgumentParser:
    p = CommandParser(prog="kvxfer launch", description=__doc__.split("\n\n")[2].replace("\n", " "),
                                usage="kvxfer launch [options] [-- kvxfer serve flags for every worker]",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--address", default="auto",
                   help="the Ray cluster: auto (the one this node belongs to, or $RAY_ADDRESS), HOST:PORT of its "
                        "GCS, ray://HOST:10001 (Ray Client), or local (start a one-node Ray here)")
    p.add_argument("--namespace", default="kvxfer",
                   help="the Ray namespace of the actors (prefill0, decode0, router, etcd) and the etcd namespace "
                        "the workers register in: one launch per namespace")
    for role in ("prefill", "decode"):
        g = p.add_argument_group(f"{role} workers")
        g.add_argument(f"--{role}", type=int, default=1, metavar="N", help=f"{role} workers")
        g.add_argument(f"--{role}-gpus", type=float, default=0.0, metavar="G",
                       help="GPUs per worker (Ray's num_gpus; a fraction shares one); the worker's process sees "
                            "exactly those (CUDA_VISIBLE_DEVICES) and runs on cuda:0, or on cpu with 0")
        g.add_argument(f"--{role}-cpus", type=float, default=1.0, metavar="C", help="CPUs per worker (Ray's num_cpus)")
        g.add_argument(f"--{role}-node-resource", default="", metavar="NAME",
                       help="only on nodes that offer this custom resource (ray start --resources "
                            "'{\"NAME\": 1}'); each worker takes a 0.001 share: it marks nodes, it does not count")
    g = p.add_argument_group("placement and discovery")
    g.add_argument("--placement-group", default="", choices=["", *STRATEGIES], metavar="STRATEGY",
                   help=f"one placement group per role, a bundle per worker, reserved before any starts: "
                        f"{', '.join(STRATEGIES)} (empty: Ray places each worker alone)")
    g.add_argument("--placement-timeout", type=float, default=60.0, help="seconds to wait for a placement group")
    g.add_argument("--etcd", default="start", metavar="start|URL",
                   help="etcd for discovery: start one as an actor on the head node (the etcd binary must be there), "
                        "or http://HOST:PORT[,...] of one every node reaches")
    g.add_argument("--etcd-ttl", type=int, default=10, metavar="S",
                   help="a worker's lease: how long the router keeps a worker that died without stopping")
    g = p.add_argument_group("router (an actor on the head node)")
    g.add_argument("--router-port", type=int, default=8000, help="0: any free port (the ready line says which)")
    g.add_argument("--router-host", default="", help="the address it binds (default: the head node's address)")
    g.add_argument("--selection", default="round_robin", choices=["round_robin", "least_outstanding"])
    g.add_argument("--on-failure", default="fail", choices=["fail", "recompute"])
    g.add_argument("--router-timeout", type=float, default=30.0, help="the router's --timeout")
    g = p.add_argument_group("the launcher")
    g.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                   help="set in every actor's process (repeat); KVXFER_HINT_KEY, KVXFER_CLUSTER_KEY and "
                        "KVXFER_API_KEY are passed on when set here (without a cluster key, one is made for "
                        "the launch)")
    g.add_argument("--log-dir", default="",
                   help="each process's log on its node (default: TMPDIR/kvxfer-launch/NAMESPACE on each node)")
    g.add_argument("--startup-timeout", type=float, default=180.0, help="seconds for each phase to come up")
    g.add_argument("--check-interval", type=float, default=2.0, help="seconds between checks that actors live")
    g.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    return p


def split_argv(argv: list[str]) -> tuple[list[str], list[str]]:
    """The launcher's own flags, and the ``kvxfer serve`` flags after ``--``."""
    if "--" in argv:
        i = argv.index("--")
        return argv[:i], argv[i + 1:]
    return argv, []


class _Refused(Exception):
    pass


def check_worker_argv(worker_argv: list[str]) -> set[str]:
    """Parse the worker flags as ``kvxfer serve`` would (ValueError with its message); the
    destinations they set. Imports the worker's module (torch), once, in the launcher."""
    from kvxfer.worker.serve import build_parser as serve_parser  # noqa: PLC0415

    parser = serve_parser()
    for action in parser._actions:  # only what the flags set comes back
        action.default = argparse.SUPPRESS
        action.required = False

    def refuse(message: str) -> None:
        raise _Refused(message)

    parser.error = refuse  # type: ignore[method-assign,assignment]
    try:
        given = vars(parser.parse_args(worker_argv))
    except _Refused as exc:
        raise ValueError(str(exc)) from None
    except SystemExit:  # --help after --
        raise ValueError("kvxfer serve --help lists the worker flags") from None
    return set(given)


def config_from(parser: argparse.ArgumentParser, args: argparse.Namespace, worker_argv: list[str]) -> Any:
    """The LaunchConfig the flags describe; usage errors (exit 2) name the flag."""
    from kvxfer.launch.launcher import LaunchConfig  # noqa: PLC0415 - imports ray

    roles = []
    for role in ("prefill", "decode"):
        try:
            roles.append(RolePlacement(role, getattr(args, role), getattr(args, f"{role}_cpus"),
                                       getattr(args, f"{role}_gpus"), getattr(args, f"{role}_node_resource")))
        except ValueError as exc:
            parser.error(str(exc))
    _check_numbers(parser, args)
    try:
        given = check_worker_argv(worker_argv)
    except ValueError as exc:
        parser.error(f"the worker flags after --: {exc}")
    owned = sorted(k for k in given if k in OWNED)
    if owned:
        parser.error("the worker flags after -- set what the launcher sets: "
                     + ", ".join(f"--{k.replace('_', '-')} {OWNED[k]}" for k in owned))
    return LaunchConfig(namespace=args.namespace, prefill=roles[0], decode=roles[1], strategy=args.placement_group,
                        etcd=args.etcd, etcd_ttl=args.etcd_ttl, router_port=args.router_port,
                        router_host=args.router_host, router_argv=router_argv(args), worker_argv=worker_argv,
                        set_device="device" not in given, env=actor_env(parser, args.env), log_dir=args.log_dir,
                        startup_timeout=args.startup_timeout, placement_timeout=args.placement_timeout)


def _check_numbers(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    from kvxfer.serving.discovery import namespace_from  # noqa: PLC0415

    try:
        namespace_from(args.namespace)
    except ValueError as exc:
        parser.error(f"--namespace: {exc}")
    if args.etcd != "start":
        try:
            if not etcd_endpoints(args.etcd):
                parser.error("--etcd: give start, or http://HOST:PORT")
        except ValueError as exc:
            parser.error(f"--etcd: {exc}")
    if args.etcd_ttl < 2:
        parser.error(f"--etcd-ttl must be at least 2 s, got {args.etcd_ttl}")
    if not 0 <= args.router_port <= 65535:
        parser.error(f"--router-port must be 0 to 65535, got {args.router_port}")
    for flag in ("placement_timeout", "startup_timeout", "check_interval", "router_timeout"):
        if not getattr(args, flag) > 0:
            parser.error(f"--{flag.replace('_', '-')} must be positive, got {getattr(args, flag)}")


def router_argv(args: argparse.Namespace) -> list[str]:
    return ["--selection", args.selection, "--on-failure", args.on_failure, "--timeout", str(args.router_timeout)]


def actor_env(parser: argparse.ArgumentParser, pairs: list[str]) -> dict[str, str]:
    """What every actor's process gets: FORWARDED_ENV, then ``--env``; a cluster key, made now
    when neither gave one. A key that cannot be used is a usage error, naming where it came from."""
    env = {k: os.environ[k] for k in FORWARDED_ENV if k in os.environ}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not name:
            parser.error(f"--env {pair!r}: give NAME=VALUE")
        env[name] = value
    try:
        if BearerKey.from_env(CLUSTER_KEY_ENV, env) is None:
            env[CLUSTER_KEY_ENV] = secrets.token_hex(32)
        BearerKey.from_env(API_KEY_ENV, env)
    except InvalidKey as exc:
        parser.error(str(exc))
    return env


def key_made(env_flags: list[str]) -> bool:
    """Whether the launch makes its own cluster key (none in the environment or ``--env``)."""
    given = {k: v for k, _, v in (p.partition("=") for p in env_flags)}
    return not (given.get(CLUSTER_KEY_ENV) or os.environ.get(CLUSTER_KEY_ENV, "")).strip()


def _ray_address(address: str) -> str | None:
    return None if address == "local" else address


class _Signals:
    """SIGINT and SIGTERM raise ``_Interrupted`` once; while stopping, a second one is only noted."""

    def __init__(self, line: Line) -> None:
        self.line = line
        self.stopping = False
        self.received = ""  # the signal's name, once one came
        self.old = {s: signal.signal(s, self._handle) for s in (signal.SIGINT, signal.SIGTERM)}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.stopping:
            self.line.say(f"{signal.Signals(signum).name}: already stopping every actor")
            return
        self.stopping = True
        self.received = signal.Signals(signum).name
        raise _Interrupted(self.received)

    def restore(self) -> None:
        for s, handler in self.old.items():
            signal.signal(s, handler)


def main(argv: list[str] | None = None) -> int:
    own, worker_argv = split_argv(list(sys.argv[1:] if argv is None else argv))
    parser = build_parser()
    args = parser.parse_args(own)
    try:
        import ray  # noqa: PLC0415, F401 - the extra
    except ImportError:
        print(f"kvxfer launch: Ray is not installed: {INSTALL_HINT}", file=sys.stderr)
        return 2
    config = config_from(parser, args, worker_argv)
    ready_fd = reserve_stdout()  # stdout holds the ready line alone: what Ray prints goes to stderr
    line = Line("kvxfer launch", enabled=not args.quiet)
    if key_made(args.env):
        line.say(f"the workers take a cluster key made for this launch (set {CLUSTER_KEY_ENV} to choose it, "
                 "and to reach them yourself)")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    line.say(f"connecting to Ray ({args.address})")
    try:
        ray.init(address=_ray_address(args.address), namespace=config.namespace, log_to_driver=False,
                 logging_level=logging.WARNING, include_dashboard=False if args.address == "local" else None)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        print(f"kvxfer launch: cannot connect to Ray at {args.address}: {exc}", file=sys.stderr)
        return 2
    signals = _Signals(line)
    try:
        return _run(config, line, signals, args.check_interval, ready_fd)
    finally:
        signals.restore()
        ray.shutdown()


def _run(config: Any, line: Line, signals: _Signals, interval: float, ready_fd: int) -> int:
    from kvxfer.launch.launcher import Launch, LaunchError  # noqa: PLC0415

    launch = Launch(config, line)
    serving = False
    try:
        launch.start()
        serving = True  # before the ready line: a stop asked for as soon as it is read is a clean one
        announce(launch.describe(), "", ready_fd)
        line.say(f"serving at {launch.router_url}; SIGINT or SIGTERM stops every actor")
        return launch.serve(interval)
    except KeyboardInterrupt:  # _Interrupted, or what Ray makes of it inside ray.wait/ray.get
        line.say(f"{signals.received or 'interrupted'}: stopping every actor")
        return 0 if serving else 130
    except LaunchError as exc:
        print(f"kvxfer launch: {exc}", file=sys.stderr, flush=True)
        return 2
    finally:
        signals.stopping = True
        launch.stop()


if __name__ == "__main__":
    sys.exit(main())
