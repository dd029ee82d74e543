"""Fault injection at scale: thousands of transfers over each host mover (loopback, NIXL, ucx,
the store; push and pull), with rows damaged where they land, after the copy and before the
check (``kvxfer.backends.common.corruption.Corruptor``: one random bit flipped, or the whole row
rewritten). For every row it counts what the fetcher said against what was done to it:
corrupted rows reported True (missed) and clean rows reported False (refused wrongly) must both
be 0, and no transfer with a damaged row may be Delivered.

    python bench/integrity_campaign.py --transfers 500 --json out.json

Both ends run in this process (NIXL and ucx: two agents or workers over UCX); 24 scattered rows
per group, two groups (256 and 96 bytes), a fresh payload per transfer.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from kvxfer.backends.blob import BlobBackend, MemoryDriver, MemoryStore
from kvxfer.backends.common.corruption import Corruptor
from kvxfer.backends.loopback import LoopbackBackend, LoopbackFabric
from kvxfer.contract import Backend, Delivered, TransferMode
from kvxfer.testing.conformance.transfers import _fill, _finish, _groups, _plan, _start
from kvxfer.testing.memory import HostRows
from kvxfer.testing.nixl_pairs import DeviceRows, two_ends

Build = Callable[[TransferMode, HostRows | DeviceRows, Corruptor | None], Backend]


def _loopback() -> Build:
    fabric = LoopbackFabric()
    return lambda mode, memory, corrupt: _registered(
        LoopbackBackend(fabric, f"loop-{memory.regions[0].name}", mode, corrupt_landed=corrupt), memory)


def _store() -> Build:
    store = MemoryStore()
    return lambda mode, memory, corrupt: _registered(
        BlobBackend(MemoryDriver(store), name=f"store-{memory.regions[0].name}", mode=mode, corrupt_landed=corrupt,
                    fetch_wait_s=3.0), memory)


def _nixl() -> Build:
    from kvxfer.testing.nixl_pairs import make_backend

    return lambda mode, memory, corrupt: make_backend(mode, memory, corrupt_landed=corrupt)


def _ucx() -> Build:
    from kvxfer.testing.ucx_pairs import make_backend

    return lambda mode, memory, corrupt: make_backend(mode, memory, corrupt_landed=corrupt)


def _registered(backend: Backend, memory: HostRows | DeviceRows) -> Backend:
    backend.register(memory.regions)
    return backend


MOVERS = {"loopback": _loopback, "nixl": _nixl, "ucx": _ucx, "store": _store}


def campaign(mover: str, mode: TransferMode, transfers: int, seed: int, p_bit: float, p_row: float) -> dict[str, Any]:
    corruptor = Corruptor(seed, p_bit=p_bit, p_row=p_row)
    build = MOVERS[mover]()
    # Only the fetching (local) end damages what lands: its regions are the kit's "L" ones.
    pair = two_ends(mode, lambda m, memory: build(m, memory, corruptor if memory.regions[0].name.startswith("L")
                                                  else None))
    counts = {"transfers": 0, "rows": 0, "corrupted": 0, "caught": 0, "missed": 0, "refused_clean": 0,
              "delivered_with_damage": 0, "failed_transfers": 0}
    start = time.perf_counter()
    try:
        for i in range(transfers):
            plan = _plan(pair, f"{mover}-{mode.value}-{i}", rows=24, seed=seed * 100_003 + i)
            _fill(pair, plan, local_is_source=False)
            outcome, _ = _finish(pair, _start(pair, plan, "fetch"))
            changed = corruptor.take()
            damaged_here = False
            for mask, (name, region, _) in zip(outcome.masks, _groups(pair)):
                slots = plan.local_slots[name].tolist()
                bad = np.array([(region.name, s) in changed for s in slots])
                said = np.asarray(mask, dtype=bool)
                counts["rows"] += len(slots)
                counts["corrupted"] += int(bad.sum())
                counts["caught"] += int((bad & ~said).sum())
                counts["missed"] += int((bad & said).sum())
                counts["refused_clean"] += int((~bad & ~said).sum())
                damaged_here |= bool(bad.any())
            counts["transfers"] += 1
            counts["delivered_with_damage"] += int(damaged_here and isinstance(outcome, Delivered))
            counts["failed_transfers"] += int(not isinstance(outcome, Delivered))
    finally:
        pair.close()
    return {"mover": mover, "mode": mode.value, **counts, "seconds": round(time.perf_counter() - start, 2)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--transfers", type=int, default=500, help="per mover and mode")
    p.add_argument("--movers", default=",".join(MOVERS))
    p.add_argument("--p-bit", type=float, default=0.02, help="share of landed rows with one bit flipped")
    p.add_argument("--p-row", type=float, default=0.02, help="share of landed rows rewritten whole")
    p.add_argument("--json", default="")
    args = p.parse_args()
    results = []
    for n, mover in enumerate(args.movers.split(",")):
        for mode in TransferMode:
            r = campaign(mover, mode, args.transfers, seed=17 + 2 * n + (mode is TransferMode.PULL), p_bit=args.p_bit,
                         p_row=args.p_row)
            print(json.dumps(r), flush=True)
            results.append(r)
    total = {k: sum(r[k] for r in results) for k in ("transfers", "rows", "corrupted", "caught", "missed",
                                                     "refused_clean", "delivered_with_damage")}
    print("total", json.dumps(total))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": platform.node(), "python": platform.python_version(), "args": vars(args),
                       "results": results, "total": total}, f, indent=2)
            f.write("\n")


if __name__ == "__main__":
    main()
