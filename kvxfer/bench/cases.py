"""Cases are pluggable: each declares what it needs, and absent needs become 'skipped: why'.

A case is a named factory of a runner. The registry checks a case's requirements
(CUDA, NIXL, a kvxfer backend module, ...) against this machine once per run; a case whose
requirement is absent is reported as skipped with the reason, never replaced by another.
A runner may also skip one point (``Skip``), e.g. a baseline that would post too many
descriptors, or a memory kind the case cannot reach.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import importlib
import importlib.util
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvxfer.backends.nixl.loader import nixl_api
from kvxfer.bench.config import BenchConfig, LatencySweep, OverheadSweep, Point
from kvxfer.contract import KvxferError


class Requirement(enum.Enum):
    CUDA = "a CUDA device (torch.cuda.is_available())"
    NIXL = "the nixl package (nixl._api)"
    KVXFER_NIXL = "kvxfer.backends.nixl"
    KVXFER_IPC = "kvxfer.backends.ipc and its two-process test pair (kvxfer.testing.ipc_pairs)"
    KVXFER_PACKED = "the packed NIXL path (kvxfer.backends.nixl with packed rows)"
    SUBPROCESS_PEER = "kvxfer.testing.subprocess_peer"
    UCXX = "the ucxx package (ucxx._lib.libucxx) and kvxfer.backends.ucx"


class Role(enum.Enum):
    REFERENCE = "reference"    # the physical ceiling: a local copy
    CEILING = "ceiling"        # the transport's own best: one descriptor
    BASELINE = "baseline"      # how others use the transport
    BACKEND = "backend"        # kvxfer itself


class Skip(KvxferError):
    """This case cannot measure this point; the message says why."""


@dataclass(frozen=True)
class Measurement:
    """What a runner measured: metrics (numbers) and facts about how (descriptors, verified...)."""

    metrics: dict[str, float]
    facts: dict[str, Any] = field(default_factory=dict)


class CaseRunner(Protocol):
    def throughput(self, point: Point) -> Measurement: ...
    def latency(self, point: Point, sweep: LatencySweep) -> Measurement: ...
    def overhead(self, point: Point, sweep: OverheadSweep) -> Measurement: ...
    def close(self) -> None: ...


@dataclass(frozen=True)
class CaseSpec:
    """``depends``: the point fields a figure of this case varies with; other fields are
    not part of its identity, so a reference is measured once and shared by every point."""

    name: str
    title: str
    role: Role
    needs: frozenset[Requirement]
    depends: tuple[str, ...]
    modes: frozenset[str]
    factory: Callable[[BenchConfig], CaseRunner]

    def key(self, point: Point) -> tuple[tuple[str, Any], ...]:
        d = point.as_dict()
        return tuple((f, d[f]) for f in (*self.depends, "total_bytes"))


def _has_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _ipc_missing() -> str | None:
    missing = [m for m in ("kvxfer.backends.ipc", "kvxfer.testing.ipc_pairs") if not _has_module(m)]
    if missing:
        return f"{' and '.join(missing)} do{'es' if len(missing) == 1 else ''} not exist yet"
    from kvxfer import native

    state = native.info()
    return None if state.cuda_usable else f"kvxfer._native has no usable CUDA ({state.reason})"


def _ucxx_missing() -> str | None:
    if not _has_module("kvxfer.backends.ucx"):
        return "kvxfer.backends.ucx is absent"
    from kvxfer.backends.ucx.transport import ucxx_unavailable  # noqa: PLC0415 - keeps UCX_* out of os.environ

    try:
        return ucxx_unavailable()
    except OSError as err:  # a wheel whose libraries do not load
        return f"ucxx does not import (pip install 'kvxfer[ucx]'): {err}"


@functools.cache
def requirement_missing(req: Requirement) -> str | None:
    """None when ``req`` is met on this machine, else why not."""
    if req is Requirement.CUDA:
        try:
            import torch
        except ImportError:
            return "torch is not installed"
        return None if torch.cuda.is_available() else "no CUDA device"
    if req is Requirement.NIXL:
        os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")  # NIXL logs INFO to stdout, amid our tables
        try:
            nixl_api()
        except Exception as err:  # the wheel raises ImportError or OSError on a broken install
            return f"nixl does not import: {err}"
        return None
    if req is Requirement.KVXFER_NIXL:
        return None if _has_module("kvxfer.backends.nixl") else "kvxfer.backends.nixl does not exist yet"
    if req is Requirement.KVXFER_IPC:
        return _ipc_missing()
    if req is Requirement.UCXX:
        return _ucxx_missing()
    if req is Requirement.SUBPROCESS_PEER:
        return None if _has_module("kvxfer.testing.subprocess_peer") else "kvxfer.testing.subprocess_peer is absent"
    if req is Requirement.KVXFER_PACKED:
        if not _has_module("kvxfer.backends.nixl"):
            return "kvxfer.backends.nixl does not exist yet"
        mod = importlib.import_module("kvxfer.backends.nixl")
        return None if hasattr(mod, "PACKED") or hasattr(mod, "PackedNixlBackend") else "no packed NIXL path yet"
    raise AssertionError(req)


def devices_missing(config: BenchConfig) -> str | None:
    """None when device memory can be placed as ``config.devices`` asks, else why not."""
    cuda = requirement_missing(Requirement.CUDA)
    if cuda:
        return cuda
    import torch

    count = torch.cuda.device_count()
    absent = sorted({d for d in config.devices if d >= count})
    if absent:
        p, d = config.devices
        return (f"--devices {p},{d} (the preset's unless given): cuda:{absent[0]} is not visible "
                f"({count} CUDA device{'' if count == 1 else 's'}: cuda:0..cuda:{count - 1}); pass --devices "
                f"with visible indices, e.g. --devices 0,0")
    return None


def device_scope(memory: str, device: int) -> contextlib.AbstractContextManager[Any]:
    """``device`` current while an end over device memory is built here, as a worker on that
    GPU has it (NIXL/UCX may take the current device); nothing for host memory, or where
    torch has no CUDA (device rows emulated in host memory by kvxfer.testing.host_cuda)."""
    if memory != "device":
        return contextlib.nullcontext()
    import torch

    return torch.cuda.device(device) if torch.cuda.is_available() else contextlib.nullcontext()


def unmet(spec: CaseSpec) -> str | None:
    reasons = [r for r in (requirement_missing(req) for req in sorted(spec.needs, key=lambda r: r.name)) if r]
    return "; ".join(reasons) if reasons else None


_SHARED_CLOSERS: list[Callable[[], None]] = []


def hold_until_run_end(close: Callable[[], None]) -> None:
    """Keep a resource that several cases share (a baseline's second process) until the run ends."""
    _SHARED_CLOSERS.append(close)


def release_shared() -> None:
    """Close every shared resource, newest first; the runner calls this when a run ends."""
    while _SHARED_CLOSERS:
        _SHARED_CLOSERS.pop()()
