"""``--nixl-arena-mib``: a worker's NIXL backend gets the packed path's arena it was told (or
none), and the flag is refused where it cannot apply, before anything starts."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from kvxfer import pair
from kvxfer.backends.nixl import NixlBackend
from kvxfer.backends.nixl.packed import ArenaInfo
from kvxfer.contract import CacheKind, LayerGroupRows, TokenRange, TransferMode, View
from kvxfer.engine import ModelConfig
from kvxfer.worker import serve
from kvxfer.worker.backends import make_backend
from kvxfer.worker.core import Worker, WorkerConfig

torch.set_num_threads(1)
CFG = ModelConfig(vocab_size=64, hidden=32, layers=1, heads=2, kv_heads=1, head_dim=16, intermediate=64,
                  block_tokens=4)


@pytest.mark.parametrize(("arena", "expected"), [(None, (64 << 20, 4 << 20)), (0, None), (3 << 20, (3 << 20, 3 << 19))])
def test_worker_registers_the_arena_it_was_given(arena: int | None, expected: tuple[int, int] | None) -> None:
    # Host pool: the default is 64 MiB in 4 MiB slots; 0 is none (no arena in the hint, so no
    # peer packs into this worker); 3 MiB alone cannot hold two default slots: two halves.
    async def main() -> ArenaInfo | None:
        worker = Worker(WorkerConfig(role="decode", model=CFG, num_blocks=16, backend="nixl", device="cpu",
                                     arena_bytes=arena))
        await worker.start()
        try:
            return ArenaInfo.of(worker.backend.describe(_two_rows(worker)))
        finally:
            await worker.close()

    info = asyncio.run(main())
    assert (None if info is None else (info.nbytes, info.slot_bytes)) == expected


def _two_rows(worker: Worker) -> View:
    assert worker.lender is not None
    region = worker.lender.regions[0]
    rows = np.arange(2, dtype=np.int64)
    return View("probe", TokenRange(0, 2), (LayerGroupRows("g", CacheKind.PAGED, region, rows, rows),), b"L")


def test_arena_is_refused_where_it_cannot_apply(capsys: pytest.CaptureFixture[str]) -> None:
    for bad in (-1, True, 1.5):
        with pytest.raises(ValueError, match=r"arena_bytes must be a byte count >= 0 \(0: no arena\) or None"):
            NixlBackend(arena_bytes=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="arena_bytes applies to the nixl backend only"):
        make_backend("ipc", TransferMode.PUSH, name="x", deadline_s=1.0, arena_bytes=0)
    with pytest.raises(ValueError, match="arena_bytes applies to the nixl backend only and is >= 0"):
        WorkerConfig(role="decode", backend="nixl", arena_bytes=-1)
    with pytest.raises(SystemExit) as exc:
        serve.build_parser().parse_args(["--role", "decode", "--nixl-arena-mib", "-1"])
    assert exc.value.code == 2 and "--nixl-arena-mib: must be 0 (no arena) or more, got -1" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        serve.build_parser().parse_args(["--role", "decode", "--nixl-arena-mib", "1.5"])
    assert exc.value.code == 2 and "not a whole number of MiB: '1.5'" in capsys.readouterr().err
    parser = pair.build_parser()
    args = parser.parse_args(["--backend", "ipc", "--nixl-arena-mib", "0"])
    with pytest.raises(SystemExit) as exc:
        pair.check_args(parser, args)
    assert exc.value.code == 2 and "--nixl-arena-mib applies to --backend nixl only, not ipc" in capsys.readouterr().err


@pytest.mark.parametrize("given", [[], ["--nixl-arena-mib", "0"], ["--nixl-arena-mib", "256"]])
def test_pair_hands_its_arena_to_every_worker(given: list[str]) -> None:
    args = pair.build_parser().parse_args(given)
    served = serve.build_parser().parse_args(["--role", "prefill", *pair.worker_args(args)])
    assert served.nixl_arena_mib == (int(given[1]) if given else None)
