"""Holding a backend's progress thread at a point a test observed, instead of sleeping and
hoping the transfer is somewhere in between: a cancel or a kill then lands where it should
on a fast machine and on a loaded one alike."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any


def hold_progress(backend: Any, ready: Callable[[], object] = lambda: True,
                  gates: list[threading.Event] | None = None) -> tuple[threading.Event, threading.Event]:
    """Stop ``backend``'s progress thread (its ``_step``) at the first step where ``ready()``
    holds, until the returned gate is set: ``(held, gate)``, ``held`` set once it stopped.
    Meanwhile it posts, sends, scatters, grants and concludes nothing. The gate goes into
    ``gates`` too, so that a fixture can release every held thread even when the test failed
    (a held thread keeps that backend's shutdown from joining it)."""
    held, gate = threading.Event(), threading.Event()
    if gates is not None:
        gates.append(gate)
    step: Callable[[], bool] = backend._step

    def stepping() -> bool:
        if not gate.is_set() and ready():
            held.set()
            gate.wait()
        return step()

    backend._step = stepping
    return held, gate
