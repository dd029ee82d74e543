"""`kvxfer bench`'s time left is measured, not guessed: each figure still to run is costed at
the pace its own case's figures ran at (first figures apart, since they pay for the case's
start), a case not begun yet at what its points cost the slowest case that ran them, and
the progress line shows it only once there is something to go by."""

from __future__ import annotations

import dataclasses
import io

import pytest

from kvxfer.bench import runner
from kvxfer.bench.config import ThroughputSweep, preset
from kvxfer.bench.pace import Pace, Took, Work, clock, duration, seconds_left
from kvxfer.bench.progress import Progress


def test_no_estimate_from_a_single_first_figure() -> None:
    assert seconds_left([], [Work("a", True)]) is None
    # One figure that paid for its case's start-up says nothing of the figures after it.
    assert seconds_left([Took("a", 9.0, first=True)], [Work("a", False)] * 5) is None


def test_each_case_goes_at_its_own_measured_pace() -> None:
    took = [Took("fast", 2.0, True), Took("fast", 0.1, False), Took("fast", 0.3, False),
            Took("slow", 6.0, True), Took("slow", 4.0, False)]
    left = [Work("fast", False)] * 3 + [Work("slow", False)] * 2
    assert seconds_left(took, left) == pytest.approx(3 * 0.2 + 2 * 4.0)


def test_a_case_with_only_its_first_figure_goes_at_that_figure() -> None:
    took = [Took("a", 1.0, True), Took("a", 0.5, False), Took("b", 8.0, True)]
    assert seconds_left(took, [Work("b", False)] * 2) == pytest.approx(16.0)  # an upper bound: it had the start


def test_a_case_not_begun_costs_its_points_as_the_slowest_case_ran_them_and_the_longest_start() -> None:
    took = [Took("a", 4.0, True, "p1"), Took("a", 1.0, False, "p1"), Took("a", 3.0, False, "p2"),
            Took("b", 2.0, True, "p1"), Took("b", 5.0, False, "p1")]
    start = 4.0 - (1.0 + 3.0) / 2  # a's first over a's later figures; b's first was quicker than its others
    left = [Work("c", True, "p2"), Work("c", False, "p1"), Work("c", False, "p3")]
    # p2 as a ran it, plus the start; p1 as b (the slower there) ran it; p3, which none ran, at b's pace
    assert seconds_left(took, left) == pytest.approx((3.0 + start) + 5.0 + 5.0)


def test_a_big_point_costs_more_than_a_small_one_in_a_case_not_begun() -> None:
    took = [Took("a", 1.0, True, "4 KiB x 16384"), Took("a", 9.0, False, "4 KiB x 16384"),
            Took("a", 0.1, False, "64 KiB x 32")]
    big = seconds_left(took, [Work("b", False, "4 KiB x 16384")])
    small = seconds_left(took, [Work("b", False, "64 KiB x 32")])
    assert big == pytest.approx(9.0) and small == pytest.approx(0.1)


def test_two_first_figures_are_something_to_go_by() -> None:
    took = [Took("a", 2.0, True, "p1"), Took("b", 4.0, True, "p2")]
    # c's first at what p2 cost (no start to tell apart yet); a's next at a's first figure
    assert seconds_left(took, [Work("c", True, "p2"), Work("a", False, "p1")]) == pytest.approx(4.0 + 2.0)


def test_the_estimate_follows_the_timings_it_is_fed() -> None:
    left = [Work("a", False)] * 10
    quick = seconds_left([Took("a", 1.0, True), Took("a", 0.5, False)], left)
    slow = seconds_left([Took("a", 1.0, True), Took("a", 5.0, False)], left)
    assert quick == pytest.approx(5.0) and slow == pytest.approx(50.0)


def test_pace_takes_each_figure_off_what_is_left_in_plan_order() -> None:
    pace = Pace([Work("a", True, "p1"), Work("a", False, "p2"), Work("b", True, "p2"), Work("a", False, "p1")])
    assert pace.seconds_left() is None and pace.not_begun() == 2
    pace.ran("a", 3.0)
    pace.ran("a", 1.0)
    assert pace.took == [Took("a", 3.0, True, "p1"), Took("a", 1.0, False, "p2")]
    assert pace.left == [Work("b", True, "p2"), Work("a", False, "p1")] and pace.not_begun() == 1
    # b's first: p2 as a ran it, plus a's start (3 - 1); a's last at a's pace
    assert pace.seconds_left() == pytest.approx((1.0 + 2.0) + 1.0)
    pace.expect([Work("a", False, "p1")] * 4)  # the second pass, as it turned out
    assert pace.seconds_left() == pytest.approx(4.0)


@pytest.mark.parametrize(("seconds", "text"), [(0.2, "< 1 s"), (41.4, "41 s"), (150, "2 min"), (7200, "2.0 h")])
def test_durations_read_as_an_estimate_deserves(seconds: float, text: str) -> None:
    assert duration(seconds) == text


@pytest.mark.parametrize(("seconds", "text"), [(41.4, "41 s"), (192, "3 min 12 s"), (3900, "1 h 05 min")])
def test_elapsed_time_reads_to_the_second(seconds: float, text: str) -> None:
    assert clock(seconds) == text


def test_the_line_shows_time_left_only_once_measured() -> None:
    progress = Progress(10, stream=io.StringIO())
    progress.pace = Pace([Work("a", True)] + [Work("a", False)] * 9)
    assert "left" not in progress.line("x")
    progress.pace.ran("a", 5.0)
    progress.advance()
    assert "left" not in progress.line("x")
    progress.pace.ran("a", 30.0)
    progress.advance()
    assert ", about 4 min left at this pace  x" in progress.line("x")  # 8 figures at 30 s


def test_a_run_plans_its_work_with_first_figures_and_the_second_pass() -> None:
    cfg = dataclasses.replace(preset("tiny"), cases=("local_copy", "loopback"), latency=None, overhead=None,
                              throughput=(ThroughputSweep(row_bytes=(4096,), rows=(8, 16), slots=("scattered",)),))
    items = runner.plan(cfg)
    work = runner._work(cfg, items)
    small, big = "throughput push host scattered 4 KiB x 8", "throughput push host scattered 4 KiB x 16"
    assert work == [Work("local_copy", True, small), Work("local_copy", False, big), Work("loopback", True, small),
                    Work("loopback", False, big), Work("local_copy", False, small), Work("local_copy", False, big)]


def test_a_run_shows_measured_time_left_on_its_progress_line() -> None:
    cfg = dataclasses.replace(preset("tiny"), cases=("local_copy", "loopback"), latency=None, overhead=None)
    stream = io.StringIO()
    result = runner.run(cfg, Progress(1, stream=stream))
    lines = stream.getvalue().splitlines()
    assert all(f.ok for f in result.figures)
    assert "left" not in lines[0] and "left" not in lines[1]  # nothing measured; then one first figure
    assert "left at this pace (1 case not begun)" in lines[2]
    assert any("second pass" in line and "left at this pace" in line for line in lines)
    assert lines[-1].endswith("done") and "left" not in lines[-1]
