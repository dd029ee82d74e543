"""``kvxfer pair``: prefill worker, decode worker and router as processes, a workload, a check.

It starts ``kvxfer serve --role prefill``, ``kvxfer serve --role decode`` (NIXL; pools on
the GPU when CUDA is present, else in host memory) and ``kvxfer router`` as separate processes on this machine,
sends N prompts of mixed lengths through the router at the given concurrency, and checks
every completion token for token against colocated generation (prefill and decode in this
process, one pool; sampled with the same parameters under ``--temperature``). It prints a report (requests, tokens, TTFT and transfer time p50/p99,
GB/s, rows, failures) and writes it as JSON with ``--json PATH``; its phases (reference
outputs, workers coming up, requests done and failed so far) show on stderr unless ``--quiet``
(``kvxfer.progress``). Every process it started is stopped on success, on failure and on
Ctrl-C. Exit status 0 means every request completed and matched; 1 means some did not; 2
means the job could not run.

This module is the command; beside it: its engine-KV flags (``layouts``), what completions
are checked against (``oracle``), sampling flags (``sampling``), the store variant (``store``),
where a NIXL pull may run when its lane is TCP (``lanes``) and the results and report
(``report``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvxfer import cli
from kvxfer.engine import SamplingParams
from kvxfer.pair.lanes import Lanes, PullOnTcp, PullOverTcp, choose_mode, probe_lanes
from kvxfer.pair.layouts import (
    add_engine_kv_args,
    check_engine_kv_args,
    engine_kv_argv,
    engine_kv_report,
    engine_kv_wanted,
)
from kvxfer.pair.oracle import ReferenceOracle, TransformersOracle, add_engine_arg, check_engine_args
from kvxfer.pair.report import Result, engine_loop, integrity_refused, outcomes, print_report, summarize
from kvxfer.pair.sampling import add_sampling_args, check_sampling_args, per_request, sampling_report
from kvxfer.pair.store import (
    StoreSetup,
    add_store_args,
    check_store_args,
    check_store_devices,
    store_for,
    store_rows,
)
from kvxfer.progress import Count, Line, wait_announced
from kvxfer.progress import RequestProgress as Progress
from kvxfer.router.constants import KEEPALIVE_S
from kvxfer.serving.command import CommandParser
from kvxfer.serving.exchange import HttpError
from kvxfer.serving.keys import API_KEY_ENV, CLUSTER_KEY_ENV, BearerKey, InvalidKey
from kvxfer.serving.keys import headers as key_headers
from kvxfer.serving.startup import check_serving
from kvxfer.worker.config import integrity_state, layerwise_refusal
from kvxfer.worker.forked import fork_server_here, preload
from kvxfer.worker.procs import Child, ProcessFailed, ProcessGroup
from kvxfer.worker.serve import (
    ARENA_HELP,
    add_model_args,
    arena_mib,
    check_backend,
    check_model_args,
    check_visible,
    model_args_list,
    model_from_args,
    parse_device,
)

if TYPE_CHECKING:
    import torch

Oracle = ReferenceOracle | TransformersOracle


ROUTER_SILENCE_S = 6 * KEEPALIVE_S
"""How long the pair's client waits for any event of the router (a token, or its keepalive)."""


