"""``kvxfer pair``'s sampling flags: sampled requests, each checked against the oracle
sampling with the same parameters.

    kvxfer pair --temperature 0.8 --sampling-seed 7 --top-p 0.95 --top-k 50

Request ``i`` (its warm-up repeat too) samples with seed ``--sampling-seed + i``, so the
completions differ from each other and the run is the same each time; without
``--sampling-seed`` the base is random and the report names it. (``--seed`` stays the toy
model's weight seed, as for ``kvxfer serve``.) ``--temperature 0``, the default, is greedy.
"""

from __future__ import annotations

import argparse
import dataclasses
import secrets
from typing import Any

from kvxfer.engine.sampling import InvalidSampling, SamplingParams


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling (each request checked against the oracle sampling the same way)")
    g.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0, help="0: no top-k")
    g.add_argument("--sampling-seed", type=int, default=None, metavar="S",
                   help="request i samples with seed S + i (default: a random S, named in the report)")


def check_sampling_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> SamplingParams:
    """The workload's sampling (its seed the base of the requests'); a usage error naming the flag."""
    try:
        params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                                seed=args.sampling_seed)
    except InvalidSampling as exc:
        flag = "--sampling-seed" if exc.field == "seed" else f"--{exc.field.replace('_', '-')}"
        parser.error(f"{flag}: {str(exc).split(' ', 1)[1]}")
    if params.greedy and (args.top_p != 1.0 or args.top_k or args.sampling_seed is not None):
        parser.error("--top-p, --top-k and --sampling-seed need --temperature above 0 (0 is greedy)")
    if not params.greedy and params.seed is None:
        params = dataclasses.replace(params, seed=secrets.randbits(62))
    if params.seed is not None and params.seed + args.requests >= 2 ** 64:
        parser.error(f"--sampling-seed {params.seed} plus --requests {args.requests} passes 2**64")
    return params


def per_request(params: SamplingParams, count: int) -> list[SamplingParams]:
    """Each request's parameters: the base seed plus its index (greedy: all alike)."""
    if params.greedy or params.seed is None:
        return [params] * count
    return [dataclasses.replace(params, seed=params.seed + i) for i in range(count)]


def sampling_report(params: SamplingParams) -> dict[str, Any]:
    """The report's ``config.sampling``: "greedy", or the parameters with the base seed."""
    return {"greedy": True} if params.greedy else {"greedy": False, **params.to_json()}


def sampling_line(sampling: dict[str, Any] | None) -> list[str]:
    if not sampling:
        return []
    if sampling.get("greedy", True):
        return ["  sampling     greedy"]
    shown = ", ".join(f"{k} {v}" for k, v in sampling.items() if k not in ("greedy", "seed"))
    return [f"  sampling     {shown}, seeds {sampling['seed']} + request index (the oracle samples the same)"]
