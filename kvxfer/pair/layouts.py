"""``kvxfer pair``'s engine-KV flags: each end's TP, block size and layout.

    kvxfer pair --prefill-tp 1 --prefill-kv-block-tokens 16 --prefill-kv-layout layer_major \\
                --decode-tp 2 --decode-kv-block-tokens 32

Any of them makes both ends TP groups moving engine geometries (``kvxfer serve --engine-kv``,
``kvxfer.worker.ranks``); the decode workers learn the prefill workers' TP (``--peer-tp``).
A TP group shares no prompt prefixes and lends in place, so those options are refused with
it, by name, before any process starts.
"""

from __future__ import annotations

import argparse
from typing import Any

ROLES = ("prefill", "decode")
LAYOUTS = ("block_major", "layer_major")


def add_engine_kv_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine KV: each end's TP group, block size and layout (any of these implies it)")
    for role in ROLES:
        g.add_argument(f"--{role}-tp", type=int, default=0, help=f"{role} workers' tensor-parallel ranks (0: 1)")
        g.add_argument(f"--{role}-kv-block-tokens", type=int, default=0,
                       help=f"{role} workers' tokens per KV block (0: the model's)")
        g.add_argument(f"--{role}-kv-layout", default="", choices=["", *LAYOUTS],
                       help=f"{role} workers' KV order (empty: block_major)")


def engine_kv_wanted(args: argparse.Namespace) -> bool:
    return any(getattr(args, f"{role}_{flag}") for role in ROLES for flag in ("tp", "kv_block_tokens", "kv_layout"))


def check_engine_kv_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if not engine_kv_wanted(args):
        return
    for role in ROLES:
        for flag in ("tp", "kv_block_tokens"):
            if getattr(args, f"{role}_{flag}") < 0:
                parser.error(f"--{role}-{flag.replace('_', '-')} must be at least 1 (or 0: the default)")
    if args.backend == "ucx":
        parser.error("--backend ucx moves pool rows only: the engine-KV flags need nixl or ipc")
    if args.lender != "inplace":
        parser.error("the engine-KV flags lend in place: --lender staging moves pool rows only")
    for role in ROLES:
        tp = getattr(args, f"{role}_tp") or 1
        heads = args.kv_heads
        if (tp <= heads and heads % tp) or (tp > heads and tp % heads):
            parser.error(f"--{role}-tp {tp} must divide the model's {heads} KV heads, or be a multiple of them")


def engine_kv_argv(args: argparse.Namespace, role: str) -> list[str]:
    """The ``kvxfer serve`` flags of one role's workers (none without engine KV)."""
    if not engine_kv_wanted(args):
        return []
    out = ["--engine-kv", "--no-prefix-cache", "--tp", str(getattr(args, f"{role}_tp") or 1)]
    if getattr(args, f"{role}_kv_block_tokens"):
        out += ["--kv-block-tokens", str(getattr(args, f"{role}_kv_block_tokens"))]
    if getattr(args, f"{role}_kv_layout"):
        out += ["--kv-layout", getattr(args, f"{role}_kv_layout")]
    if role == "decode":
        out += ["--peer-tp", str(args.prefill_tp or 1)]
    return out


def engine_kv_report(args: argparse.Namespace) -> dict[str, Any] | None:
    """The report's ``engine_kv``: each end's TP, block size and layout (None: pool rows)."""
    if not engine_kv_wanted(args):
        return None
    return {role: {"tp": getattr(args, f"{role}_tp") or 1,
                   "block_tokens": getattr(args, f"{role}_kv_block_tokens") or args.block_tokens,
                   "layout": getattr(args, f"{role}_kv_layout") or "block_major"} for role in ROLES}
