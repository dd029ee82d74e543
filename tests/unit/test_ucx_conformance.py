"""UcxBackend passes the conformance kit with both ends in this process (two ucxx workers)."""

from __future__ import annotations

import pytest

from kvxfer.contract import TransferMode
from kvxfer.testing.conformance import CHECKS

pytest.importorskip("ucxx", reason="the ucx backend needs ucxx (pip install 'kvxfer[ucx]')", exc_type=ImportError)

from kvxfer.testing.ucx_pairs import ucx_pair  # noqa: E402


@pytest.mark.parametrize("mode", list(TransferMode), ids=lambda m: m.value)
@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
def test_ucx_conformance_in_process(check, mode):  # type: ignore[no-untyped-def]
    check(ucx_pair, mode)
