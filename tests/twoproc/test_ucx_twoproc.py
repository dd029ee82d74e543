"""UcxBackend passes the conformance kit with its peer in a child process (UCX between two
processes on this host), push and pull."""

from __future__ import annotations

import pytest

from kvxfer.backends.ucx.transport import ucxx_unavailable
from kvxfer.contract import TransferMode
from kvxfer.testing.conformance import CHECKS

if (missing := ucxx_unavailable()) is not None:  # not importorskip: importing ucxx changes os.environ
    pytest.skip(missing, allow_module_level=True)

from kvxfer.testing.ucx_pairs import ChildPairs  # noqa: E402


@pytest.fixture(scope="module")
def keeps_child():  # type: ignore[no-untyped-def]
    yield from ChildPairs.kept()


@pytest.mark.parametrize("mode", list(TransferMode), ids=lambda m: m.value)
@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
def test_ucx_conformance_two_processes(keeps_child, check, mode):  # type: ignore[no-untyped-def]
    check(keeps_child, mode)
