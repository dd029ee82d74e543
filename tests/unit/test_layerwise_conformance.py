"""The conformance kit's layer-wise streaming case (a group published after the fetch was
submitted, one hint per group) over the backends the workers stream layer groups with."""

from __future__ import annotations

import functools
from collections.abc import Callable

import pytest

from kvxfer.contract import TransferMode
from kvxfer.testing.conformance import PairFactory
from kvxfer.testing.conformance.layer_checks import STREAMING_CHECKS
from kvxfer.testing.nixl_pairs import nixl_pair
from kvxfer.testing.pairs import loopback_pair


@pytest.mark.parametrize("mode", list(TransferMode), ids=lambda m: m.value)
@pytest.mark.parametrize("check", STREAMING_CHECKS, ids=lambda c: c.__name__)
def test_loopback_streams_layer_groups(check: Callable[[PairFactory, TransferMode], None], mode: TransferMode) -> None:
    check(loopback_pair, mode)


@pytest.mark.parametrize("packed", ["always", "never"])
@pytest.mark.parametrize("mode", list(TransferMode), ids=lambda m: m.value)
@pytest.mark.parametrize("check", STREAMING_CHECKS, ids=lambda c: c.__name__)
def test_nixl_streams_layer_groups(check: Callable[[PairFactory, TransferMode], None], mode: TransferMode,
                                   packed: str) -> None:
    check(functools.partial(nixl_pair, packed=packed, arena_bytes=8 << 20, packed_chunk_bytes=1 << 20), mode)
