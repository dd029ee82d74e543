"""The loopback reference backend passes the conformance kit, in both modes."""

from __future__ import annotations

import pytest

from kvxfer.contract import TransferMode
from kvxfer.testing.conformance import CHECKS
from kvxfer.testing.pairs import loopback_pair


@pytest.mark.parametrize("mode", list(TransferMode), ids=lambda m: m.value)
@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
def test_loopback_conformance(check, mode):  # type: ignore[no-untyped-def]
    check(loopback_pair, mode)
