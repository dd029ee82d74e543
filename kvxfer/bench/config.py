"""What a bench run measures: sweeps, repetitions and presets, parsed and validated up front.

A run is a list of throughput sweeps (each the product of its dimensions), an optional
latency sweep and an optional host-overhead sweep, over a set of cases. Presets name the
figure sets the project cares about; command-line flags build one custom sweep instead.
"""

from __future__ import annotations

import argparse
import itertools
import re
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from kvxfer.contract import KvxferError

DIRECTIONS = ("push", "pull")
MEMORY_KINDS = ("host", "device")
SLOT_PATTERNS = ("contiguous", "scattered")

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE)
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


class ConfigError(KvxferError, ValueError):
    """A bench option is malformed or out of range; the message names the option."""


def parse_size(text: str | int, what: str = "size") -> int:
    """``4K``, ``64KiB``, ``1M``, ``1g`` or a plain byte count; units are binary (1K = 1024)."""
    if isinstance(text, int) and not isinstance(text, bool):
        value = text
    else:
        m = _SIZE.match(str(text))
        if m is None:
            raise ConfigError(f"{what}: cannot read {text!r} as a size (examples: 4K, 64KiB, 1M, 1G, 4096)")
        scaled = float(m.group(1)) * _UNITS[m.group(2).lower()]
        if scaled != int(scaled):
            raise ConfigError(f"{what}: {text!r} is not a whole number of bytes")
        value = int(scaled)
    if value <= 0:
        raise ConfigError(f"{what}: {text!r} must be positive")
    return value


def format_size(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def parse_list(text: str, what: str) -> list[str]:
    items = [t.strip() for t in str(text).split(",") if t.strip()]
    if not items:
        raise ConfigError(f"{what}: empty list")
    return items


def parse_sizes(text: str, what: str) -> tuple[int, ...]:
    return tuple(parse_size(t, what) for t in parse_list(text, what))


def parse_ints(text: str, what: str) -> tuple[int, ...]:
    out = []
    for t in parse_list(text, what):
        try:
            out.append(parse_size(t, what))  # "1k" rows reads as 1024 rows: same grammar
        except ConfigError as err:
            raise ConfigError(f"{what}: {t!r} is not a positive integer") from err
    return tuple(out)


def parse_devices(text: str) -> tuple[int, int]:
    """``P,D``: the prefill and decode ends' CUDA device indices (``0,1``; ``0`` alone is ``0,0``)."""
    items = [t.strip() for t in str(text).split(",")]  # empties kept: "1," is refused, not read as 1,1
    if not 1 <= len(items) <= 2 or not all(t.isascii() and t.isdecimal() for t in items):
        raise ConfigError(f"--devices: {text!r} must be one or two CUDA device indices, e.g. 0,1")
    first = int(items[0])
    return first, int(items[-1]) if len(items) == 2 else first


def devices_argument(text: str) -> tuple[int, int]:
    """``parse_devices`` as an argparse ``type=`` (for the bench scripts): its message, not argparse's."""
    try:
        return parse_devices(text)
    except ConfigError as err:
        raise argparse.ArgumentTypeError(str(err).removeprefix("--devices: ")) from None  # argparse names the flag


def _choices(values: Iterable[str], allowed: Sequence[str], what: str) -> tuple[str, ...]:
    out = tuple(values)
    for v in out:
        if v not in allowed:
            raise ConfigError(f"{what}: {v!r} is not one of {', '.join(allowed)}")
    if len(set(out)) != len(out):
        raise ConfigError(f"{what}: {out} names a value twice")
    return out


@dataclass(frozen=True)
class Point:
    """One transfer shape: ``rows`` rows of ``row_bytes`` in each of ``groups`` layer groups."""

    direction: str
    memory: str
    slots: str
    row_bytes: int
    rows: int
    groups: int

    @property
    def total_bytes(self) -> int:
        return self.row_bytes * self.rows * self.groups

    @property
    def total_rows(self) -> int:
        return self.rows * self.groups

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "total_bytes": self.total_bytes}