async def run_workload(router_url: str, prompts: list[list[int]], expected: list[list[int]], max_new: int,
                       concurrency: int, timeout: float, progress: Progress, api_key: BearerKey | None = None,
                       sampling: Sequence[SamplingParams] = ()) -> list[Result]:
    """Send every prompt through the router whose ``--timeout`` is ``timeout`` (with its API
    key, when it wants one), prompt i sampled as ``sampling[i]`` says (none: greedy)."""
    from kvxfer.serving.http import stream_json  # aiohttp: once the flags are checked

    sem = asyncio.Semaphore(concurrency)
    # The router may wait on its workers for minutes between two tokens (a stalled transfer,
    # then a recompute elsewhere) and ends such a wait itself; meanwhile it sends a "waiting"
    # event every KEEPALIVE_S, so only a router silent for several of those has hung.
    idle = ROUTER_SILENCE_S

    async def one(i: int) -> Result:
        async with sem:
            start = time.perf_counter()
            tokens: list[int] = []
            ttft = second = None
            completion: dict[str, Any] = {}
            error = None
            try:
                body = {"request": f"pair-{i}", "prompt": prompts[i], "max_new_tokens": max_new,
                        **(sampling[i].to_json() if sampling else {})}
                async for event in stream_json(router_url, "/generate", body, timeout, idle,
                                               headers=key_headers(api_key)):
                    if event.get("event") == "token":
                        if ttft is None:
                            ttft = time.perf_counter() - start  # as the client sees it
                        elif second is None:  # the decode worker's first: after the KV arrived
                            second = time.perf_counter() - start
                        tokens.append(int(event["token"]))
                    elif event.get("event") == "done":
                        completion = event["completion"]
            except HttpError as exc:
                error = f"router: {exc}"
            error = error or completion.get("error")
            result = Result(f"pair-{i}", len(prompts[i]), tokens, expected[i], ttft, time.perf_counter() - start,
                            completion.get("transfer"), completion.get("path", "?"), error,
                            list(completion.get("events", [])), second)
            progress.update(result)
            return result

    return list(await asyncio.gather(*(one(i) for i in range(len(prompts)))))


