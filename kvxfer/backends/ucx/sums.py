"""Row integrity on the ucx backend (``kvxfer.backends.common.integrity``).

A fetcher that checks says so in its hint (``EXTRA_SUMS``). Its publisher then follows each
batch of sends it posts with an ``S`` control message: the digests of every row of those runs,
in the plan's order, taken while the sends move (the rows are pinned; both only read them).
The fetcher keeps them by run; it concludes only once every run it waits for has its digests,
and checks the rows it received against them where they landed. Rows of runs whose digests
never came (the publisher died first) are not proven, so they are False: a dead publisher's
rows count toward a resume bound only as far as its digests reached us.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from kvxfer.backends.common.integrity import U64, RowCheck, check_landed, region_digests, with_refused
from kvxfer.backends.common.transfers import put_bounded
from kvxfer.backends.ucx.control import RunSums, encode_sums
from kvxfer.backends.ucx.runs import RunPlan
from kvxfer.contract import BoolArray, Hint, IndexArray, Outcome, View

EXTRA_SUMS = "ucx.sums"  # in a hint: rows landing here are checked, send their digests


def _flat(plan: RunPlan, first: int, end: int) -> tuple[IndexArray, IndexArray]:
    """For each row of runs ``first .. end-1`` in the plan's order: its run, and its place in it."""
    lengths = plan.lengths[first:end]
    runs = np.repeat(np.arange(first, end, dtype=np.int64), lengths)
    within = np.arange(plan.starts[first], plan.starts[end], dtype=np.int64) - np.repeat(plan.starts[first:end], lengths)
    return runs, within


def run_digests(view: View, plan: RunPlan, first: int, end: int) -> U64:
    """The publisher's digest of every row of runs ``first .. end-1``, in the plan's order."""
    runs, within = _flat(plan, first, end)
    slots = plan.local_slot[runs] + within
    groups = plan.local_group[runs]
    out = np.zeros(runs.size, dtype=np.uint64)
    for g in np.unique(groups).tolist():
        chosen = groups == g
        out[chosen] = region_digests(view.groups[g].region, slots[chosen])
    return out


class LandedSums:
    """The fetcher's record of the publisher's digests: per row in the plan's order, and which
    runs have theirs. Only the progress thread touches it."""

    def __init__(self, plan: RunPlan) -> None:
        self.values = np.zeros(plan.rows, dtype=np.uint64)
        self.known = np.zeros(plan.runs, dtype=np.bool_)
        self.none = False  # the publisher sends no digests

    def keep(self, plan: RunPlan, sums: RunSums, agent: str, own_id: str) -> str | None:
        """Keep the digests of ``sums`` when ``agent`` sent them for transfer ``own_id``; why
        the transfer fails when they do not fit the plan (then none is kept)."""
        if sums.sender != agent or sums.transfer_id != own_id:
            return None
        if not self.add(plan, sums):
            return f"peer sent digests of runs {sums.first}..{sums.end} that do not fit them"
        return None

    def add(self, plan: RunPlan, sums: RunSums) -> bool:
        """Keep the digests of ``sums``; False when they do not fit the plan (then none is kept)."""
        if sums.end > plan.runs:
            return False
        if sums.digests is None:
            self.none = True
            return True
        a, b = int(plan.starts[sums.first]), int(plan.starts[sums.end])
        if sums.digests.size != b - a:
            return False
        self.values[a:b] = sums.digests
        self.known[sums.first:sums.end] = True
        return True

    def complete(self, expected: IndexArray) -> bool:
        """Every run with rows still to come has its digests (or none will come)."""
        return self.none or bool(np.all(self.known | (expected == 0)))

    def check(self, check: RowCheck, view: View, plan: RunPlan, outcome: Outcome) -> Outcome:
        """``outcome`` with its landed rows checked: rows that fail, or whose digests never
        came, are False, and such an outcome is never Delivered."""
        masks = [np.array(m, dtype=np.bool_) for m in outcome.masks]
        before = sum(int(m.sum()) for m in masks)
        if self.none:
            bad = check_landed(view, masks, None, check.corrupt)
        else:
            expected, unproven = self._by_group(view, plan)
            lost = sum(int((m & ~k).sum()) for m, k in zip(masks, unproven))
            for m, k in zip(masks, unproven):
                m &= k
            bad = check_landed(view, masks, expected, check.corrupt)
            if lost:
                missing = f"{lost} rows landed whose digests never came (the publisher stopped first)"
                bad = missing if bad is None else f"{bad}; {missing}"
        check.rows_failed += before - sum(int(m.sum()) for m in masks)
        return outcome if bad is None else with_refused(outcome, masks, bad)

    def _by_group(self, view: View, plan: RunPlan) -> tuple[list[U64], list[BoolArray]]:
        """The digests and which rows have one, as arrays over the view's groups."""
        expected = [np.zeros(len(g), dtype=np.uint64) for g in view.groups]
        proven = [np.zeros(len(g), dtype=np.bool_) for g in view.groups]
        runs, _ = _flat(plan, 0, plan.runs)
        groups = plan.local_group[runs]
        for g in np.unique(groups).tolist():
            chosen = groups == g
            rows = plan.local_rows[chosen]
            expected[g][rows] = self.values[chosen]
            proven[g][rows] = self.known[runs[chosen]]
        return expected, proven


class SumsDesk:
    """A backend's side of it: what its hints ask, what its fetches expect, the digests that
    came before their fetch() (a push publisher may send them as soon as it holds our hint,
    as it may its rows; at most ``kept`` transfers), and the ``S`` messages it sends."""

    def __init__(self, check: RowCheck, kept: int) -> None:
        self.check = check
        self._kept = kept
        self._early: OrderedDict[int, list[RunSums]] = OrderedDict()  # by data tag

    def extras(self, view: View) -> tuple[tuple[str, bytes], ...]:
        """A hint's ask: rows landing in ``view`` are checked."""
        return ((EXTRA_SUMS, b"\x01"),) if self.check.applies(view) else ()

    def expected(self, view: View, plan: RunPlan) -> LandedSums | None:
        """A fetch's record of the digests to come (None: this end checks nothing)."""
        return LandedSums(plan) if self.check.applies(view) else None

    @staticmethod
    def wanted(hint: Hint) -> bool:
        """The fetcher asks for digests."""
        return hint.extra(EXTRA_SUMS) is not None

    def hold(self, tag: int, sums: RunSums) -> None:
        held = self._early.get(tag)
        if held is None:
            put_bounded(self._early, tag, [sums], self._kept)
        else:
            held.append(sums)

    def take(self, tag: int) -> list[RunSums]:
        return self._early.pop(tag, [])

    def message(self, view: View, plan: RunPlan, transfer_id: str, sender: str, key: bytes, first: int,
                end: int) -> tuple[bytes, int]:
        """The ``S`` message for runs ``first .. end-1`` (with integrity off here, one saying
        that none will come, for every run), and the run the next one starts at."""
        digests = None
        if self.check.applies(view):
            digests = run_digests(view, plan, first, end)
        else:
            first, end = 0, plan.runs
        return encode_sums(RunSums(transfer_id, sender, first, end, digests), key), end
