"""NixlBackend passes the conformance kit with both ends in this process (UCX between two agents)."""

from __future__ import annotations

import pytest

from kvxfer.contract import TransferMode
from kvxfer.testing.conformance import CHECKS
from kvxfer.testing.nixl_pairs import nixl_pair


@pytest.mark.parametrize("mode", list(TransferMode), ids=lambda m: m.value)
@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
def test_nixl_conformance_in_process(check, mode):  # type: ignore[no-untyped-def]
    check(nixl_pair, mode)
