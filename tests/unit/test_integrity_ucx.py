"""Row integrity over the ucx backend (host memory): the publisher sends the digests of the
rows it sent in a record after its last send; the fetcher checks its rows where they landed.
A corrupted row is False and named, a clean one exact, and ends that disagree on integrity
refuse the rows by name instead of hanging."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvxfer.backends.ucx.transport import ucxx_unavailable
from kvxfer.contract import Backend, Delivered, Failed, TransferMode
from kvxfer.testing.conformance.transfers import _fill, _finish, _plan, _start
from kvxfer.testing.corruption import Corruptor, check_corrupted_fetches, corrupting
from kvxfer.testing.memory import HostRows
from kvxfer.testing.nixl_pairs import DeviceRows, two_ends

if (missing := ucxx_unavailable()) is not None:  # not importorskip: importing ucxx changes os.environ
    pytest.skip(missing, allow_module_level=True)

from kvxfer.backends.common.integrity import MISMATCH  # noqa: E402
from kvxfer.testing.ucx_pairs import ChildPairs, make_backend  # noqa: E402

CORRUPT = Corruptor(seed=22, p_bit=0.1, p_row=0.1)


_CorruptedPairs = corrupting(ChildPairs, make_backend, CORRUPT)


@pytest.fixture(scope="module")
def pairs() -> Iterator[ChildPairs]:
    yield from _CorruptedPairs.kept(deadline_s=10.0)


@pytest.mark.parametrize("mode", list(TransferMode))
def test_rows_corrupted_after_a_ucx_transfer_are_false_and_clean_ones_exact(pairs: ChildPairs,
                                                                          mode: TransferMode) -> None:
    check_corrupted_fetches(pairs, mode, 3, CORRUPT)


@pytest.mark.parametrize("mode", list(TransferMode))
@pytest.mark.parametrize("fetcher_checks", [True, False], ids=["fetcher-on", "fetcher-off"])
def test_ends_that_disagree_on_integrity_conclude_at_once(mode: TransferMode, fetcher_checks: bool) -> None:
    """The fetcher checks and the publisher sends no digests: the rows landed but nothing
    proves them, so they are refused by name. The fetcher does not check: it delivers as
    before, without waiting for digests nobody will send."""
    def build(m: TransferMode, memory: HostRows | DeviceRows) -> Backend:
        local = memory.regions[0].name.startswith("L")
        return make_backend(m, memory, deadline_s=10.0, integrity=fetcher_checks if local else not fetcher_checks)

    pair = two_ends(mode, build)
    try:
        plan = _plan(pair, f"mixed-{mode.value}-{fetcher_checks}", rows=8, seed=3)
        _fill(pair, plan, local_is_source=False)
        outcome, _ = _finish(pair, _start(pair, plan, "fetch"))
        if fetcher_checks:
            assert isinstance(outcome, Failed) and outcome.reason.startswith(MISMATCH)
            assert "without a digest" in outcome.reason and not any(m.any() for m in outcome.masks)
        else:
            assert isinstance(outcome, Delivered) and outcome.all_delivered
    finally:
        pair.close()
