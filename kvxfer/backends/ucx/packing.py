"""Small host runs travel packed: the publisher copies the rows of several runs into one
buffer and sends it as one tag message (one rendezvous instead of one per run); the fetcher
receives it into a buffer of its own and copies each run's rows into place. Messages are
grouped by ``RunPlan.chunk_end``; a message may end part way (an injected fault), so the
fetcher reads how many rows of each run it holds from its length."""

from __future__ import annotations

import numpy as np

from kvxfer.backends.ucx.runs import RunPlan
from kvxfer.backends.ucx.transport import memory_span
from kvxfer.contract import IndexArray, MemoryKind, View


def _rows_span(view: View, plan: RunPlan, run: int, skip: int, rows: int) -> np.ndarray:
    """Host memory of ``rows`` rows of ``run``, from its ``skip``-th row on."""
    region = view.groups[int(plan.local_group[run])].region
    address = region.address + int(plan.local_slot[run] + skip) * region.slot_bytes
    return memory_span(address, rows * region.slot_bytes, False)


def run_memory(view: View, plan: RunPlan, run: int, nbytes: int) -> object:
    """The first ``nbytes`` of a run's rows, in place (host or device), to send from or
    receive into without a copy."""
    region = view.groups[int(plan.local_group[run])].region
    return memory_span(region.address + int(plan.local_slot[run]) * region.slot_bytes, nbytes,
                       region.memory_kind is MemoryKind.DEVICE)


def gather(view: View, plan: RunPlan, first: int, end: int, counts: IndexArray) -> np.ndarray:
    """The first ``counts[i]`` rows of runs ``first..end-1`` back to back, in a new buffer."""
    nbytes = counts * plan.row_bytes[first:end]
    out = np.empty(int(nbytes.sum()), np.uint8)
    offset = 0
    for i, run in enumerate(range(first, end)):
        n = int(nbytes[i])
        if n:
            out[offset:offset + n] = _rows_span(view, plan, run, 0, int(counts[i]))
            offset += n
    return out


def split(plan: RunPlan, first: int, end: int, nbytes: int) -> IndexArray | None:
    """Rows of each run of a message of ``nbytes`` covering runs ``first..end-1``, filled in
    order (whole runs, then part of one); None when the length ends inside a row or runs past
    the runs."""
    counts = np.zeros(end - first, np.int64)
    left = nbytes
    for i, run in enumerate(range(first, end)):
        row_bytes = int(plan.row_bytes[run])
        rows = min(int(plan.lengths[run]), left // row_bytes)
        counts[i] = rows
        left -= rows * row_bytes
        if rows < plan.lengths[run]:
            break
    return counts if left == 0 and counts.sum() > 0 else None


def scatter(view: View, plan: RunPlan, first: int, counts: IndexArray, buffer: np.ndarray) -> None:
    """Copy a received message's rows into place (each run from its first row)."""
    offset = 0
    for i, rows in enumerate(counts.tolist()):
        if rows:
            run = first + i
            n = rows * int(plan.row_bytes[run])
            _rows_span(view, plan, run, 0, rows)[:] = buffer[offset:offset + n]
            offset += n
