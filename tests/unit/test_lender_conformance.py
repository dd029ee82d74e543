"""The conformance kit's lender checks, run against every lender: in place, staging, and an
engine's own KV (ExternalLender)."""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from kvxfer.lender import ExternalLender, external
from kvxfer.testing.conformance.lender_checks import (
    LENDER_CHECKS,
    RigFactory,
    check_bool_masks_only,
    check_freed_blocks_wait_for_quiescence,
    check_freed_under_an_open_lease,
    check_one_lender_per_memory,
    check_shared_prefix_never_lent_for_writing,
    check_shutdown_reports_what_stays_retained,
)
from kvxfer.testing.conformance.lender_rigs import RIG_KINDS, make_rig


@pytest.mark.parametrize("kind", RIG_KINDS)
@pytest.mark.parametrize("check", LENDER_CHECKS, ids=lambda c: c.__name__)
def test_lender_conformance(check: Callable[[RigFactory], None], kind: str) -> None:
    check(lambda: make_rig(kind))


# --- the checks can fail: each catches a lender that breaks its rule -------------------------
def _loose_masks(lease: Any, view: Any, masks: Any) -> list[np.ndarray]:
    return [np.asarray(m).astype(np.bool_) for m in masks]  # [1, 1, 0] accepted, as before issue 36


def _no_claim(owner: object, regions: Any, what: str, *, local: bool = True) -> Any:
    return SimpleNamespace(release=lambda: None)


def _all_free(self: Any, blocks: Any, defer: bool = False) -> np.ndarray:
    return np.asarray(blocks, dtype=np.int64)  # pinning only cooperative: every block reusable at once


@pytest.mark.parametrize(("check", "target", "name", "broken", "found"), [
    (check_bool_masks_only, external, "arrival_masks", _loose_masks, "expected InvalidSubmission"),
    (check_freed_blocks_wait_for_quiescence, ExternalLender, "free", _all_free, "may still write were handed out"),
    (check_freed_under_an_open_lease, ExternalLender, "free", _all_free, "of an open lease were handed out"),
    (check_shared_prefix_never_lent_for_writing, ExternalLender, "_shared_ids",
     lambda self, request, table, shared: np.zeros(0, dtype=np.int64), "shared first block was lent for writing"),
    (check_one_lender_per_memory, external, "claim", _no_claim, "expected AlreadyLent"),
    (check_shutdown_reports_what_stays_retained, ExternalLender, "_held",
     lambda self, write_only=False: np.zeros(0, dtype=np.int64), "retained nothing"),
], ids=["int-masks", "free-while-busy", "free-under-open-lease", "shared-written", "two-lenders", "shutdown-retains-nothing"])
def test_the_checks_catch_a_lender_that_breaks_the_rule(check: Callable[[RigFactory], None], target: Any, name: str,
                                                        broken: Any, found: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(target, name, broken)
    with pytest.raises(AssertionError, match=found):
        check(lambda: make_rig("external"))
