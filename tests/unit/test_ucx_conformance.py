"""UcxBackend passes the conformance kit with both ends in this process (two ucxx workers):
small runs packed into messages (the default), and a message per run (``pack_bytes=0``)."""

from __future__ import annotations

import functools

import pytest

from kvxfer.backends.ucx.transport import ucxx_unavailable
from kvxfer.contract import TransferMode
from kvxfer.testing.conformance import CHECKS

if (missing := ucxx_unavailable()) is not None:  # not importorskip: importing ucxx changes os.environ
    pytest.skip(missing, allow_module_level=True)

from kvxfer.backends.ucx.runs import PACK_BYTES  # noqa: E402
from kvxfer.testing.ucx_pairs import ucx_pair  # noqa: E402


@pytest.mark.parametrize("pack_bytes", [PACK_BYTES, 0], ids=["packed", "per-run"])
@pytest.mark.parametrize("mode", list(TransferMode), ids=lambda m: m.value)
@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
def test_ucx_conformance_in_process(check, mode, pack_bytes):  # type: ignore[no-untyped-def]
    check(functools.partial(ucx_pair, pack_bytes=pack_bytes), mode)
