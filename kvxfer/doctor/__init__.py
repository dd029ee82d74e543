"""``kvxfer doctor``: which transport really carries the bytes.

``report`` is the command (NIXL's lanes on this host, per memory kind, push and pull, with the
remedy when a lane is TCP); ``probe`` is the pair of processes a lane probe runs; ``ucx`` the
lane the ucx backend's own UCX takes; ``peer`` (``--peer URL``) the lanes to a worker on
another host.

Nothing is imported here: ``python -m kvxfer.doctor.probe`` and ``-m kvxfer.doctor.ucx`` run
in processes of their own, which must not load the report (NIXL's tooling beside ucxx's).
"""

from __future__ import annotations


def main(argv: list[str] | None = None) -> int:
    """``kvxfer doctor`` (``kvxfer.doctor.report.main``)."""
    from kvxfer.doctor.report import main as report  # noqa: PLC0415 - see the module

    return report(argv)