def build_parser() -> argparse.ArgumentParser:
    p = CommandParser(prog="kvxfer pair", description=__doc__.split("\n\n")[1].replace("\n", " "),
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--requests", type=int, default=20, help="prompts to send")
    p.add_argument("--min-len", type=int, default=8,
                   help="shortest prompt (tokens; a model with a tokenizer sends its fixed text prompts instead)")
    p.add_argument("--max-len", type=int, default=256, help="longest prompt (tokens; the toy model's random prompts)")
    p.add_argument("--max-new-tokens", type=int, default=32, help="tokens per completion")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--warmup", type=int, default=1,
                   help="requests sent (and checked) before the timed workload: the first transfer between two "
                        "agents sets up their connection, which is not what TTFT should show")
    p.add_argument("--prompt-seed", type=int, default=0, help="the toy model's random prompts")
    p.add_argument("--backend", default="nixl", choices=["nixl", "ipc", "ucx"])
    p.add_argument("--mode", default="push", choices=["push", "pull"])
    p.add_argument("--pull-on-tcp", default="push", choices=[x.value for x in PullOnTcp],
                   help="nixl pull: the lanes are probed first; when the pull lane is TCP, route to push "
                        "(if push is faster), keep pull with a warning, or fail")
    p.add_argument("--nixl-arena-mib", type=arena_mib, default=None, metavar="MIB", help=ARENA_HELP)
    p.add_argument("--busy-poll", action="store_true",
                   help="ipc: both workers spin while transfers wait; the decode worker offers a doorbell word "
                        "that the copy kernel sets (one busy core each)")
    p.add_argument("--integrity", choices=("on", "off"), default="on",
                   help="every worker's row digests (kvxfer serve --integrity): nixl and the store send and check "
                        "them; off only to measure the transport alone")
    p.add_argument("--inject-corruption", type=float, default=0.0, metavar="SHARE",
                   help="fault injection: the decode workers damage this share of the rows that land there before "
                        "their check (kvxfer serve --inject-corruption); with --on-failure recompute the output "
                        "must stay token-identical")
    p.add_argument("--lender", default="inplace", choices=["inplace", "staging"])
    p.add_argument("--layerwise", type=int, default=1, metavar="GROUPS",
                   help="every worker's kvxfer serve --layerwise: the model's layers cut into GROUPS groups, each "
                        "published by the prefill worker as its forward computes it (1: the whole request moves "
                        "after prefill)")
    p.add_argument("--prefill-workers", type=int, default=1)
    p.add_argument("--decode-workers", type=int, default=1)
    p.add_argument("--selection", default="round_robin", choices=["round_robin", "least_outstanding"])
    p.add_argument("--on-failure", default="fail", choices=["fail", "recompute"])
    p.add_argument("--blocks", type=int, default=2048, help="pool blocks per worker")
    p.add_argument("--timeout", type=float, default=60.0,
                   help="the router's and workers' seconds per call, transfer or stream event (the pair "
                        "waits for the router's events, keepalives included, up to 30 s each)")
    p.add_argument("--startup-timeout", type=float, default=180.0)
    p.add_argument("--json", default="", metavar="PATH", help="write the report as JSON")
    p.add_argument("--log-dir", default="", help="worker and router logs (default: a temporary directory)")
    p.add_argument("--quiet", action="store_true",
                   help="no progress lines on stderr (reference outputs, workers up, requests done)")
    p.add_argument("--prefill-device", default="",
                   help="the prefill workers' device (auto, cpu, cuda[:N]); empty: --device")
    p.add_argument("--decode-device", default="",
                   help="the decode workers' device, e.g. cuda:1 with --prefill-device cuda:0; empty: --device")
    add_engine_arg(p)
    add_engine_kv_args(p)
    add_sampling_args(p)
    add_store_args(p)
    add_model_args(p)
    return p


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse a workload that cannot run before any process starts (a usage error, exit 2)."""
    for flag, low in (("requests", 1), ("concurrency", 1), ("min_len", 1), ("max_new_tokens", 1),
                      ("prefill_workers", 1), ("decode_workers", 1), ("blocks", 1), ("warmup", 0)):
        if getattr(args, flag) < low:
            parser.error(f"--{flag.replace('_', '-')} must be at least {low}, got {getattr(args, flag)}")
    if args.min_len > args.max_len:
        parser.error(f"--min-len {args.min_len} is over --max-len {args.max_len}")
    check_layerwise(parser, args)
    if args.busy_poll and args.backend != "ipc":
        parser.error(f"--busy-poll applies to --backend ipc only, not {args.backend}")
    if args.nixl_arena_mib is not None and args.backend != "nixl":
        parser.error(f"--nixl-arena-mib applies to --backend nixl only, not {args.backend}")
    if not 0 <= args.inject_corruption <= 1:
        parser.error(f"--inject-corruption must be a share of rows from 0 to 1, got {args.inject_corruption}")
    if args.inject_corruption and args.integrity == "off":
        parser.error("--inject-corruption damages rows for the integrity check to catch: it needs --integrity on")
    for flag in ("timeout", "startup_timeout"):
        if not 0 < getattr(args, flag) < float("inf"):
            parser.error(f"--{flag.replace('_', '-')} must be positive and finite, got {getattr(args, flag)}")
    # The keys its workers and router take from the environment they inherit: one that
    # cannot be used is named now, not as a worker that failed to start.
    try:
        args.api_key = BearerKey.from_env(API_KEY_ENV)
        BearerKey.from_env(CLUSTER_KEY_ENV)
    except InvalidKey as exc:
        parser.error(str(exc))
    if args.json:
        # Checked now: the report is written only after the whole run.
        target = Path(args.json)
        if not target.parent.is_dir():
            parser.error(f"--json {args.json}: directory {target.parent} does not exist")
        if target.is_dir():
            parser.error(f"--json {args.json} is a directory; give a file path")
        if not os.access(target.parent, os.W_OK | os.X_OK):
            parser.error(f"--json {args.json}: directory {target.parent} is not writable")


def check_layerwise(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """--layerwise: a positive count, on what it can stream (its upper bound, the model's
    layers, is checked once the model is known)."""
    if args.layerwise < 1:
        parser.error(f"--layerwise must be a positive number of layer groups, got {args.layerwise}")
    if args.layerwise > 1 and engine_kv_wanted(args):
        parser.error(layerwise_refusal(args.layerwise, "engine_kv"))
    if args.layerwise > 1 and args.lender != "inplace":
        parser.error(layerwise_refusal(args.layerwise, "staging"))


def prompt_range(parser: argparse.ArgumentParser, args: argparse.Namespace, max_positions: int
                 ) -> tuple[int, str | None]:
    """The longest prompt the model holds with ``--max-new-tokens`` after it, and a note when
    that is shorter than ``--max-len``; a usage error when even ``--min-len`` does not fit."""
    longest = min(args.max_len, max_positions - args.max_new_tokens)
    if longest < args.min_len:
        parser.error(f"the model holds {max_positions} positions: prompts of at least --min-len "
                     f"{args.min_len} plus --max-new-tokens {args.max_new_tokens} do not fit")
    if longest == args.max_len:
        return longest, None
    return longest, (f"--max-len {args.max_len} capped to {longest}: the model holds {max_positions} positions "
                     f"and each completion takes --max-new-tokens {args.max_new_tokens}")


def role_devices(parser: argparse.ArgumentParser, args: argparse.Namespace) -> tuple[str, str]:
    """The prefill and decode workers' devices, resolved; a usage error naming the flags when a
    CUDA index is not visible, or when the workers and the oracle (on ``--device``) mix cpu and
    cuda: a transport moves rows between like memory, and the oracle's tokens are only a fair
    check on the same kind of device as the workers'."""
    given = [("the oracle", "--device", args.device),
             ("prefill", "--prefill-device" if args.prefill_device else "--device", args.prefill_device or args.device),
             ("decode", "--decode-device" if args.decode_device else "--device", args.decode_device or args.device)]
    devices: list[torch.device] = []
    problems: list[str] = []
    for _, flag, name in given:
        try:
            devices.append(parse_device(name, flag))
        except ValueError as exc:
            parser.error(str(exc))
    for (_, flag, _), device in zip(given, devices):
        try:
            check_visible(device, flag)
        except ValueError as exc:
            if str(exc) not in problems:  # a defaulted role repeats --device's problem
                problems.append(str(exc))
    if len({d.type for d in devices}) > 1:
        placed = ", ".join(f"{who} on {device} ({flag})" for (who, flag, _), device in zip(given, devices))
        problems.append(f"{placed} mix cpu and cuda: put both workers and the oracle on cpu, or all on cuda")
    if problems:
        parser.error("; ".join(problems))
    return str(devices[1]), str(devices[2])


