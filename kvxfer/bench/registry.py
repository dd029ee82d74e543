"""Every benchmark case, by name: the case modules' SPECS together. Apart from
``kvxfer.bench.cases``, which the case modules import, so that nothing imports in a circle."""

from __future__ import annotations

from kvxfer.bench import backend_cases, ipc_kernel, layouts, local, nixl_raw, store_cases, two_process
from kvxfer.bench.cases import CaseSpec


def registry() -> dict[str, CaseSpec]:
    """Every known case, by name (a case's heavy imports still load only when it runs)."""
    specs = [*local.SPECS, *nixl_raw.SPECS, *ipc_kernel.SPECS, *backend_cases.SPECS, *two_process.SPECS,
             *layouts.SPECS, *store_cases.SPECS]
    return {s.name: s for s in specs}
