"""IpcBackend between two engine geometries on one GPU, two processes: the KV is torch tensors
from the caching allocator at both ends (so a tensor starts inside a CUDA allocation, which
the peer maps whole through its IPC handle), and the active end moves a submission with ONE
layout-transform kernel (``cuda_transform_copy_then``) into or out of the peer's mapping.
Push and pull, this process at either end: TP 1 -> rank 1 of 2 and back through a narrowed
view, 16 -> 32 and 64 -> 16 token blocks, NHD <-> HND, per-layer tensors -> a block-major
pool, byte-exact, every mask True; an injected fault's exact masks; a refusal by both ends
with nothing written; the doorbell stored by the GPU after the kernel. The same scenarios
run in CI over kvxfer.testing.host_cuda (tests/twoproc/test_ipc_geometry.py).

Run on the GPU machine: ``python -m pytest -q -m gpu tests/gpu/test_ipc_geometry_gpu.py``.
"""

from __future__ import annotations

import pytest

from kvxfer import native
from kvxfer.contract import TransferMode

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not native.info().cuda_usable, reason=f"kvxfer._native CUDA: {native.info().reason}"),
    pytest.mark.skipif(not native.info().cuda_transform,
                       reason=f"kvxfer._native CUDA transform: {native.info().reason or 'not built'}"),
]

from kvxfer.testing.ipc_scenarios import (  # noqa: E402
    GEOMETRY_CASES,
    geometry_ends,
    geometry_fault_marks_whole_blocks,
    geometry_moves_byte_exact,
    geometry_refused_touching_nothing,
)

PUSH, PULL = TransferMode.PUSH, TransferMode.PULL
ROLES = {  # (mode, this process is the source)
    "push-we-publish": (PUSH, True),
    "push-we-fetch": (PUSH, False),
    "pull-we-publish": (PULL, True),
    "pull-we-fetch": (PULL, False),
}


@pytest.mark.parametrize("role", list(ROLES))
@pytest.mark.parametrize("case", list(GEOMETRY_CASES))
def test_kv_lands_in_the_other_layout_byte_exact_on_the_gpu(case: str, role: str) -> None:
    mode, local_is_source = ROLES[role]
    with geometry_ends(mode, case, cuda=None, local_is_source=local_is_source) as ends:
        geometry_moves_byte_exact(ends)


@pytest.mark.parametrize("role", list(ROLES))
def test_an_injected_fault_leaves_a_half_arrived_block_false_on_the_gpu(role: str) -> None:
    mode, local_is_source = ROLES[role]
    with geometry_ends(mode, "bt16-to-bt32", cuda=None, local_is_source=local_is_source) as ends:
        _, dst_mask = ends.plan_masks(3)
        assert dst_mask.tolist() == [True, False, False, False]
        geometry_fault_marks_whole_blocks(ends, 3)


@pytest.mark.parametrize("role", ["push-we-publish", "pull-we-fetch"])
def test_heads_the_publisher_lacks_are_refused_on_the_gpu(role: str) -> None:
    mode, local_is_source = ROLES[role]
    with geometry_ends(mode, "heads-the-publisher-lacks", cuda=None, local_is_source=local_is_source) as ends:
        geometry_refused_touching_nothing(ends, "narrow")


@pytest.mark.parametrize("role", ["push-we-publish", "pull-we-fetch"])
def test_the_doorbell_stored_after_the_kernel_ends_the_busy_polling_wait(role: str) -> None:
    mode, local_is_source = ROLES[role]
    with geometry_ends(mode, "nhd-to-hnd", cuda=None, local_is_source=local_is_source, busy_poll=True) as ends:
        geometry_moves_byte_exact(ends)
        assert ends.peer.bells_rung() == 1, "the child's wait was not ended by its doorbell"
