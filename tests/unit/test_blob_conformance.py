"""The conformance kit over the blob backend and the in-memory store."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from kvxfer.contract import TransferMode
from kvxfer.testing.blob_pairs import blob_pair
from kvxfer.testing.conformance import CHECKS, PairFactory


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("mode", list(TransferMode), ids=lambda m: m.value)
def test_conformance(check: Callable[[PairFactory, TransferMode], None], mode: TransferMode) -> None:
    check(blob_pair, mode)
