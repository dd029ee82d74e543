"""IpcBackend between two engine geometries in CI: two processes over kvxfer.testing.host_cuda
(shared host memory standing in for CUDA IPC), the real control path and the native layout
transform over host memory. Push and pull, with this process at either end (so either
process is the active end that maps the other's KV and queues the one transform kernel):
TP 1 -> rank 1 of 2 and back through a narrowed view, 16 -> 32 and 64 -> 16 token blocks,
NHD <-> HND, per-layer tensors -> a block-major pool; the destination's KV equals the
source's slice, every mask True. An injected fault gives exact masks (a destination block
that got only some of its runs is False); geometries that cannot meet are refused by both
ends with nothing written; a hint without the IPC exports of its geometry is refused before
it is claimed. The same transfers over real CUDA: tests/gpu/test_ipc_geometry_gpu.py.
The conformance kit (with its geometry refusals) runs over this stand-in in test_ipc_emulated.py.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import numpy as np
import pytest

from kvxfer.backends.ipc.mappings import EXTRA_PREFIX
from kvxfer.contract import Delivered, Failed, InvalidSubmission, TransferMode
from kvxfer.testing import host_cuda
from kvxfer.testing.ipc_scenarios import (
    GEOMETRY_CASES,
    geometry_ends,
    geometry_fault_marks_whole_blocks,
    geometry_moves_byte_exact,
    geometry_refused_touching_nothing,
)

PUSH, PULL = TransferMode.PUSH, TransferMode.PULL
# (mode, this process is the source): this process is the active end in the first and last.
ROLES = {
    "push-we-publish": (PUSH, True),
    "push-we-fetch": (PUSH, False),
    "pull-we-publish": (PULL, True),
    "pull-we-fetch": (PULL, False),
}
LAUNCHES = ("cuda_transform_copy_then", "cuda_transform_copy", "cuda_copy_rows_then", "cuda_copy_rows")


@pytest.fixture
def launches(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, int]]:
    """Kernel launches made in this process (the child's are its own), by call name (a
    ``_then`` call counts once, not also as the launch it makes inside)."""
    counts = dict.fromkeys(LAUNCHES, 0)
    depth = [0]
    for name in LAUNCHES:
        real = getattr(host_cuda, name)

        def counted(*args, _name=name, _real=real, **kwargs):  # type: ignore[no-untyped-def]
            counts[_name] += depth[0] == 0
            depth[0] += 1
            try:
                return _real(*args, **kwargs)
            finally:
                depth[0] -= 1

        monkeypatch.setattr(host_cuda, name, counted)
    yield counts


@pytest.mark.parametrize("role", list(ROLES))
@pytest.mark.parametrize("case", list(GEOMETRY_CASES))
def test_kv_lands_in_the_other_layout_byte_exact(case: str, role: str, launches: dict[str, int]) -> None:
    mode, local_is_source = ROLES[role]
    with geometry_ends(mode, case, cuda=host_cuda, local_is_source=local_is_source) as ends:
        geometry_moves_byte_exact(ends)
        # One kernel for the whole submission, its event in the same call; no row copies.
        want = {"cuda_transform_copy_then": 1} if ends.local_active else {}
        assert {k: v for k, v in launches.items() if v} == want


@pytest.mark.parametrize("role", list(ROLES))
def test_copies_still_in_flight_are_reported_once_their_event_completes(
        role: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(host_cuda.DELAY_ENV, "0.02")  # the spawned child inherits it
    mode, local_is_source = ROLES[role]
    with geometry_ends(mode, "bt16-to-bt32", cuda=host_cuda, local_is_source=local_is_source) as ends:
        geometry_moves_byte_exact(ends)


@pytest.mark.parametrize("role", list(ROLES))
def test_an_injected_fault_leaves_a_half_arrived_block_false(role: str) -> None:
    mode, local_is_source = ROLES[role]
    with geometry_ends(mode, "bt16-to-bt32", cuda=host_cuda, local_is_source=local_is_source) as ends:
        src_mask, dst_mask = ends.plan_masks(3)  # 16-token runs: destination block 1 gets one of two
        assert dst_mask.tolist() == [True, False, False, False]
        assert src_mask.tolist() == [True, True, True, False, False, False, False]
        geometry_fault_marks_whole_blocks(ends, 3)


@pytest.mark.parametrize("role", list(ROLES))
def test_a_fetcher_holding_heads_the_publisher_lacks_is_refused_by_both_ends(role: str) -> None:
    mode, local_is_source = ROLES[role]
    with geometry_ends(mode, "heads-the-publisher-lacks", cuda=host_cuda, local_is_source=local_is_source) as ends:
        geometry_refused_touching_nothing(ends, "narrow")


@pytest.mark.parametrize("role", ["push-we-publish", "pull-we-fetch"])
def test_a_hint_without_its_geometry_exports_is_refused_before_it_is_claimed(role: str) -> None:
    mode, local_is_source = ROLES[role]
    with geometry_ends(mode, "nhd-to-hnd", cuda=host_cuda, local_is_source=local_is_source) as ends:
        mine, theirs = (ends.read, ends.write) if local_is_source else (ends.write, ends.read)
        peer_hint = ends.peer.describe(theirs)
        handle = ends.peer.start("fetch" if local_is_source else "publish", theirs, ends.local.describe(mine))
        submit = ends.local.publish if local_is_source else ends.local.fetch
        assert theirs.geometry is not None
        for region in theirs.geometry.regions:  # every region of the peer's geometry needs its export
            assert peer_hint.extra(EXTRA_PREFIX + region.name) is not None
        last = EXTRA_PREFIX + theirs.geometry.regions[-1].name
        stripped = dataclasses.replace(peer_hint, extras=tuple(e for e in peer_hint.extras if e[0] != last))
        with pytest.raises(InvalidSubmission, match="no IPC handle"):
            submit(mine, stripped)
        assert not ends.got().any()
        # Nothing was claimed: the hint as described still moves the KV.
        attempt = submit(mine, peer_hint)
        assert attempt.wait(30) and isinstance(attempt.poll(), Delivered), attempt.poll()
        theirs_outcome, quiet = ends.peer.result(handle, 30)
        assert isinstance(theirs_outcome, Delivered) and theirs_outcome.all_delivered and quiet
        assert np.array_equal(ends.got(), ends.expected())


@pytest.mark.parametrize("role", ["push-we-publish", "pull-we-fetch"])
def test_a_launch_the_driver_refuses_fails_both_ends_with_no_row(role: str, monkeypatch: pytest.MonkeyPatch) -> None:
    def refused(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise host_cuda.CopyError("cudaLaunchKernel: cudaErrorLaunchOutOfResources")

    monkeypatch.setattr(host_cuda, "cuda_transform_copy_then", refused)  # this process only: the active end
    mode, local_is_source = ROLES[role]
    with geometry_ends(mode, "bt64-to-bt16", cuda=host_cuda, local_is_source=local_is_source) as ends:
        attempt, handle = ends.start()
        assert attempt.wait(30)
        ours = attempt.poll()
        theirs, quiet = ends.peer.result(handle, 30)
        assert quiet
        assert isinstance(ours, Failed) and isinstance(theirs, Failed), (ours, theirs)
        assert not any(m.any() for m in ours.masks) and not any(m.any() for m in theirs.masks)
        assert "layout transform launch failed" in ours.reason and "OutOfResources" in theirs.reason
        assert not ends.got().any()


@pytest.mark.parametrize("role", ["push-we-publish", "pull-we-fetch"])
def test_the_doorbell_after_the_kernel_ends_the_busy_polling_wait(role: str) -> None:
    mode, local_is_source = ROLES[role]
    with geometry_ends(mode, "layer-major-to-block-major-pool", cuda=host_cuda, local_is_source=local_is_source,
                       busy_poll=True) as ends:
        geometry_moves_byte_exact(ends)
        assert ends.peer.bells_rung() == 1, "the child's wait was not ended by its doorbell"
