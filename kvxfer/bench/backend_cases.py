"""kvxfer backends measured through the public contract: describe, fetch, publish, outcome.

A backend case is a factory of two ends (prefill, decode) for a transfer mode and memory
kind. Each point gets fresh ends and buffers, because the contract has no unregister and
a region's slot size is fixed; ends are shut down after the point and must report every
attempt quiesced. Three modes:

- throughput: from the call that moves bytes (push: publish, pull: fetch) to the decode
  side's outcome being visible through its wake callback; every row is then checked byte
  for byte against its source row;
- latency: the same interval for small requests, many samples, p50/p99;
- host overhead: the prefill owner's ``describe`` + ``publish`` calls, per row.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from kvxfer.bench.cases import CaseSpec, Measurement, Requirement, Role, Skip
from kvxfer.bench.config import BenchConfig, LatencySweep, OverheadSweep, Point
from kvxfer.bench.layout import choose_slots, pool_slots
from kvxfer.bench.nixl_raw import latency_measurement
from kvxfer.bench.timing import Timing, check_fresh_bytes, time_runs
from kvxfer.contract import (
    Attempt,
    Backend,
    CacheKind,
    LayerGroupRows,
    MemoryKind,
    Outcome,
    SlotRegion,
    TokenRange,
    TransferMode,
    View,
)

if TYPE_CHECKING:
    from kvxfer.backends.nixl.plan import ChunkBytes

_WAIT_S = 60.0
BLOCK_TOKENS = 16
LAYOUT = b"kvxfer-bench-v1"


@dataclass
class Ends:
    prefill: Backend
    decode: Backend
    close: Callable[[], None]
    facts: dict[str, Any]


EndsFactory = Callable[[TransferMode, str], Ends]


def loopback_ends(mode: TransferMode, memory: str) -> Ends:
    from kvxfer.backends.loopback import LoopbackBackend, LoopbackFabric

    if memory != "host":
        raise Skip("loopback reaches host memory only")
    fabric = LoopbackFabric()
    prefill = LoopbackBackend(fabric, "prefill", mode)
    decode = LoopbackBackend(fabric, "decode", mode)
    return Ends(prefill, decode, lambda: None, {"processes": 1})


def nixl_facts(chunks: ChunkBytes) -> dict[str, Any]:
    """A figure's facts about NixlBackend's sizes: its chunk sizes, and the packed arena's
    default (bytes, slot bytes) by memory kind, so that a result says which it measured."""
    from kvxfer.backends.nixl.backend import ARENA_DEFAULTS

    arena = {f"arena_{kind.value}": list(ARENA_DEFAULTS[kind]) for kind in ARENA_DEFAULTS}
    return {"chunk_bytes_host": chunks.host, "chunk_bytes_device": chunks.device, **arena}


def nixl_ends(mode: TransferMode, memory: str, packed: Literal["auto", "always", "never"] = "auto") -> Ends:
    """Two kvxfer NIXL backends in this process: two agents, UCX between them.

    ``packed="auto"`` is what a user gets by default (the packed path for pushes of many
    small descriptors); the ``nixl_packed`` case forces it with ``"always"``.
    """
    from kvxfer.backends.nixl import NixlBackend

    prefill = NixlBackend(mode=mode, packed=packed)
    try:
        decode = NixlBackend(mode=mode, packed=packed)
    except BaseException:
        prefill.shutdown()
        raise
    return Ends(prefill, decode, lambda: None, {"processes": 1, **nixl_facts(prefill.chunk_bytes), "window": prefill.window,
                                                "packed": packed})


def nixl_packed_ends(mode: TransferMode, memory: str) -> Ends:
    if mode is TransferMode.PULL:
        raise Skip("the NIXL backend packs pushes only; pull stays unpacked")
    return nixl_ends(mode, memory, packed="always")


class _PointRegions:
    """Both ends' regions for one point: one region per layer group per end."""

    def __init__(self, point: Point, pool_factor: int, rng: np.random.Generator,
                 devices: tuple[int, int] = (0, 0)) -> None:
        self.point = point
        self.devices = dict(zip(("prefill", "decode"), devices))
        self.slots_per_group = pool_slots(point, pool_factor)
        self.device = point.memory == "device"
        self.kind = MemoryKind.DEVICE if self.device else MemoryKind.HOST
        self.arrays: dict[str, list[Any]] = {"prefill": [], "decode": []}
        for end in ("prefill", "decode"):
            for _ in range(point.groups):
                if self.device:
                    import torch

                    self.arrays[end].append(torch.zeros((self.slots_per_group, point.row_bytes),
                                                        dtype=torch.uint8, device=f"cuda:{self.devices[end]}"))
                else:
                    self.arrays[end].append(np.zeros((self.slots_per_group, point.row_bytes), dtype=np.uint8))
        self.slots = {end: [choose_slots(point, pool_factor, rng) for _ in range(point.groups)]
                      for end in ("prefill", "decode")}

    def _address(self, array: Any) -> int:
        return int(array.data_ptr()) if self.device else int(array.ctypes.data)

    def regions(self, end: str) -> list[SlotRegion]:
        device = self.devices[end] if self.device else 0
        return [SlotRegion(f"{end}-g{i}", self._address(a), self.point.row_bytes, self.slots_per_group, self.kind,
                           device) for i, a in enumerate(self.arrays[end])]

    def view(self, end: str, regions: list[SlotRegion], request: str) -> View:
        rows = self.point.rows
        groups = tuple(LayerGroupRows(f"g{i}", CacheKind.PAGED, r, self.slots[end][i], np.arange(rows, dtype=np.int64))
                       for i, r in enumerate(regions))
        return View(request, TokenRange(0, rows * BLOCK_TOKENS), groups, LAYOUT)

    def fill_source(self, source: str, seed: int) -> None:
        """Random bytes in every slot of the source end (on the device itself for DEVICE rows)."""
        if self.device:
            import torch

            gen = torch.Generator(device=f"cuda:{self.devices[source]}").manual_seed(seed)
            for a in self.arrays[source]:
                a.copy_(torch.randint(0, 256, a.shape, dtype=torch.uint8, device=a.device, generator=gen))
            torch.cuda.synchronize(self.devices[source])
            return
        rng = np.random.default_rng(seed)
        for a in self.arrays[source]:
            a[...] = rng.integers(0, 256, size=a.shape, dtype=np.uint8)

    def rows_equal(self, source: str, dest: str) -> bool:
        for g in range(self.point.groups):
            src_rows, dst_rows = self.slots[source][g], self.slots[dest][g]
            if self.device:
                import torch

                s_arr, d_arr = self.arrays[source][g], self.arrays[dest][g]
                src = s_arr[torch.as_tensor(src_rows, device=s_arr.device)]
                dst = d_arr[torch.as_tensor(dst_rows, device=d_arr.device)]
                if not bool(torch.equal(src, dst.to(src.device))):
                    return False
            elif not np.array_equal(self.arrays[source][g][src_rows], self.arrays[dest][g][dst_rows]):
                return False
        return True


