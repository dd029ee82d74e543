"""The versioned record of a run: machine, versions, config and every figure, as JSON.

Schema ``kvxfer-bench`` version 1. A figure is identified by its mode, case and the point
fields the case varies with (``key``), so two runs compare figure by figure. Skipped and
failed figures are kept with their reason: absence is a result too.
"""

from __future__ import annotations

import ctypes
import datetime as dt
import glob
import importlib.metadata
import json
import os
import platform
import socket
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvxfer.backends.nixl.loader import nixl_api
from kvxfer.contract import KvxferError

SCHEMA = "kvxfer-bench"
SCHEMA_VERSION = 1
MODES = ("throughput", "latency", "overhead")
STATUSES = ("ok", "skipped", "error")


class ResultError(KvxferError, ValueError):
    """A results file is not a kvxfer bench result this version can read; the message says why."""


@dataclass(frozen=True)
class Figure:
    mode: str
    case: str
    role: str
    key: dict[str, Any]
    status: str
    reason: str = ""
    metrics: dict[str, float] = field(default_factory=dict)
    facts: dict[str, Any] = field(default_factory=dict)

    @property
    def id(self) -> str:
        return f"{self.mode}/{self.case}/" + "/".join(f"{k}={v}" for k, v in self.key.items())

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def get(self, name: str) -> float | None:
        """A metric, including derived GB/s for throughput figures."""
        if name in self.metrics:
            return self.metrics[name]
        if self.mode == "throughput" and name in ("gbps_best", "gbps_median") and self.ok:
            seconds = self.metrics["seconds_" + name.split("_")[1]]
            return self.key["total_bytes"] / seconds / 1e9
        return None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.id, "mode": self.mode, "case": self.case, "role": self.role,
                               "key": self.key, "status": self.status}
        if self.reason:
            out["reason"] = self.reason
        metrics = dict(self.metrics)
        if self.mode == "throughput" and self.ok:
            metrics["gbps_best"] = self.key["total_bytes"] / self.metrics["seconds_best"] / 1e9
            metrics["gbps_median"] = self.key["total_bytes"] / self.metrics["seconds_median"] / 1e9
        out["metrics"] = metrics
        out["facts"] = self.facts
        return out

    @staticmethod
    def from_json(d: dict[str, Any], where: str) -> Figure:
        for name, kind in (("mode", str), ("case", str), ("role", str), ("key", dict), ("status", str),
                           ("metrics", dict)):
            if not isinstance(d.get(name), kind):
                raise ResultError(f"{where}: field {name!r} missing or not a {kind.__name__}")
        if d["mode"] not in MODES:
            raise ResultError(f"{where}: unknown mode {d['mode']!r}")
        if d["status"] not in STATUSES:
            raise ResultError(f"{where}: unknown status {d['status']!r}")
        metrics = {k: float(v) for k, v in d["metrics"].items() if k not in ("gbps_best", "gbps_median")}
        if d["status"] == "ok" and d["mode"] == "throughput" and "seconds_best" not in metrics:
            raise ResultError(f"{where}: an ok throughput figure needs seconds_best")
        return Figure(d["mode"], d["case"], d["role"], dict(d["key"]), d["status"], d.get("reason", ""),
                      metrics, dict(d.get("facts", {})))