def worker_args(args: argparse.Namespace) -> list[str]:
    """The ``kvxfer serve`` flags every worker of the pair gets (the model's come apart)."""
    out = ["--backend", args.backend, "--mode", args.mode, "--lender", args.lender, "--blocks",
           str(args.blocks), "--transfer-timeout", str(args.timeout), "--integrity", args.integrity,
           "--layerwise", str(args.layerwise)]
    if args.busy_poll:
        out.append("--busy-poll")
    if args.nixl_arena_mib is not None:
        out += ["--nixl-arena-mib", str(args.nixl_arena_mib)]
    return out


def _index(device: str) -> int:
    """A CUDA device's index for the lane probe (-1: cpu, or the current device)."""
    import torch

    d = torch.device(device)
    return d.index if d.type == "cuda" and d.index is not None else -1


class _CannotRun(Exception):
    """The pair cannot run as asked (exit 2); the text says why."""


def _route_mode(args: argparse.Namespace, prefill_device: str, decode_device: str) -> Lanes | None:
    """nixl pull: probe the lanes and set ``args.mode`` to the mode ``--pull-on-tcp`` picks;
    the lanes seen, or None where no probe is needed."""
    if args.backend != "nixl" or args.mode != "pull":
        return None
    # The workers' memory kind (role_devices keeps it one kind), and their GPUs: UCX's lane
    # between two GPUs is not the one within one (on an H200 pair: cuda_ipc against TCP).
    memory = "device" if prefill_device.startswith("cuda") else "host"  # role_devices resolved it
    try:
        lanes = probe_lanes(memory, args.startup_timeout, (_index(decode_device), _index(prefill_device)))
        args.mode, warning = choose_mode(args.mode, lanes, PullOnTcp(args.pull_on_tcp))
    except PullOverTcp as exc:
        raise _CannotRun(str(exc)) from exc
    except (RuntimeError, OSError, EOFError, subprocess.TimeoutExpired) as exc:
        why = (f"a probe process did not exit within {exc.timeout:g} s"
               if isinstance(exc, subprocess.TimeoutExpired) else str(exc))
        why = "; ".join([why, *getattr(exc, "__notes__", [])])  # where the probes' logs are
        raise _CannotRun(f"could not probe the NIXL lanes ({why}); refusing to run pull unchecked") from exc
    if warning:
        print(f"kvxfer pair: {warning}", file=sys.stderr, flush=True)
    return lanes