def wait_settled(attempt: Attempt, what: str) -> Outcome:
    """Until concluded and quiesced; a backend that stalls is an error, not a slow figure."""
    deadline = time.monotonic() + _WAIT_S
    while attempt.poll() is None or not attempt.quiesced():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not conclude and quiesce within {_WAIT_S:g}s")
        time.sleep(0.0002)
    outcome = attempt.poll()
    assert outcome is not None
    return outcome


class Watch:
    """Wake callback that stamps the moment an attempt's outcome became visible."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.attempt: Attempt | None = None
        self.seen_at: float | None = None
        self.early: float | None = None  # a wake before the submitting call returned

    def __call__(self) -> None:
        now = time.perf_counter()
        if self.attempt is None:
            self.early = self.early or now
        elif self.seen_at is None and self.attempt.poll() is not None:
            self.seen_at = now
        self.event.set()

    def bind(self, attempt: Attempt) -> None:
        self.attempt = attempt
        if self.early is not None and attempt.poll() is not None:
            self.seen_at = self.early

    def wait_outcome(self) -> float:
        deadline = time.monotonic() + _WAIT_S
        while self.seen_at is None:
            assert self.attempt is not None
            if self.attempt.poll() is not None:  # wake fired before bind and was not yet concluded
                self.seen_at = self.seen_at or time.perf_counter()
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"no outcome within {_WAIT_S:g}s")
            self.event.wait(0.05)
            self.event.clear()
        return self.seen_at


class BackendCase:
    def __init__(self, config: BenchConfig, make_ends: EndsFactory, name: str) -> None:
        self.config = config
        self.make_ends = make_ends
        self.name = name
        self._rng = np.random.default_rng(config.seed + 1)

    def _setup(self, point: Point) -> tuple[Ends, _PointRegions, View, View]:
        mode = TransferMode.PUSH if point.direction == "push" else TransferMode.PULL
        memory = _PointRegions(point, self.config.pool_factor, self._rng, self.config.devices)
        ends = self.make_ends(mode, point.memory)
        try:
            rp, rd = memory.regions("prefill"), memory.regions("decode")
            ends.prefill.register(rp)
            ends.decode.register(rd)
            return ends, memory, memory.view("prefill", rp, "bench"), memory.view("decode", rd, "bench")
        except BaseException:
            self._teardown(ends)
            raise

    @staticmethod
    def _paths(ends: Ends) -> dict[str, Any]:
        """Each end's own counters (e.g. packed vs direct submissions), where it keeps any."""
        out: dict[str, Any] = {}
        for end, backend in (("prefill", ends.prefill), ("decode", ends.decode)):
            stats = getattr(backend, "stats", None)
            if callable(stats):
                value = stats()
                is_record = dataclasses.is_dataclass(value) and not isinstance(value, type)
                out[f"{end}_stats"] = dataclasses.asdict(value) if is_record else repr(value)
        return out

    @staticmethod
    def _teardown(ends: Ends) -> None:
        left = ends.prefill.shutdown() | ends.decode.shutdown()
        ends.close()
        if left:
            raise RuntimeError(f"{len(left)} attempts were not quiesced at shutdown")

    def _one(self, ends: Ends, prefill_view: View, decode_view: View, push: bool) -> tuple[float, float, Attempt, Attempt]:
        """One transfer; returns (start, outcome visible, prefill attempt, decode attempt)."""
        decode_hint = ends.decode.describe(decode_view)
        prefill_hint = ends.prefill.describe(prefill_view)
        watch = Watch()
        if push:
            decode_attempt = ends.decode.fetch(decode_view, prefill_hint, wake=watch)
            watch.bind(decode_attempt)
            t0 = time.perf_counter()
            prefill_attempt = ends.prefill.publish(prefill_view, decode_hint)
        else:
            prefill_attempt = ends.prefill.publish(prefill_view, decode_hint)
            t0 = time.perf_counter()
            decode_attempt = ends.decode.fetch(decode_view, prefill_hint, wake=watch)
            watch.bind(decode_attempt)
        seen = watch.wait_outcome()
        return t0, seen, prefill_attempt, decode_attempt

    @staticmethod
    def _stamp(memory: _PointRegions) -> Callable[[int], Callable[[], bool]]:
        def stamp(seed: int) -> Callable[[], bool]:
            memory.fill_source("prefill", seed)
            return lambda: memory.rows_equal("prefill", "decode")
        return stamp

    def _settle(self, prefill_attempt: Attempt, decode_attempt: Attempt, rows: int) -> None:
        outcome = wait_settled(decode_attempt, "decode attempt")
        wait_settled(prefill_attempt, "prefill attempt")
        if not outcome.all_delivered or outcome.rows_delivered != rows:
            raise RuntimeError(f"decode outcome {type(outcome).__name__}: {outcome.rows_delivered}/{rows} rows")

    def throughput(self, point: Point) -> Measurement:
        ends, memory, prefill_view, decode_view = self._setup(point)
        try:
            memory.fill_source("prefill", self.config.seed + point.rows)
            push = point.direction == "push"

            def run() -> float:
                t0, seen, prefill_attempt, decode_attempt = self._one(ends, prefill_view, decode_view, push)
                self._settle(prefill_attempt, decode_attempt, point.total_rows)
                return seen - t0

            timing = time_runs(run, self.config.repetition)
            check_fresh_bytes(self._stamp(memory), run, "decode rows")
            paths = self._paths(ends)
        finally:
            self._teardown(ends)
        return Measurement({"seconds_best": timing.best, "seconds_median": timing.median,
                            "reps": len(timing.samples)},
                           {**ends.facts, **paths, "verified": True,
                            "measured": "move call to decode outcome visible (wake callback)"})

    def latency(self, point: Point, sweep: LatencySweep) -> Measurement:
        ends, memory, prefill_view, decode_view = self._setup(point)
        samples = []
        try:
            memory.fill_source("prefill", self.config.seed)
            push = point.direction == "push"
            for i in range(sweep.warmup + sweep.samples):
                t0, seen, prefill_attempt, decode_attempt = self._one(ends, prefill_view, decode_view, push)
                self._settle(prefill_attempt, decode_attempt, point.total_rows)
                if i >= sweep.warmup:
                    samples.append(seen - t0)

            def once() -> None:
                _, _, prefill_attempt, decode_attempt = self._one(ends, prefill_view, decode_view, push)
                self._settle(prefill_attempt, decode_attempt, point.total_rows)

            check_fresh_bytes(self._stamp(memory), once, "decode rows")
        finally:
            self._teardown(ends)
        return latency_measurement(Timing(tuple(samples)), {
            **ends.facts, "verified": True,
            "measured": ("publish" if point.direction == "push" else "fetch") + " call to decode outcome visible"})

    def overhead(self, point: Point, sweep: OverheadSweep) -> Measurement:
        ends, memory, prefill_view, decode_view = self._setup(point)
        owner, publish_only, decode_side = [], [], []
        try:
            for _ in range(sweep.repeats + 1):  # the first is a warm-up
                t0 = time.perf_counter()
                decode_hint = ends.decode.describe(decode_view)
                t1 = time.perf_counter()
                prefill_hint = ends.prefill.describe(prefill_view)
                t2 = time.perf_counter()
                decode_attempt = ends.decode.fetch(decode_view, prefill_hint)
                t3 = time.perf_counter()
                prefill_attempt = ends.prefill.publish(prefill_view, decode_hint)
                t4 = time.perf_counter()
                self._settle(prefill_attempt, decode_attempt, point.total_rows)
                owner.append((t2 - t1) + (t4 - t3))
                publish_only.append(t4 - t3)
                decode_side.append((t1 - t0) + (t3 - t2))
        finally:
            self._teardown(ends)
        rows = point.total_rows
        own, pub, dec = (Timing(tuple(x[1:])) for x in (owner, publish_only, decode_side))
        return Measurement(
            {"per_row_s_best": own.best / rows, "per_row_s_median": own.median / rows,
             "publish_per_row_s": pub.median / rows, "decode_per_row_s": dec.median / rows,
             "samples": len(own.samples)},
            {**ends.facts, "measured": "prefill owner thread: describe + publish, per row"},
        )

    def close(self) -> None:
        pass


# name -> (title, requirements, ends factory)
BACKENDS: dict[str, tuple[str, frozenset[Requirement], EndsFactory]] = {
    "loopback": ("kvxfer loopback (in-process memmove)", frozenset(), loopback_ends),
    "nixl": ("kvxfer NIXL backend, both ends in this process", frozenset({Requirement.NIXL, Requirement.KVXFER_NIXL}),
             nixl_ends),
    "nixl_packed": ("kvxfer NIXL, packed rows (bounce arena), both ends in this process",
                    frozenset({Requirement.NIXL, Requirement.KVXFER_PACKED}), nixl_packed_ends),
}


def _spec(name: str, title: str, needs: frozenset[Requirement], make: EndsFactory) -> CaseSpec:
    return CaseSpec(name, title, Role.BACKEND, needs, ("memory", "direction", "slots", "row_bytes", "rows", "groups"),
                    frozenset({"throughput", "latency", "overhead"}),
                    lambda config: BackendCase(config, make, name))


SPECS = [_spec(n, t, needs, make) for n, (t, needs, make) in BACKENDS.items()]
