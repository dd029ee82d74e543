"""The conformance kit's layer-wise streaming case over the ucx backend (a module of its own:
importing ucxx changes os.environ), both modes, packed runs and a message per run."""

from __future__ import annotations

import functools
from collections.abc import Callable

import pytest

from kvxfer.backends.ucx.transport import ucxx_unavailable
from kvxfer.contract import TransferMode
from kvxfer.testing.conformance import PairFactory
from kvxfer.testing.conformance.layer_checks import STREAMING_CHECKS

if (missing := ucxx_unavailable()) is not None:  # not importorskip: importing ucxx changes os.environ
    pytest.skip(missing, allow_module_level=True)

from kvxfer.backends.ucx.runs import PACK_BYTES  # noqa: E402
from kvxfer.testing.ucx_pairs import ucx_pair  # noqa: E402


@pytest.mark.parametrize("pack_bytes", [PACK_BYTES, 0], ids=["packed", "per-run"])
@pytest.mark.parametrize("mode", list(TransferMode), ids=lambda m: m.value)
@pytest.mark.parametrize("check", STREAMING_CHECKS, ids=lambda c: c.__name__)
def test_ucx_streams_layer_groups(check: Callable[[PairFactory, TransferMode], None], mode: TransferMode,
                                  pack_bytes: int) -> None:
    check(functools.partial(ucx_pair, pack_bytes=pack_bytes), mode)