@dataclass(frozen=True)
class _Placement:
    """Where the pair runs: the workers' devices and the lanes a nixl pull was probed on."""

    prefill_device: str
    decode_device: str
    requested_mode: str
    lanes: Lanes | None


def _run_config(args: argparse.Namespace, oracle: Oracle, placed: _Placement, longest: int,
                log_dir: Path) -> dict[str, Any]:
    """The report's ``config``: what was asked for and what ran."""
    lanes, shape = placed.lanes, oracle.shape
    return {"engine": args.engine, "backend": args.backend, "busy_poll": args.busy_poll, "nixl_arena_mib": args.nixl_arena_mib,
            "mode": args.mode, "mode_requested": placed.requested_mode,
            "lanes": None if lanes is None else {"memory": lanes.memory, "push": list(lanes.push),
                                                 "pull": list(lanes.pull)},
            "lender": args.lender, "layerwise": args.layerwise,
            "integrity": integrity_state(args.backend, args.integrity == "on"),
            "inject_corruption": args.inject_corruption,
            "requests": args.requests,
            "prompt_lengths": [args.min_len, longest], "max_len_requested": args.max_len,
            "max_new_tokens": args.max_new_tokens,
            "concurrency": args.concurrency, "warmup": args.warmup, "prefill_workers": args.prefill_workers,
            "decode_workers": args.decode_workers, "selection": args.selection, "on_failure": args.on_failure,
            "model": f"{'' if args.model == 'toy' else args.model + ' '}{shape.layers}L/{shape.hidden}H/{shape.heads}h/"
                     f"{shape.kv_heads}kv/{shape.dtype} on {oracle.device}",
            "device": oracle.device, "prefill_device": placed.prefill_device,
            "decode_device": placed.decode_device,
            "model_config": shape.to_json(), "engine_kv": engine_kv_report(args),
            "sampling": sampling_report(args.sampling),
            "log_dir": str(log_dir)}


def _start_workers(group: ProcessGroup, args: argparse.Namespace, placed: _Placement,
                   store: StoreSetup | None) -> list[Child]:
    # The pair's router knows its workers by URL: no discovery, even where NIXL_ETCD_ENDPOINTS
    # is set (then the NIXL agents' metadata still goes through etcd), so that no other router
    # watching etcd picks these workers up.
    common = [*worker_args(args), *(store.argv if store is not None else ()), "--etcd", "", "--engine", args.engine,
              *(["--sliding-window", str(args.sliding_window)] if args.sliding_window else [])]
    role_args = {role: [*common, *engine_kv_argv(args, role), *model_args_list(args, device)]
                 for role, device in (("prefill", placed.prefill_device), ("decode", placed.decode_device))}
    corrupt = ["--inject-corruption", str(args.inject_corruption)] if args.inject_corruption else []
    # ipc's copy kernel damages the rows it moves, so its active end takes the hook: in push, the prefill workers.
    corrupt_prefill = corrupt if args.backend == "ipc" and args.mode == "push" else []
    workers = [group.start(f"prefill{i}", ["serve", "--role", "prefill", "--name", f"prefill{i}",
                                           *role_args["prefill"], *corrupt_prefill]) for i in range(args.prefill_workers)]
    workers += [group.start(f"decode{i}", ["serve", "--role", "decode", "--name", f"decode{i}",
                                          *role_args["decode"], *corrupt]) for i in range(args.decode_workers)]
    return workers


def _start_router(group: ProcessGroup, args: argparse.Namespace, workers: list[Child]) -> Child:
    router_argv = ["router", "--port", "0", "--selection", args.selection, "--on-failure", args.on_failure,
                   "--timeout", str(args.timeout), "--etcd", ""]
    for w in workers:
        router_argv += [f"--{w.info['role']}", w.url]
    router = group.start("router", router_argv)
    group.wait_ready([router], args.startup_timeout)
    return router


