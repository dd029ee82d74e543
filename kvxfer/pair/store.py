"""``kvxfer pair --store memory|mooncake``: the pair with a KV store, run as two instances.

Round 1 runs the workload on fresh workers that put their prompt blocks into the store;
round 2 (``--store-rounds``) runs it again on another instance (fresh workers, empty caches,
a new router) on the same store, whose decode workers take the prompts' blocks from there.
Every completion of every round must match colocated generation.

The store lives as long as the pair: ``memory`` is a fresh /dev/shm directory (removed at
the end unless ``--store-path`` names one to keep), ``mooncake`` a master started here with
``--store-segment-mib`` of memory held by this process (the workers give none, so blobs
outlive the instance that put them), unless ``--store-master`` names a running one.
"""

from __future__ import annotations

import argparse
import contextlib
import re
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvxfer.pair.layouts import engine_kv_wanted


def add_store_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("a KV store (kvxfer.worker.store): round 1 puts, round 2, another instance, takes")
    g.add_argument("--store", default="", choices=["", "memory", "mooncake"],
                   help="memory: a /dev/shm directory; mooncake: a Mooncake Store (pip install 'kvxfer[store]')")
    g.add_argument("--store-path", default="", metavar="DIR", help="--store memory: a directory to use and keep")
    g.add_argument("--store-master", default="", metavar="HOST:PORT",
                   help="--store mooncake: a running master (default: one started for the pair)")
    g.add_argument("--store-segment-mib", type=int, default=512, metavar="MIB",
                   help="--store mooncake, with the pair's own master: the store's memory, held by the pair")
    g.add_argument("--store-rounds", type=int, default=2, metavar="N",
                   help="instances run one after the other on the store (each with fresh workers)")


def check_store_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """What the workers would refuse with a store, refused before anything starts (exit 2) and
    before torch is imported: only the devices (``check_store_devices``) need it. A device
    named cuda on the command line is named here too, beside the other problems."""
    if not args.store:
        for flag in ("store_path", "store_master"):
            if getattr(args, flag):
                parser.error(f"--{flag.replace('_', '-')} needs --store")
        args.store_rounds = 1
        return
    problems = []
    if args.store_rounds < 1:
        problems.append(f"--store-rounds must be at least 1, got {args.store_rounds}")
    if args.store == "mooncake" and not args.store_master and args.store_segment_mib < 16:
        problems.append(f"--store-segment-mib must be at least 16 (Mooncake's least segment), got "
                        f"{args.store_segment_mib}")
    if args.lender != "inplace":
        problems.append("--store reads and writes the pool's rows in place: use --lender inplace")
    if engine_kv_wanted(args):
        problems.append("engine KV (--prefill-tp, --decode-tp, --*-kv-block-tokens, --*-kv-layout) does not use a "
                        "KV store")
    if problems:
        named = (args.prefill_device or args.device, args.decode_device or args.device)
        parser.error("; ".join(problems + [HOST_ONLY] * any(d.startswith("cuda") for d in named)))


HOST_ONLY = "the store reaches host memory only: run the workers on the CPU (--device cpu)"


def check_store_devices(parser: argparse.ArgumentParser, args: argparse.Namespace, devices: tuple[str, ...]) -> None:
    """With a store, the workers' devices as resolved (``auto`` may be cuda): host memory only."""
    if args.store and any(d.startswith("cuda") for d in devices):
        parser.error(HOST_ONLY)


@dataclass(frozen=True)
class StoreSetup:
    """The ``kvxfer serve`` flags of the pair's store, and how to describe it."""

    argv: tuple[str, ...]
    where: str


@contextlib.contextmanager
def store_for(args: argparse.Namespace) -> Iterator[StoreSetup | None]:
    """The pair's store for as long as the pair runs (None without ``--store``)."""
    if not args.store:
        yield None
    elif args.store == "memory":
        keep = bool(args.store_path)
        path = args.store_path or tempfile.mkdtemp(prefix="kvxfer-pair-store-", dir="/dev/shm")
        try:
            yield StoreSetup(("--store", "memory", "--store-path", path), f"/dev/shm store at {path}")
        finally:
            if not keep:
                shutil.rmtree(path, ignore_errors=True)
    elif args.store_master:
        yield StoreSetup(("--store", "mooncake", "--store-master", args.store_master),
                         f"Mooncake Store, master {args.store_master}")
    else:
        from kvxfer.backends.blob import MooncakeDriver, MooncakeMaster  # noqa: PLC0415 - the store extra

        with MooncakeMaster() as master:
            holder = MooncakeDriver(master.address, segment_bytes=args.store_segment_mib << 20)
            try:
                yield StoreSetup(("--store", "mooncake", "--store-master", master.address, "--store-segment-mib", "0"),
                                 f"Mooncake Store, master {master.address}, {args.store_segment_mib} MiB held by "
                                 "the pair")
            finally:
                holder.close()


_ROWS = re.compile(r'^kvxfer_store_rows_total\{op="(get|put)",result="(hit|miss)"\} (\S+)$', re.M)


def store_rows(log_dir: Path) -> dict[str, int]:
    """Rows the round's workers put into and took from the store, from their saved metrics."""
    out = {"put_hit": 0, "put_miss": 0, "get_hit": 0, "get_miss": 0}
    for path in log_dir.glob("*.metrics"):
        for op, result, value in _ROWS.findall(path.read_text()):
            out[f"{op}_{result}"] += int(float(value))
    return out


def store_lines(rounds: list[dict[str, Any]]) -> list[str]:
    """The report's lines: per round, what the store took and gave."""
    lines = []
    for i, r in enumerate(rounds, 1):
        rows = r["store_rows"]
        asked = rows["get_hit"] + rows["get_miss"]
        lines.append(f"  store        round {i}: {rows['get_hit']} of {asked} looked-up prompt blocks came from the "
                     f"store, {rows['put_hit']} put ({r['matched']}/{r['requests']} token-identical)")
    return lines