@dataclass(frozen=True)
class ThroughputSweep:
    """The product of its dimensions. ``rows=None`` means ``request_bytes // row_bytes`` per group."""

    row_bytes: tuple[int, ...]
    rows: tuple[int, ...] | None = None
    request_bytes: int = 64 << 20
    groups: tuple[int, ...] = (1,)
    directions: tuple[str, ...] = ("push",)
    memory: tuple[str, ...] = ("host",)
    slots: tuple[str, ...] = ("contiguous", "scattered")

    def __post_init__(self) -> None:
        if not self.row_bytes:
            raise ConfigError("row sizes: empty")
        _choices(self.directions, DIRECTIONS, "directions")
        _choices(self.memory, MEMORY_KINDS, "memory kinds")
        _choices(self.slots, SLOT_PATTERNS, "slot patterns")
        if any(g <= 0 for g in self.groups) or any(r <= 0 for r in self.rows or ()):
            raise ConfigError("rows and groups must be positive")

    def points(self) -> list[Point]:
        out = []
        for row, direction, memory, slots, groups in itertools.product(
            self.row_bytes, self.directions, self.memory, self.slots, self.groups
        ):
            rows_list = self.rows if self.rows is not None else (max(1, self.request_bytes // (row * groups)),)
            for rows in rows_list:
                out.append(Point(direction, memory, slots, row, rows, groups))
        return out


@dataclass(frozen=True)
class LatencySweep:
    """Small requests: ``samples`` timed submissions after ``warmup`` untimed ones."""

    rows: tuple[int, ...] = (1, 32)
    row_bytes: int = 64 << 10
    directions: tuple[str, ...] = ("push",)
    memory: tuple[str, ...] = ("host",)
    slots: str = "scattered"
    samples: int = 300
    warmup: int = 30
    # Two-process cases: a sleep between the decode end's fetch registration (answered, then a
    # ping) and the publish. In serving the fetch is registered a prefill earlier; right after
    # a ping, about 1% of samples on the H200 still found the decode end handling it (the tail).
    # A sleep removes that but the publisher then runs colder (measured: p50 and p99 no better),
    # so 0 stays the default and the figure is comparable with earlier runs.
    settle_us: int = 0

    def __post_init__(self) -> None:
        _choices(self.directions, DIRECTIONS, "latency directions")
        _choices(self.memory, MEMORY_KINDS, "latency memory kinds")
        _choices((self.slots,), SLOT_PATTERNS, "latency slots")
        if self.samples < 2 or self.warmup < 0:
            raise ConfigError("latency samples must be >= 2 and warmup >= 0")
        if not 0 <= self.settle_us <= 1_000_000:
            raise ConfigError(f"latency settle time must be 0..1000000 µs, got {self.settle_us}")

    def points(self) -> list[Point]:
        return [Point(d, m, self.slots, self.row_bytes, r, 1)
                for d, m, r in itertools.product(self.directions, self.memory, self.rows)]


@dataclass(frozen=True)
class OverheadSweep:
    """Submission cost on the owner thread at many rows; rows are tiny so memory stays small."""

    rows: tuple[int, ...] = (1000, 10000, 100000)
    row_bytes: int = 256
    slots: tuple[str, ...] = ("contiguous", "scattered")
    repeats: int = 7

    def __post_init__(self) -> None:
        _choices(self.slots, SLOT_PATTERNS, "overhead slots")
        if self.repeats < 1:
            raise ConfigError("overhead repeats must be >= 1")

    def points(self) -> list[Point]:
        return [Point("push", "host", s, self.row_bytes, r, 1) for s, r in itertools.product(self.slots, self.rows)]


@dataclass(frozen=True)
class Repetition:
    """Warm up, then time ``reps`` runs, stopping early (after at least 3) past ``budget_s`` per figure."""

    warmup: int = 2
    reps: int = 15
    budget_s: float = 3.0

    def __post_init__(self) -> None:
        if self.warmup < 0 or self.reps < 1 or self.budget_s <= 0:
            raise ConfigError("warmup must be >= 0, reps >= 1 and the time budget positive")


@dataclass(frozen=True)
class BenchConfig:
    name: str
    cases: tuple[str, ...]
    throughput: tuple[ThroughputSweep, ...] = ()
    latency: LatencySweep | None = None
    overhead: OverheadSweep | None = None
    repetition: Repetition = field(default_factory=Repetition)
    layers: int = 32          # layers per row for the layer-major "peer practice" baseline
    pool_factor: int = 2      # scattered rows are drawn from a pool this many times larger
    max_descriptors: int = 1 << 18  # raw NIXL baselines posting more are skipped, with the count
    seed: int = 0
    # CUDA devices of the prefill end (where rows come from) and the decode end (where they
    # land), for device memory. Different devices: every figure crosses between two GPUs, and
    # local_copy, the reference, is the peer copy between them.
    devices: tuple[int, int] = (0, 0)

    def __post_init__(self) -> None:
        if not self.cases:
            raise ConfigError("no cases selected")
        if self.layers < 1 or self.pool_factor < 1 or self.max_descriptors < 1:
            raise ConfigError("layers, pool factor and max descriptors must be >= 1")
        if len(self.devices) != 2 or any(isinstance(d, bool) or not isinstance(d, int) or d < 0 for d in self.devices):
            raise ConfigError(f"devices: {self.devices!r} must be two CUDA device indices (prefill, decode), e.g. 0,1")
        object.__setattr__(self, "devices", tuple(self.devices))  # a list would not key a cache

    @property
    def prefill_device(self) -> int:
        return self.devices[0]

    @property
    def decode_device(self) -> int:
        return self.devices[1]

    @property
    def two_devices(self) -> bool:
        return self.devices[0] != self.devices[1]

    def active_devices(self, direction: str) -> tuple[int, int]:
        """(the active end's device, the passive end's). Bytes always go prefill -> decode; a
        push is driven by the prefill end (the publisher), a pull by the decode end (the fetcher)."""
        return self.devices if direction == "push" else (self.devices[1], self.devices[0])

    def throughput_points(self) -> list[Point]:
        seen: dict[Point, None] = {}
        for sweep in self.throughput:
            for p in sweep.points():
                seen.setdefault(p, None)
        return list(seen)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def with_cases(self, cases: Sequence[str]) -> BenchConfig:
        return replace(self, cases=tuple(cases))


K, M, G = 1 << 10, 1 << 20, 1 << 30
ROW_SIZES = (4 * K, 16 * K, 64 * K, 256 * K, 1 * M, 4 * M)
ALL_CASES = ("local_copy", "local_rows", "nixl_one_desc", "nixl_per_row", "peer_practice",
             "loopback", "nixl", "nixl_2p", "nixl_2p_no_integrity", "nixl_packed", "nixl_2p_packed", "ucx_2p", "ucx_2p_no_integrity",
             "ipc_kernel", "ipc", "ipc_no_integrity",
             "ipc_busy_poll", "ipc_busy_poll_sockets")
# On a GPU: issue 5's figures, IPC first (a --time-limit cuts the tail). Cases with both NIXL
# agents in one process are left out: they get a 0.36 GB/s lane on device memory.
# loopback stays for the host submission-overhead sweep (the two-process cases skip it).
GPU_CASES = ("local_copy", "ipc_kernel", "ipc", "ipc_busy_poll", "local_rows", "nixl_one_desc", "nixl_per_row", "nixl_2p_packed",
             "nixl_2p", "peer_practice", "loopback")


# Two GPUs (issue 8): the peer copy, the IPC backend over peer access and NIXL's shapes.
GPU2_CASES = ("local_copy", "ipc_kernel", "ipc", "local_rows", "nixl_one_desc", "nixl_per_row", "nixl_2p_packed",
              "nixl_2p")


# The engine-layouts workload (kvxfer.bench.layouts): one request, prefill TP 1 -> decode TP 2.
# The store (issue 30): put and get through the blob backend beside the local copy and NIXL.
STORE_CASES = ("local_copy", "nixl_one_desc", "nixl_2p", "store_memory_put", "store_memory_get", "store_shm_put",
               "store_shm_get", "store_mooncake_put", "store_mooncake_get")
LAYOUT_CASES = ("layouts_copy", "layouts_ipc", "layouts_nixl_packed", "layouts_nixl_per_piece", "layouts_nixl_unpacked")


def _layouts() -> BenchConfig:
    """A 64 KiB row is one 16-token prefill block of one layer (K and V, 8 heads x 128, fp16):
    4096 tokens x 32 layers (512 MiB) on a GPU; 1024 tokens x 8 layers (32 MiB) on the host."""
    return BenchConfig(
        name="layouts", cases=LAYOUT_CASES,
        throughput=(ThroughputSweep(row_bytes=(64 * K,), request_bytes=512 * M, groups=(32,), memory=("device",),
                                    slots=("scattered",)),
                    ThroughputSweep(row_bytes=(64 * K,), request_bytes=32 * M, groups=(8,), memory=("host",),
                                    slots=("scattered",))),
        repetition=Repetition(warmup=2, reps=20, budget_s=3.0),
    )


def _store() -> BenchConfig:
    """64 MiB requests of 64 KiB and 2 MiB rows, on the host: a store's put and get apart."""
    return BenchConfig(
        name="store", cases=STORE_CASES,
        throughput=(ThroughputSweep(row_bytes=(64 * K, 2 * M), request_bytes=64 * M, slots=("scattered",)),),
        repetition=Repetition(warmup=1, reps=5, budget_s=3.0),
    )


def preset(name: str) -> BenchConfig:
    """Named figure sets. ``cpu``: a few minutes on a 2-core host; ``gpu``: issue 5's set on one
    GPU; ``gpu2``: issue 8's, prefill on GPU 0 and decode on GPU 1; ``layouts``: the engine-layouts
    workload (device figures where a GPU is, host figures everywhere); ``store``: a KV store's put
    and get beside the local copy and NIXL (host); ``tiny``: tests."""
    if name == "tiny":
        return BenchConfig(
            name="tiny", cases=("local_copy", "loopback"),
            throughput=(ThroughputSweep(row_bytes=(4 * K, 64 * K), rows=(8,), slots=("contiguous", "scattered")),),
            latency=LatencySweep(rows=(4,), row_bytes=4 * K, samples=5, warmup=1),
            overhead=OverheadSweep(rows=(100,), slots=("scattered",), repeats=2),
            repetition=Repetition(warmup=1, reps=3, budget_s=0.5), layers=4,
        )
    if name == "cpu":
        return BenchConfig(
            name="cpu", cases=ALL_CASES,
            throughput=(
                # GB/s against row size at a fixed 64 MiB request: the per-row cost shows.
                ThroughputSweep(row_bytes=ROW_SIZES, request_bytes=64 * M, slots=("contiguous", "scattered")),
                # rows per request at 64 KiB rows; layer groups; pull.
                ThroughputSweep(row_bytes=(64 * K,), rows=(32, 256, 1024), slots=("scattered",)),
                ThroughputSweep(row_bytes=(64 * K,), rows=(256,), groups=(4,), slots=("scattered",)),
                ThroughputSweep(row_bytes=(64 * K,), request_bytes=64 * M, directions=("pull",),
                                slots=("contiguous", "scattered")),
            ),
            latency=LatencySweep(rows=(1, 32), row_bytes=64 * K, samples=300, warmup=30),
            overhead=OverheadSweep(rows=(1000, 10000, 100000), slots=("contiguous", "scattered"), repeats=5),
            repetition=Repetition(warmup=2, reps=10, budget_s=2.0),
            # 64-byte layer pieces (4 KiB rows / 64) cost seconds per request here and say nothing new
            max_descriptors=1 << 17,
        )
    if name == "gpu":
        return BenchConfig(
            name="gpu", cases=GPU_CASES,
            throughput=(
                # issue 5: rows of 4, 16, 64 KiB at 256 MiB and 1 GiB per transfer, scattered and contiguous.
                ThroughputSweep(row_bytes=(4 * K, 16 * K, 64 * K), request_bytes=256 * M,
                                memory=("device",), slots=("contiguous", "scattered")),
                ThroughputSweep(row_bytes=(4 * K, 16 * K, 64 * K), request_bytes=1 * G,
                                memory=("device",), slots=("contiguous", "scattered")),
                ThroughputSweep(row_bytes=(256 * K, 1 * M, 4 * M), request_bytes=256 * M,
                                memory=("device",), slots=("scattered",)),
                ThroughputSweep(row_bytes=(64 * K,), request_bytes=256 * M, memory=("device",),
                                directions=("pull",), slots=("scattered",)),
            ),
            latency=LatencySweep(rows=(1, 32), row_bytes=64 * K, memory=("device", "host"), samples=500, warmup=50),
            overhead=OverheadSweep(rows=(1000, 10000, 100000), slots=("contiguous", "scattered"), repeats=7),
            repetition=Repetition(warmup=3, reps=20, budget_s=4.0),
        )
    if name == "gpu2":
        return BenchConfig(
            name="gpu2", cases=GPU2_CASES, devices=(0, 1),
            throughput=(
                # issue 8: rows of 4, 16, 64 KiB at 256 MiB and 1 GiB, prefill on GPU 0, decode on GPU 1.
                ThroughputSweep(row_bytes=(4 * K, 16 * K, 64 * K), request_bytes=256 * M,
                                memory=("device",), slots=("scattered", "contiguous")),
                ThroughputSweep(row_bytes=(4 * K, 16 * K, 64 * K), request_bytes=1 * G,
                                memory=("device",), slots=("scattered", "contiguous")),
            ),
            latency=LatencySweep(rows=(1, 32), row_bytes=64 * K, memory=("device",), samples=500, warmup=50),
            repetition=Repetition(warmup=3, reps=20, budget_s=4.0),
        )
    if name == "layouts":
        return _layouts()
    if name == "store":
        return _store()
    raise ConfigError(f"unknown preset {name!r}: choose {', '.join(PRESETS)}")


PRESETS = ("cpu", "gpu", "gpu2", "layouts", "store", "tiny")
