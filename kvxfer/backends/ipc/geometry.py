"""An IpcBackend's path for engine geometries: KV moved between two layouts by one kernel.

A submission whose view and hint both carry a geometry (``kvxfer.contract.geometry``) is
planned by ``plan_between`` (``kvxfer.backends.common.transform``) in ``_submit``, right
after its checks and before the hint is claimed or anything mapped: a LayoutMismatch
refuses it with nothing touched and no peer told. Only the active end (push: the publisher;
pull: the fetcher) plans; the passive end waits for its record as for rows.

- describe() of a geometry view carries an IPC export for every region of its geometry
  (``export_names``), and the active end checks, before claiming, that the peer's hint has
  one for each region of the peer's geometry, holding the region (``peer_exports``).
- At launch (``queue_transform``) the active end maps those allocations (a region may start
  inside one: torch's caching allocator), moves the plan's peer addresses onto the mappings
  (each plane by its region's shift: what ``rebased`` and a second plan would give, without
  planning again), and queues ONE ``cuda_transform_copy_then`` for every run of the
  submission, followed on the stream by the doorbell store and the completion event, as
  the row path does.
- Masks are ``Oriented.sealed_masks(runs)``, reported once the event completes: all runs or none.
  ``fail_after_rows`` counts runs: only that prefix is copied, so that a destination block
  that got only some of its runs is False. A launch the driver refuses queued nothing: no
  row is True.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import numpy as np

from kvxfer.backends.common.transform import Oriented, plan_between
from kvxfer.backends.ipc.jobs import ActiveJob
from kvxfer.backends.ipc.mappings import Export
from kvxfer.contract import Hint, IndexArray, InvalidSubmission, MemoryKind, View, constant_mask

if TYPE_CHECKING:
    from kvxfer.backends.ipc.copies import CopyQueue

log = logging.getLogger(__name__)


def export_names(view: View) -> list[str]:
    """The regions whose IPC exports a describe() of ``view`` carries: its groups' and, for
    an engine view, every region of its geometry."""
    names = dict.fromkeys(g.region.name for g in view.groups)
    if view.geometry is not None:
        names.update(dict.fromkeys(r.name for r in view.geometry.regions))
    return list(names)


def plan_submission(view: View, hint: Hint, *, fetching: bool, active: bool) -> Oriented | None:
    """The active end's plan of a submission between two geometries (LayoutMismatch names why
    they cannot meet); None for rows, and at the passive end."""
    if not active or view.geometry is None:
        return None
    return plan_between(view, hint, fetching=fetching)


def peer_exports(queue: CopyQueue, hint: Hint) -> dict[str, Export]:
    """The allocation behind each region of the peer's geometry, by region name;
    InvalidSubmission when its memory is not device memory or its hint lacks an export."""
    assert hint.geometry is not None
    exports: dict[str, Export] = {}
    for region in hint.geometry.regions:
        if region.memory_kind is not MemoryKind.DEVICE:
            raise InvalidSubmission(f"the peer's KV region {region.name!r} is {region.memory_kind.name} memory")
        exports[region.name] = queue.export_of(hint, region.name, region.address, region.nbytes)
    return exports


def queue_transform(queue: CopyQueue, job: ActiveJob, fail_after_rows: int | None) -> None:
    """Queue the job's one transform kernel, then its doorbell store and event (owner thread,
    under launch_lock); its masks are set for when the event completes."""
    transform = job.transform
    assert transform is not None
    plan = transform.plan
    runs = plan.runs if fail_after_rows is None else max(0, min(plan.runs, fail_after_rows))
    if runs < plan.runs:
        job.failure = f"injected fault after {runs} runs"
    if job.hint.endpoint in queue.gone:
        job.failure = f"peer {job.hint.agent!r} is gone"
        runs = 0
    addresses = _addresses(queue, job, runs) if runs else None
    if addresses is None:
        _set_masks(job, transform, 0)
        return
    _set_masks(job, transform, runs)  # before the launch: the doorbell is stored only for every row
    every_row = all(bool(m.all()) for m in job.peer_masks)
    event, event_error = queue.take_event()
    bell_ptr, bell_value = queue.bell_target(job, sum(map(len, job.hint.groups)) if every_row else -1)
    queued, recorded, launch_event_error = _launch(queue, job, addresses, runs, (bell_ptr, bell_value, event))
    if not queued:
        _set_masks(job, transform, 0)
    if not queue.seal(job, event, recorded, event_error or launch_event_error):
        _set_masks(job, transform, 0)


def _launch(queue: CopyQueue, job: ActiveJob, addresses: tuple[IndexArray, IndexArray], runs: int,
            then: tuple[int, int, int]) -> tuple[bool, bool, str | None]:
    """One call queues the kernel and, when ``then`` names an event, the doorbell store and
    the event record: (kernel queued, event recorded, why the event was not). A launch the
    driver refuses queued nothing (job.failure says why)."""
    plan = job.transform.plan  # type: ignore[union-attr]
    seg = plan.segment_range(0, runs)
    src, dst = addresses
    s, d = plan.src, plan.dst
    args = (src, dst, plan.tokens[seg], plan.heads, d.unit_bytes, s.token_stride, s.head_stride,
            d.token_stride, d.head_stride, queue.stream, queue.device)
    bell_ptr, bell_value, event = then
    native = queue.native
    recorded, event_error = False, None
    try:
        if event:
            bell_error, error = native.cuda_transform_copy_then(*args, bell_ptr, bell_value, event)
            if bell_error:
                log.info("IPC backend %s: doorbell store failed (%s); the record still goes", queue.name, bell_error)
            recorded, event_error = not error, error or None
        else:
            native.cuda_transform_copy(*args)
    except (native.CopyError, MemoryError, RuntimeError) as exc:
        job.failure = f"layout transform launch failed: {exc}"
        return False, False, None
    job.launched = True
    job.nbytes += int(plan.run_tokens[:runs].sum()) * plan.planes * plan.heads * d.unit_bytes
    return True, recorded, event_error


def _addresses(queue: CopyQueue, job: ActiveJob, runs: int) -> tuple[IndexArray, IndexArray] | None:
    """(source, destination) addresses of the first ``runs`` runs' segments here, with the
    peer's regions mapped (the job holds the mappings); None when they cannot be
    (job.failure says why)."""
    transform = job.transform
    assert transform is not None
    plan = transform.plan
    peer = plan.dst if transform.local_is_src else plan.src
    bases = []
    for region in peer.regions:
        try:
            with queue.map_lock:
                mapping = queue.mappings.acquire(job.hint.endpoint, job.exports[region.name])
        except (queue.native.CopyError, RuntimeError) as exc:
            job.failure = f"cannot map the peer's region {region.name!r}: {exc}"
            return None
        job.mappings.append(mapping)
        base = mapping.translate(region.address, region.nbytes)
        if base is None:
            job.failure = f"peer region {region.name!r} lies outside its mapped allocation"
            return None
        bases.append(base)
    return segment_addresses(transform, bases, runs)


def segment_addresses(transform: Oriented, bases: list[int], runs: int) -> tuple[IndexArray, IndexArray]:
    """(source, destination) addresses of the first ``runs`` runs' segments, the peer's
    geometry regions at ``bases`` here: the plan's own addresses as a plan with the peer's
    geometry ``rebased`` onto ``bases`` would have them."""
    plan = transform.plan
    peer = plan.dst if transform.local_is_src else plan.src
    # Segments go run by run, plane by plane: a plane moves by its region's shift.
    shift = np.array([bases[r] - peer.regions[r].address for r, _ in peer.planes], dtype=np.int64)
    end = runs * plan.planes
    theirs = plan.dst_addr if transform.local_is_src else plan.src_addr
    moved = np.ascontiguousarray((theirs[:end].reshape(runs, plan.planes) + shift).ravel())
    if transform.local_is_src:
        return plan.src_addr[:end], moved
    return moved, plan.dst_addr[:end]


def _set_masks(job: ActiveJob, transform: Oriented, runs: int) -> None:
    """The rows the first ``runs`` runs prove, read-only (outcomes and records take them)."""
    if runs == 0:
        job.local_masks = [constant_mask(len(g), False) for g in job.view.groups]
        job.peer_masks = [constant_mask(len(g), False) for g in job.hint.groups]
        return
    job.local_masks, job.peer_masks = transform.sealed_masks(runs)
