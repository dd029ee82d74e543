"""`kvxfer pair`'s progress lines (kvxfer.progress), without starting a worker: a phase redraws
one line on a terminal and prints only its milestones elsewhere, failures are counted as
requests finish, and workers are counted in the order they announce themselves."""

from __future__ import annotations

import io
import os
import time
from pathlib import Path
from typing import Any

import pytest

from kvxfer.progress import Count, Line, RequestProgress, _next_announced, wait_announced
from kvxfer.worker.procs import ProcessFailed


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_terminal_gets_one_line_redrawn_per_phase() -> None:
    out = _Terminal()
    count = Count(Line("kvxfer pair", stream=out), "computing reference outputs", 3)
    for _ in range(3):
        count.advance()
    text = out.getvalue()
    assert text.count("\n") == 1 and text.endswith("\n")  # the phase's one line, ended when it is done
    draws = text.rstrip("\n").split("\r")[1:]
    assert [d.split(" (")[0].strip() for d in draws] == [f"kvxfer pair: computing reference outputs {i}/3"
                                                          for i in range(4)]


def test_a_shorter_redraw_blanks_what_the_longer_one_left() -> None:
    out = _Terminal()
    line = Line("p", stream=out)
    line.show("a long first state", end=False, milestone=True)
    line.show("short", end=True, milestone=True)
    assert out.getvalue() == "\rp: a long first state\rp: short" + " " * 13 + "\n"


def test_a_log_gets_the_start_each_quarter_and_the_end() -> None:
    out = io.StringIO()
    count = Count(Line("kvxfer pair", stream=out), "sending requests", 20, "done")
    for _ in range(20):
        count.advance()
    lines = out.getvalue().splitlines()
    assert [line.split(" (")[0] for line in lines] == [f"kvxfer pair: sending requests {n}/20 done"
                                                        for n in (0, 5, 10, 15, 20)]
    assert "\r" not in out.getvalue()


def test_every_step_is_a_milestone_where_each_matters() -> None:
    out = io.StringIO()
    count = Count(Line("kvxfer pair", stream=out), "starting workers", 8, "up", every_step=True)
    count.advance("prefill0 ready")
    assert out.getvalue().splitlines()[-1].startswith("kvxfer pair: starting workers 1/8 up, prefill0 ready (")


def test_off_prints_nothing() -> None:
    out = io.StringIO()
    progress = RequestProgress(2, line=Line("kvxfer pair", enabled=False, stream=out))
    progress.update(_Result([1], None, True))
    assert out.getvalue() == "" and progress.done == 1


class _Result:
    def __init__(self, tokens: list[int], error: str | None, matched: bool) -> None:
        self.tokens, self.error, self._matched = tokens, error, matched

    @property
    def matched(self) -> bool:
        return self._matched


def test_requests_count_failures_and_differences_so_far() -> None:
    out = io.StringIO()
    progress = RequestProgress(4, line=Line("kvxfer pair", stream=out))
    for result in (_Result([1, 2], None, True), _Result([], "router: 503", False), _Result([3], None, False),
                   _Result([4], None, True)):
        progress.update(result)
    assert (progress.done, progress.failed, progress.differ, progress.tokens) == (4, 1, 1, 4)
    assert out.getvalue().splitlines()[-1].startswith(
        "kvxfer pair: sending requests 4/4 done, 1 failed, 1 differ from the reference, 4 tokens (")


class _Proc:
    def __init__(self) -> None:
        read, self.write = os.pipe()
        self.stdout = os.fdopen(read, "rb", buffering=0)


class _Child:
    def __init__(self, name: str) -> None:
        self.name, self.proc = name, _Proc()
        self.log_path = Path(f"/nonexistent/{name}.log")

    def log_tail(self) -> str:
        return ""

    def announce(self) -> None:
        os.write(self.proc.write, b'{"ready": true}\n')

    def close(self) -> None:
        self.proc.stdout.close()
        os.close(self.proc.write)


class _Group:
    def __init__(self, then: dict[str, _Child] | None = None) -> None:
        self.ready: list[str] = []
        self.then = then or {}  # who announces once a child's line was read

    def wait_ready(self, children: list[Any], timeout: float) -> None:
        for child in children:
            assert child.proc.stdout.readline()
            self.ready.append(child.name)
            if child.name in self.then:
                self.then[child.name].announce()


def test_workers_are_counted_in_the_order_they_announce() -> None:
    children = [_Child("prefill0"), _Child("decode0")]
    try:
        children[1].announce()
        assert _next_announced(children, deadline=time.monotonic() + 0.2) is children[1]
        group, out = _Group(then={"decode0": children[0]}), io.StringIO()
        wait_announced(group, children, 10.0, Count(Line("kvxfer pair", stream=out), "starting workers", 2, "up",
                                                    every_step=True))
        assert group.ready == ["decode0", "prefill0"]
        assert "1/2 up, decode0 ready, waiting for prefill0" in out.getvalue()
    finally:
        for child in children:
            child.close()


def test_a_worker_that_never_announces_is_named_when_the_wait_ends() -> None:
    children = [_Child("decode0")]
    try:
        with pytest.raises(ProcessFailed, match="decode0 did not announce readiness within 0s"):
            wait_announced(_Group(), children, 0.2, Count(Line("p", enabled=False), "starting workers", 1))
    finally:
        children[0].close()