def _processes(group: ProcessGroup) -> list[dict[str, Any]]:
    # A worker's device is the one it announced: where its pool really is.
    return [{"name": ch.name, "pid": ch.pid, "port": ch.port}
            | ({"device": ch.info["device"]} if "device" in ch.info else {})
            for ch in group.children]


def _warm_up(url: str, prompts: list[list[int]], expected: list[list[int]], args: argparse.Namespace,
             line: Line) -> None:
    warm = asyncio.run(run_workload(url, prompts[: args.warmup], expected[: args.warmup], args.max_new_tokens, 1,
                                    args.timeout, Progress(args.warmup, line=line, label="warm-up requests"),
                                    args.api_key, args.samplings[: args.warmup]))
    bad = [r for r in warm if not r.matched]
    if bad:
        print(f"kvxfer pair: warm-up request failed: {bad[0].error or 'tokens differ'}", file=sys.stderr)


def _save_metrics(group: ProcessGroup, log_dir: Path) -> None:
    """Keep each process's metrics beside its log (the e2e test reads them)."""
    from kvxfer.serving.http import request_text

    for child in group.children:
        try:
            text = asyncio.run(request_text(child.url, "/metrics", 10.0))
            (log_dir / f"{child.name}.metrics").write_text(text)
        except HttpError as exc:
            print(f"kvxfer pair: no metrics from {child.name}: {exc}", file=sys.stderr)


def _run_pair(group: ProcessGroup, args: argparse.Namespace, oracle: Oracle, prompts: list[list[int]],
              placed: _Placement, config: dict[str, Any], log_dir: Path, store: StoreSetup | None = None,
              expected: list[list[int]] | None = None) -> tuple[list[Result], float, list[list[int]]]:
    """Start the workers and the router, send the workload through them; the results, the
    workload's wall time and the reference outputs (computed unless given). Adds the
    processes to ``config``."""
    line = Line("kvxfer pair", enabled=not args.quiet)
    with group:
        launched = time.perf_counter()
        workers = _start_workers(group, args, placed, store)
        if expected is None:  # the oracle runs while the workers start (they import torch and NIXL)
            expected = oracle.expected(prompts, args.max_new_tokens, line, len(workers), args.samplings)
        wait_announced(group, workers, args.startup_timeout,
                       Count(line, "starting workers", len(workers), "up", every_step=True, started=launched))
        router = _start_router(group, args, workers)
        config["processes"] = _processes(group)
        # Atomically: a reader (a test, a supervisor) may poll for the file and must never see half of it.
        staged = log_dir / "processes.json.tmp"
        staged.write_text(json.dumps(config["processes"]) + "\n")
        staged.replace(log_dir / "processes.json")
        line.say(f"router up at {router.url} (logs in {log_dir}); {args.requests} requests, "
                 f"concurrency {args.concurrency}")
        if args.warmup:
            _warm_up(router.url, prompts, expected, args, line)
        progress = Progress(len(prompts), line=line)
        start = time.perf_counter()
        results = asyncio.run(run_workload(router.url, prompts, expected, args.max_new_tokens,
                                           args.concurrency, args.timeout, progress, args.api_key, args.samplings))
        wall = time.perf_counter() - start
        _save_metrics(group, log_dir)
    return results, wall, expected


