"""UcxBackend over device memory between two processes: the conformance kit, push and pull,
where ucxx was built with CUDA (the ucxx-cu13 wheels, carried to the GPU machine as NIXL's
are). Skipped cleanly without CUDA or ucxx."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvxfer.backends.ucx.transport import ucxx_unavailable
from kvxfer.contract import MemoryKind, TransferMode

torch = pytest.importorskip("torch")
if (missing := ucxx_unavailable()) is not None:  # not importorskip: importing ucxx changes os.environ
    pytest.skip(missing, allow_module_level=True)
pytestmark = pytest.mark.gpu

from kvxfer.testing.conformance import CHECKS  # noqa: E402
from kvxfer.testing.ucx_pairs import ChildPairs  # noqa: E402


@pytest.fixture(scope="module")
def device_pairs() -> Iterator[ChildPairs]:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from kvxfer.backends.ucx import UcxBackend  # noqa: PLC0415

    probe = UcxBackend()
    reach = probe.capabilities.memory_kinds
    probe.shutdown()
    if MemoryKind.DEVICE not in reach:
        pytest.skip("this ucxx has no CUDA support")
    yield from ChildPairs.kept(memory_kind="device")


@pytest.mark.parametrize("mode", list(TransferMode), ids=lambda m: m.value)
@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
def test_ucx_vram_conformance_two_processes(check, mode, device_pairs):  # type: ignore[no-untyped-def]
    check(device_pairs, mode)
