"""The IPC backend's geometry path without a peer: the peer's segment addresses, moved onto
where its regions are mapped here, are those of a plan made with the peer's geometry
``rebased`` onto the mappings (every plane by its own region's shift); describe() of an
engine view carries the export of every region of its geometry."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvxfer.backends.common.transform import Oriented, Rows, plan_transform, rebased
from kvxfer.backends.ipc import IpcBackend
from kvxfer.backends.ipc.geometry import export_names, segment_addresses
from kvxfer.backends.ipc.mappings import EXTRA_PREFIX
from kvxfer.contract import HeadOrder, TransferMode
from kvxfer.lender.engine_kv import EngineKV
from kvxfer.lender.external import ExternalLender
from kvxfer.testing import host_cuda
from kvxfer.testing.ipc_pairs import DeviceKV
from kvxfer.testing.ipc_scenarios import kv_spec

TOKENS = 90


def layers(blocks: int, bt: int, heads: int, order: HeadOrder) -> list[torch.Tensor]:
    shape = (2, blocks, bt, heads, 8) if order is HeadOrder.NHD else (2, blocks, heads, bt, 8)
    return [torch.zeros(shape, dtype=torch.half) for _ in range(3)]


def rows(blocks: int, bt: int, seed: int) -> Rows:
    n = -(-TOKENS // bt)
    slots = np.random.default_rng(seed).permutation(blocks)[:n].astype(np.int64)
    return Rows(slots, np.arange(n, dtype=np.int64), 0, TOKENS)


@pytest.mark.parametrize("local_is_src", [True, False], ids=["peer-is-destination", "peer-is-source"])
@pytest.mark.parametrize("runs", [None, 3, 0])
def test_peer_addresses_are_those_of_the_rebased_plan(local_is_src: bool, runs: int | None) -> None:
    src = EngineKV.per_layer(layers(12, 16, 4, HeadOrder.NHD), kv_heads=4).geometry
    dst = EngineKV.per_layer(layers(8, 32, 2, HeadOrder.HND), kv_heads=4, heads=(2, 4), head_order=HeadOrder.HND,
                             name="d").geometry
    s_rows, d_rows = rows(12, 16, 1), rows(8, 32, 2)
    peer = dst if local_is_src else src
    bases = [(0x7F00_0000_0000 + i * 0x10_0000 + 4096 * (i + 1)) for i in range(len(peer.regions))]
    moved = rebased(peer, bases)
    plan = plan_transform(src, s_rows, dst, d_rows)
    want = plan_transform(src, s_rows, moved, d_rows) if local_is_src else plan_transform(moved, s_rows, dst, d_rows)
    n = plan.runs if runs is None else runs
    got_src, got_dst = segment_addresses(Oriented(plan, local_is_src), bases, n)
    end = n * plan.planes
    assert np.array_equal(got_src, want.src_addr[:end]) and np.array_equal(got_dst, want.dst_addr[:end])
    assert got_src.flags.c_contiguous and got_dst.flags.c_contiguous and got_src.dtype == np.int64


def test_describe_of_an_engine_view_carries_the_export_of_every_region() -> None:
    kv = DeviceKV(kv_spec(layers=3), cuda=host_cuda)
    backend = IpcBackend("describer", TransferMode.PUSH, cuda=host_cuda)
    try:
        backend.register(kv.regions)
        assert all(offset >= 4096 for offset in kv.offsets.values()), "the regions start inside an allocation"
        view = ExternalLender(kv.kv).lend_write("r", np.arange(4), (0, 60)).view()
        assert view.geometry is not None and len(view.geometry.regions) == 3
        assert export_names(view) == [r.name for r in view.geometry.regions]
        hint = backend.describe(view)
        assert hint.geometry == view.geometry
        for region in view.geometry.regions:
            assert hint.extra(EXTRA_PREFIX + region.name) is not None, region.name
    finally:
        assert backend.shutdown() == frozenset()
        kv.close()