@dataclass(frozen=True)
class BenchResult:
    created: str
    machine: dict[str, Any]
    versions: dict[str, Any]
    config: dict[str, Any]
    figures: tuple[Figure, ...]
    duration_s: float = 0.0
    schema_version: int = SCHEMA_VERSION
    # Ctrl-C (or SIGTERM) ended the run; not stored: the figures it did not run say so by their reason.
    interrupted: bool = False

    def find(self, figure_id: str) -> Figure | None:
        for f in self.figures:
            if f.id == figure_id:
                return f
        return None

    def to_json(self, targets: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        return {
            "schema": SCHEMA, "schema_version": self.schema_version, "created": self.created,
            "duration_s": round(self.duration_s, 3), "machine": self.machine, "versions": self.versions,
            "config": self.config, "figures": [f.to_json() for f in self.figures],
            "targets": targets if targets is not None else [],
        }

    @staticmethod
    def from_json(d: Any, where: str = "result") -> BenchResult:
        if not isinstance(d, dict) or d.get("schema") != SCHEMA:
            raise ResultError(f"{where}: not a kvxfer bench result (schema is not {SCHEMA!r})")
        if d.get("schema_version") != SCHEMA_VERSION:
            raise ResultError(f"{where}: schema version {d.get('schema_version')!r}, this kvxfer reads {SCHEMA_VERSION}")
        for name in ("machine", "versions", "config"):
            if not isinstance(d.get(name), dict):
                raise ResultError(f"{where}: field {name!r} missing or not an object")
        if not isinstance(d.get("figures"), list):
            raise ResultError(f"{where}: field 'figures' missing or not a list")
        figures = tuple(Figure.from_json(f, f"{where}: figure {i}") for i, f in enumerate(d["figures"]))
        return BenchResult(str(d.get("created", "")), d["machine"], d["versions"], d["config"], figures,
                           float(d.get("duration_s", 0.0)))


def write(result: BenchResult, path: Path, targets: list[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result.to_json(targets), indent=1, sort_keys=False) + "\n")


def load(path: Path) -> BenchResult:
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError as err:
        raise ResultError(f"{path}: no such file") from err
    except json.JSONDecodeError as err:
        raise ResultError(f"{path}: not JSON ({err})") from err
    return BenchResult.from_json(data, str(path))


def now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


def machine() -> dict[str, Any]:
    info: dict[str, Any] = {"hostname": socket.gethostname(), "platform": platform.platform(),
                            "cores": os.cpu_count(), "cpu": platform.processor() or platform.machine()}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                info["memory_bytes"] = int(line.split()[1]) * 1024
                break
    except OSError:
        pass
    info["gpu"] = None
    try:
        import torch

        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
            info["gpu_count"] = count = torch.cuda.device_count()
            if count > 1:  # whether kernels of one GPU can reach another's memory (NVLink or PCIe P2P)
                info["gpu_peer_access"] = all(torch.cuda.can_device_access_peer(a, b)
                                              for a in range(count) for b in range(count) if a != b)
    except ImportError:
        pass
    return info


def _dist_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def ucx_version() -> str | None:
    """UCX as bundled in the NIXL wheel that imports here, read from libucp itself."""
    try:
        api = nixl_api()

        package = os.path.dirname(sys.modules[api.nixl_agent.__module__].__file__ or "")
        for lib_path in sorted(glob.glob(package + ".libs/libucp*.so*")) + sorted(glob.glob(package + "/**/libucp.so*",
                                                                                         recursive=True)):
            lib = ctypes.CDLL(lib_path)
            fn = lib.ucp_get_version_string
            fn.restype = ctypes.c_char_p
            return str(fn().decode())
    except Exception:  # optional information: any failure means "unknown"
        return None
    return None


def source_revision() -> str | None:
    """The git commit the kvxfer package was imported from, "+dirty" when its tree has local
    changes; None outside a checkout (an installed wheel, a copy the checkout does not
    track) or without git."""
    import subprocess

    here = os.path.dirname(os.path.abspath(__file__))
    try:
        # A copy of the package inside some other checkout (an untracked folder) is not
        # that checkout's code: its commit would be a wrong answer, so none is given.
        subprocess.run(["git", "-C", here, "ls-files", "--error-unmatch", os.path.basename(__file__)],
                       capture_output=True, timeout=5, check=True)
        head = subprocess.run(["git", "-C", here, "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True,
                              timeout=5, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", here, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=5, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return f"{head}+dirty" if dirty else head or None


def versions() -> dict[str, Any]:
    from kvxfer import __version__

    out: dict[str, Any] = {"kvxfer": __version__, "kvxfer_revision": source_revision(),
                           "python": platform.python_version(), "numpy": _dist_version("numpy"),
                           "torch": _dist_version("torch"), "nixl": _dist_version("nixl"), "ucx": ucx_version(),
                           "cuda": None}
    try:
        import torch

        out["cuda"] = torch.version.cuda
    except ImportError:
        pass
    try:  # which row copy ran: the compiled module, or the numpy/torch fallback
        from kvxfer import native

        info = native.info()
        out["kvxfer_native"] = {"compiled": info.compiled, "cuda_usable": info.cuda_usable, "reason": info.reason}
    except Exception:  # optional information
        out["kvxfer_native"] = None
    return out