def _run_rounds(args: argparse.Namespace, oracle: Oracle, prompts: list[list[int]], placed: _Placement,
                config: dict[str, Any], log_dir: Path) -> tuple[list[Result], float, list[dict[str, Any]]]:
    """One instance, or with --store one per round on the same store: every round's results,
    their wall time together, and each round's store figures."""
    results: list[Result] = []
    wall, rounds, expected = 0.0, [], None
    with store_for(args) as store:
        for r in range(args.store_rounds):
            where = log_dir if args.store_rounds == 1 else log_dir / f"round{r + 1}"
            got, seconds, expected = _run_pair(ProcessGroup(where), args, oracle, prompts, placed, config, where,
                                               store, expected)
            results, wall = results + got, wall + seconds
            if store is not None:
                config["store"] = store.where
                rounds.append({"store_rows": store_rows(where), **outcomes(got)})
    return results, wall, rounds


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_args(parser, args)
    args.sampling = check_sampling_args(parser, args)
    args.samplings = per_request(args.sampling, args.requests)
    check_serving(parser, "127.0.0.1", 0)  # the hint key, which every worker would refuse
    check_backend(parser, args.backend, probe_cuda=False)  # CUDA itself only once the fork server is forked
    check_model_args(parser, args)
    check_engine_kv_args(parser, args)
    check_engine_args(parser, args)
    check_store_args(parser, args)
    prefill_device, decode_device = role_devices(parser, args)  # imports torch (auto: is CUDA there?)
    check_store_devices(parser, args, (prefill_device, decode_device))
    import torch  # every check is done: now the engine, the oracle and torch

    if args.engine == "transformers":
        preload("kvxfer.worker.hf_engine")  # transformers, imported once for every worker
    # Run as the command, the workers' fork server is this process as it is now (torch imported,
    # nothing run): torch is not imported again in a fresh one, and the first worker starts that
    # much sooner. Called by a script or a test, a fresh one: the caller's exit handlers and
    # finalizers (a script's TemporaryDirectory) must not run again in each worker.
    with fork_server_here() if cli.AS_COMMAND else contextlib.nullcontext():
        torch.set_num_threads(1)
        return _run_checked(parser, args, prefill_device, decode_device)


def _run_checked(parser: argparse.ArgumentParser, args: argparse.Namespace, prefill_device: str,
                 decode_device: str) -> int:
    """The pair once its flags are checked and torch imported: the oracle, the processes, the report."""
    from kvxfer.engine import text_samples

    check_backend(parser, args.backend)  # ipc asks CUDA now, after the workers' fork server was forked

    oracle: Oracle = TransformersOracle(args, args.blocks, prefill_device) if args.engine == "transformers" \
        else ReferenceOracle(model_from_args(args))
    if isinstance(oracle, TransformersOracle):
        oracle.convert_once(args.quiet)
    if args.layerwise > oracle.shape.layers:
        parser.error(f"--layerwise {args.layerwise} is more layer groups than the model has layers ({oracle.shape.layers})")
    longest, capped = prompt_range(parser, args, oracle.shape.max_positions)
    if capped:
        print(f"kvxfer pair: {capped}", file=sys.stderr, flush=True)
    prompts = oracle.prompts(args.requests, args.min_len, longest, args.prompt_seed)
    requested_mode = args.mode
    try:
        lanes = _route_mode(args, prefill_device, decode_device)
    except _CannotRun as exc:
        print(f"kvxfer pair: {exc}", file=sys.stderr)
        return 2
    placed = _Placement(prefill_device, decode_device, requested_mode, lanes)
    log_dir = Path(args.log_dir) if args.log_dir else Path(tempfile.mkdtemp(prefix="kvxfer-pair-"))
    config = _run_config(args, oracle, placed, longest, log_dir)
    try:
        results, wall, rounds = _run_rounds(args, oracle, prompts, placed, config, log_dir)
    except KeyboardInterrupt:
        print("\nkvxfer pair: interrupted; every process it started is stopped", file=sys.stderr)
        return 130
    except ProcessFailed as exc:
        print(f"kvxfer pair: {exc}", file=sys.stderr)
        return 2
    report = summarize(results, wall, config)
    report["integrity_rows_refused"] = integrity_refused(log_dir)
    report["engine_loop"] = engine_loop(log_dir)
    if args.colocated_baseline and isinstance(oracle, TransformersOracle):
        report["colocated"] = oracle.baseline(prompts, args.max_new_tokens, args.concurrency)
    if rounds:
        report["store_rounds"] = rounds
    if oracle.tokenizer is not None:
        report["samples"] = text_samples(oracle.tokenizer, prompts, [r.tokens for r in results])
    print_report(report)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0 if report["matched"] == report["requests"] else 1

