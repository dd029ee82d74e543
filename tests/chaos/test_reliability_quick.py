"""The reliability harness's short form (``python -m kvxfer.testing.reliability --quick``),
asserting what a user relies on: no row claimed delivered holds wrong bytes, every attempt
cut by a peer's death concludes and quiesces within a bound, worker kills under policy
recompute cost no request and no token, a soak fails nothing, a decoder raises nothing but
WireError, and no HTTP request gets a 500 or a dropped answer. Nothing is left running.
"""

from __future__ import annotations

import os
import threading
import time

import pytest

from kvxfer.testing.reliability import KILL_BOUND_S, QUICK, Report, run
from kvxfer.worker.procs import children_of

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]  # the fixture runs the whole quick form once


@pytest.fixture(scope="module")
def report() -> Report:
    threads = {t.ident for t in threading.enumerate()}
    started = time.monotonic()
    result = run(QUICK)
    print(f"reliability quick form: {time.monotonic() - started:.0f} s {result.seconds}")
    assert children_of(os.getpid()) == [], "the harness left a child process running"
    left = [t.name for t in threading.enumerate() if t.ident not in threads and t.is_alive()
            and t.name.startswith(("kvxfer-", "asyncio_"))]
    assert left == [], f"the harness left threads running: {left}"
    return result


def test_kills_mid_transfer(report: Report) -> None:
    k = report.kills
    assert k is not None and k.rounds == QUICK.kills
    assert k.rounds_measured == k.rounds, [r.setup_error for r in k.details if r.setup_error]
    assert k.rows_wrong == 0, [r for r in k.details if r.rows_wrong]
    assert k.rows_checked > 0, "no claimed row could be checked: the kills never landed mid-transfer"
    for r in k.details:
        assert r.detection_s is not None and r.detection_s < KILL_BOUND_S and r.quiesced, r
        assert r.shutdown_clean, r


def test_worker_kills_under_recompute(report: Report) -> None:
    c = report.chaos
    assert c is not None and c.requests == QUICK.chaos
    assert c.kills == QUICK.chaos_kills, c.kill_events
    assert c.failures == 0, c.failure_samples
    assert c.wrong == 0
    assert c.not_recovered == 0, c.kill_events
    for w in c.workers_after:
        assert w.answered and w.held == 0 and w.reserved == 0, w


def test_soak(report: Report) -> None:
    s = report.soak
    assert s is not None and s.requests == QUICK.soak
    assert s.failures == 0, s.failure_samples
    assert s.wrong == 0
    for w in s.workers_after:
        assert w.answered and w.held == 0 and w.reserved == 0 and w.open_leases == 0, w


def test_fuzzed_inputs(report: Report) -> None:
    w, h = report.wire_fuzz, report.http_fuzz
    assert w is not None and h is not None
    for tally in (w.hints, w.completions):
        assert tally.other == 0, tally.other_samples
        assert tally.wire_error > 0 and tally.decoded_ok + tally.wire_error == tally.cases
    assert h.server_errors == 0, h.server_error_kinds
    assert h.dropped == 0 and h.hangs == 0 and h.streams_cut == 0, h.finding_samples
    assert h.workers_alive
    for state in h.workers_after:
        assert state.answered and state.held == 0 and state.reserved == 0, state
