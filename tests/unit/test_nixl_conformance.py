"""NixlBackend passes the conformance kit with both ends in this process (UCX between two agents),
with the packed path forced on (every push goes packed) and off."""

from __future__ import annotations

import functools

import pytest

from kvxfer.contract import TransferMode
from kvxfer.testing.conformance import CHECKS
from kvxfer.testing.nixl_pairs import nixl_pair


@pytest.mark.parametrize("packed", ["always", "never"])
@pytest.mark.parametrize("mode", list(TransferMode), ids=lambda m: m.value)
@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
def test_nixl_conformance_in_process(check, mode, packed):  # type: ignore[no-untyped-def]
    check(functools.partial(nixl_pair, packed=packed, arena_bytes=8 << 20, packed_chunk_bytes=1 << 20), mode)
