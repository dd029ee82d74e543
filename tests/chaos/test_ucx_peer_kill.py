"""SIGKILL of the ucx peer mid-transfer (UcxBackend, the peer a child process): this end's
attempt fails within bounded time, quiesces, and its masks claim only rows that are in place
byte for byte (and, with integrity on, whose digests came before the peer died); shutdown() strands nothing and nothing is left running. Push and pull, this
end publishing (its sends fail once the fetcher is gone) and fetching (its heartbeats and
receives fail once the publisher is gone), as tests/chaos/test_nixl_peer_kill.py does for NIXL.

Each scenario runs in a process of its own (this file, through runpy): it hosts this end and
starts the peer as a SubprocessPeer (``kvxfer.testing.ucx_pairs:child_backend``), and reports
each step as a JSON line before it takes the next. Not in pytest's process: closing a failed
endpoint once crashed ucxx 0.52 (SIGSEGV, fixed in Transport.forget), and a crash must fail
the test, not end pytest. Both ends send a message per run (``pack_bytes=0``), so that a kill
lands between messages.

The kill lands mid-way whatever the load: this end's progress thread is held
(``kvxfer.testing.progress_hold``) once a first row was sent or received, the peer is killed, then the
thread goes on. A peer that publishes is paced (``window=1`` and ``poll_s``: one run, here one
row, about every ``PACE`` seconds), so that it is still sending when it dies.
"""

from __future__ import annotations

import functools
import json
import os
import resource
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvxfer.backends.ucx.transport import ucxx_unavailable
from kvxfer.contract import CacheKind, LayerGroupRows, Outcome, TokenRange, TransferMode, View
from kvxfer.testing.memory import HostRows
from kvxfer.testing.nixl_pairs import LOCAL_BUFFERS, host_rows
from kvxfer.testing.progress_hold import hold_progress
from kvxfer.testing.subprocess_peer import SubprocessPeer, live_children
from kvxfer.testing.waiting import settle
from kvxfer.wire import decode_hint, encode_hint

if (missing := ucxx_unavailable()) is not None:  # not importorskip: importing ucxx changes os.environ
    pytest.skip(missing, allow_module_level=True)

from kvxfer.backends.ucx import UcxBackend  # noqa: E402

PACE = 0.05            # a paced publisher's pause between steps (one run each): about 4 s for a transfer
SLOW = 5.0             # the fetcher's pause between steps where it must not acknowledge before the kill
FIRST_STEP = 0.5       # for that fetcher's first step, right after its submission, to be over
PROGRESS = 15.0        # seconds for a first row to be sent or to land (a loaded 2-core VM)
BOUND = 5.0            # seconds from the kill to a concluded, quiesced attempt
HEARTBEAT = 0.1
DEADLINE = 10.0        # this end's deadline_s: what ends a wait that no failed send ends
PEER_DEADLINE = 20.0
RUN_TIMEOUT = 90.0     # one scenario process, start to end
LEFT_S = 20.0          # for the scenario's peer processes to be gone once it ended
MARK = "@@kvxfer-chaos "
CHILD = "import runpy, sys; runpy.run_path(sys.argv[1])['_scenario'](*sys.argv[2:])"

@pytest.fixture(autouse=True)
def no_child_left_behind() -> Iterator[None]:
    yield
    assert live_children() == [], "a test left a peer child process running"


# --- the scenario process ---------------------------------------------------------------

def _report(step: str, **fields: Any) -> None:
    print(MARK + json.dumps({"step": step, **fields}), flush=True)


def _packed(outcome: Outcome | None) -> dict[str, Any]:
    if outcome is None:
        return {"kind": None, "reason": "", "masks": []}
    return {"kind": type(outcome).__name__, "reason": getattr(outcome, "reason", ""),
            "masks": [np.asarray(m, dtype=np.bool_).tolist() for m in outcome.masks]}


def _peer(mode: TransferMode, **options: Any) -> SubprocessPeer:
    peer = SubprocessPeer("kvxfer.testing.ucx_pairs:child_backend",
                          {"mode": mode.value, "deadline_s": PEER_DEADLINE, "pack_bytes": 0, **options})
    _report("peer", pid=peer.pid, agent=peer.agent)
    return peer


def _local(mode: TransferMode, **options: Any) -> tuple[UcxBackend, HostRows]:
    memory = host_rows(LOCAL_BUFFERS)
    backend = UcxBackend(mode=mode, deadline_s=DEADLINE, heartbeat_s=HEARTBEAT, pack_bytes=0, **options)
    backend.register(memory.regions)
    return backend, memory


def _views(memory: HostRows, peer: SubprocessPeer, request: str) -> tuple[View, View]:
    """Every row the two geometries share, scattered at both ends (so nearly every run is one row)."""
    rng = np.random.default_rng(len(request))
    lg, pg = [], []
    for name, lr, pr in zip(("g0", "g1"), memory.regions, peer.regions):
        n = min(lr.slots, pr.slots)
        ordinals = np.arange(n, dtype=np.int64)
        lg.append(LayerGroupRows(name, CacheKind.PAGED, lr, rng.permutation(lr.slots)[:n].astype(np.int64), ordinals))
        pg.append(LayerGroupRows(name, CacheKind.PAGED, pr, rng.permutation(pr.slots)[:n].astype(np.int64), ordinals))
    rows = sum(len(g) for g in lg)
    tokens = TokenRange(0, rows * 16)
    return View(request, tokens, tuple(lg), b"chaos"), View(request, tokens, tuple(pg), b"chaos")


def _payload(view: View) -> dict[str, bytes]:
    rng = np.random.default_rng(7)
    return {g.layer_group: rng.integers(0, 256, len(g) * g.region.slot_bytes, dtype=np.uint8).tobytes()
            for g in view.groups}


def _fill(memory: HostRows, peer: SubprocessPeer, local_view: View, peer_view: View, payload: dict[str, bytes],
          local_is_source: bool) -> None:
    """Random bytes at the source, zeros where they go."""
    for lg, pg in zip(local_view.groups, peer_view.groups):
        data, zeros = payload[lg.layer_group], bytes(len(payload[lg.layer_group]))
        memory.write(lg.region.name, lg.slots, data if local_is_source else zeros)
        peer.write(pg.region.name, pg.slots, zeros if local_is_source else data)


def _start(local: UcxBackend, peer: SubprocessPeer, local_view: View, peer_view: View, local_op: str) -> Any:
    local_hint = encode_hint(local.describe(local_view))
    peer_hint = decode_hint(peer.describe_bytes(peer_view))
    peer.start_bytes("publish" if local_op == "fetch" else "fetch", peer_view, local_hint)
    return (local.fetch if local_op == "fetch" else local.publish)(local_view, peer_hint)


def _landed(memory: HostRows, view: View, payload: dict[str, bytes]) -> list[list[bool]]:
    """Per group, per row: the row holds exactly the source's bytes."""
    out = []
    for g in view.groups:
        size = g.region.slot_bytes
        data = payload[g.layer_group]
        out.append([memory.read(g.region.name, g.slots[i:i + 1]) == data[i * size:(i + 1) * size]
                    for i in range(len(g))])
    return out


def _moved(local: UcxBackend) -> int:
    """Rows whose send (this end publishes) or receive (it fetches) completed, so far."""
    return int(sum(int(j.sent.sum()) for j in list(local._sending.values()))
               + sum(int(w.received.sum()) for w in list(local._receiving.values())))


def _proven(local: UcxBackend) -> int:
    """Rows received so far whose digests came too (integrity on: only those can be claimed)."""
    return int(sum(int(w.received.sum()) if w.sums is None else int((w.received * w.sums.known).sum())
                   for w in list(local._receiving.values())))


def _finish(local: UcxBackend) -> None:
    _report("children", live=live_children())
    _report("shutdown", left=len(local.shutdown()))


def _scenario_kill(mode_value: str, local_op: str) -> None:
    mode = TransferMode(mode_value)
    # Publishing, one send at a time: held once the first completed, most are posted after the kill.
    local, memory = _local(mode, window=1) if local_op == "publish" else _local(mode)
    held, gate = hold_progress(local, ready=lambda: _moved(local) > 0)
    peer = _peer(mode) if local_op == "publish" else _peer(mode, window=1, poll_s=PACE)
    try:
        local_view, peer_view = _views(memory, peer, f"kill-{local_op}-{mode.value}")
        payload = _payload(local_view)
        _fill(memory, peer, local_view, peer_view, payload, local_is_source=local_op == "publish")
        attempt = _start(local, peer, local_view, peer_view, local_op)
        if not held.wait(PROGRESS):
            _report("error", what=f"no row was sent or received within {PROGRESS:g}s")
            return  # the finally still ends the backend before its memory goes
        moved, proven = _moved(local), _proven(local)
        peer.kill()
        killed = time.monotonic()
        gate.set()
        done = attempt.wait(BOUND)
        seconds = time.monotonic() - killed
        _report("outcome", done=done, seconds=seconds, quiesced=attempt.quiesced(), moved=moved, proven=proven,
                rows=sum(len(g) for g in local_view.groups), agent=peer.agent, outcome=_packed(attempt.poll()),
                landed=_landed(memory, local_view, payload) if local_op == "fetch" else None)
    finally:
        gate.set()
        peer.kill()
        _finish(local)


def _scenario_unacknowledged(mode_value: str) -> None:
    """This end publishes; every send completes; the fetcher, which has not acknowledged yet
    (it steps only every SLOW seconds by then), is killed. A first transfer at full pace
    connects the two ends both ways, so that the second needs no step of the slow fetcher
    to get its request (pull) and its rows (both modes) across."""
    mode = TransferMode(mode_value)
    local, memory = _local(mode)
    peer = _peer(mode)
    try:
        local_view, peer_view = _views(memory, peer, f"warm-{mode.value}")
        attempt = _start(local, peer, local_view, peer_view, "publish")
        _report("warm", done=attempt.wait(PROGRESS), outcome=_packed(attempt.poll()))
        peer.set_option("poll_s", SLOW)
        local_view, peer_view = _views(memory, peer, f"unacked-{mode.value}")
        _fill(memory, peer, local_view, peer_view, _payload(local_view), local_is_source=True)
        local_hint = encode_hint(local.describe(local_view))
        peer_hint = decode_hint(peer.describe_bytes(peer_view))
        peer.start_bytes("fetch", peer_view, local_hint)
        time.sleep(FIRST_STEP)  # the fetcher's first step (at submission) is over, its next SLOW away
        attempt = local.publish(local_view, peer_hint)

        def all_sent() -> bool:
            jobs = list(local._sending.values())
            return bool(jobs) and all(int(j.sent.sum()) == j.plan.rows and not j.inflight for j in jobs)

        sent = settle(all_sent, PROGRESS)
        _report("sent", all_sent=sent, concluded=attempt.poll() is not None)
        peer.kill()
        killed = time.monotonic()
        done = attempt.wait(BOUND)
        _report("bound", done=done, seconds=time.monotonic() - killed, outcome=_packed(attempt.poll()))
        attempt.wait(DEADLINE + BOUND)
        _report("final", done=attempt.poll() is not None and attempt.quiesced(),
                seconds=time.monotonic() - killed, outcome=_packed(attempt.poll()))
    finally:
        peer.kill()
    _finish(local)


def _scenario_restart() -> None:
    mode = TransferMode.PUSH
    local, memory = _local(mode)
    name = f"chaos-restart-{os.getpid()}-{time.monotonic_ns()}"
    peer = _peer(mode, window=1, poll_s=PACE, name=name)  # still sending when killed
    try:
        local_view, peer_view = _views(memory, peer, "restart-1")
        stale_local, stale_peer = _views(memory, peer, "restart-stale")
        stale_hint = decode_hint(peer.describe_bytes(stale_peer))
        _fill(memory, peer, local_view, peer_view, _payload(local_view), local_is_source=False)
        attempt = _start(local, peer, local_view, peer_view, "fetch")
        landed = settle(lambda: _moved(local) > 0, PROGRESS)
        peer.kill()
        _report("first", landed=landed, done=attempt.wait(BOUND), outcome=_packed(attempt.poll()))
        local.describe(stale_local)  # a hint of the dead process
        stale = local.fetch(stale_local, stale_hint)
        _report("stale", done=stale.wait(BOUND), outcome=_packed(stale.poll()))
        peer = _peer(mode, name=name)  # same agent name, new process, new worker address
        _report("restarted", same_name=peer.agent == name)
        local_view, peer_view = _views(memory, peer, "restart-2")
        payload = _payload(local_view)
        _fill(memory, peer, local_view, peer_view, payload, local_is_source=False)
        attempt = _start(local, peer, local_view, peer_view, "fetch")
        _report("second", done=attempt.wait(BOUND), outcome=_packed(attempt.poll()),
                landed=_landed(memory, local_view, payload))
    finally:
        peer.close()
    _finish(local)


SCENARIOS: dict[str, Callable[..., None]] = {
    "kill": _scenario_kill, "unacknowledged": _scenario_unacknowledged, "restart": _scenario_restart,
}


def _scenario(name: str, *args: str) -> None:
    """The scenario process's entry (CHILD): no core files, then the scenario."""
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    SCENARIOS[name](*args)


# --- pytest's side ----------------------------------------------------------------------

@dataclass
class Run:
    """What a scenario process reported, step by step, and how it ended."""

    steps: dict[str, dict[str, Any]] = field(default_factory=dict)
    rc: int | None = None  # None: it ran past RUN_TIMEOUT and was killed
    stderr: str = ""

    def step(self, name: str) -> dict[str, Any]:
        """A step the scenario must have reached: a real failure (not an xfail) when it did not."""
        if name not in self.steps:
            pytest.fail(f"the scenario process reported no {name!r} step ({self.ended}); steps: "
                        f"{list(self.steps)}\n{self.crash}")
        return self.steps[name]

    @property
    def ended(self) -> str:
        if self.rc is None:
            return f"killed after {RUN_TIMEOUT:g}s"
        if self.rc < 0:
            return f"ended by {signal.Signals(-self.rc).name}"
        return f"exit status {self.rc}"

    @property
    def crash(self) -> str:
        """The end of its stderr (faulthandler's traceback of a crash), UCX's connect retries left out."""
        lines = [line for line in self.stderr.splitlines() if "UCX  ERROR" not in line]
        return "\n".join(lines[-30:])


def _text(data: str | bytes | None) -> str:
    return data.decode(errors="replace") if isinstance(data, bytes) else (data or "")


def _running(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2:].split()[0] != "Z"


def _run(*args: str) -> Run:
    """Run a scenario in a fresh process; every peer process it started must be gone after it."""
    command = [sys.executable, "-X", "faulthandler", "-c", CHILD, __file__, *args]
    run = Run()
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=RUN_TIMEOUT, stdin=subprocess.DEVNULL)
        out, run.stderr, run.rc = done.stdout, done.stderr, done.returncode
    except subprocess.TimeoutExpired as exc:
        out, run.stderr = _text(exc.stdout), _text(exc.stderr)
    peers = []
    for line in out.splitlines():
        if line.startswith(MARK):
            item = json.loads(line[len(MARK):])
            if item["step"] == "peer":
                peers.append(item["pid"])
            else:
                run.steps[item["step"]] = item
    if not settle(lambda: not any(_running(p) for p in peers), LEFT_S):
        pytest.fail(f"peer processes of the scenario left running: {[p for p in peers if _running(p)]}")
    return run


@functools.cache
def _kill_run(mode_value: str, local_op: str) -> Run:
    """One scenario process per case, shared by the tests that read it."""
    return _run("kill", mode_value, local_op)


MODES = pytest.mark.parametrize("mode", list(TransferMode), ids=lambda m: m.value)
OPS = pytest.mark.parametrize("local_op", ["publish", "fetch"])


def _names_dead_peer(reason: str, agent: str) -> bool:
    return f"ucx peer {agent!r}" in reason and any(
        word in reason for word in ("disconnected", "unreachable", "cannot reach", "reset"))


@MODES
@OPS
def test_kill_peer_mid_transfer(mode: TransferMode, local_op: str) -> None:
    """The peer dies with rows still to move: our attempt fails, naming it, within BOUND of the
    kill, quiesced; it claims no row that is not in place byte for byte."""
    run = _kill_run(mode.value, local_op)
    if "error" in run.steps:
        pytest.fail(run.steps["error"]["what"])
    step = run.step("outcome")
    outcome = step["outcome"]
    assert step["done"], f"no outcome and quiescence within {BOUND:g}s of the kill: {outcome}"
    assert step["seconds"] < BOUND
    assert step["quiesced"]
    assert outcome["kind"] == "Failed", outcome
    assert _names_dead_peer(outcome["reason"], step["agent"]), outcome["reason"]
    assert 0 < step["moved"] < step["rows"], f"kill did not land mid-transfer ({step['moved']} of {step['rows']} rows)"
    masks = outcome["masks"]
    assert sum(len(m) for m in masks) == step["rows"]
    if local_op == "publish":  # the fetcher died before acknowledging: no row is proven, none is claimed
        assert not any(any(m) for m in masks), "rows claimed that no acknowledgement proved"
    else:
        for mask, landed in zip(masks, step["landed"]):
            assert all(ok for marked, ok in zip(mask, landed) if marked), "a row marked delivered differs from its source"
        # Rows are claimed as far as the publisher's digests reached us (integrity is on): every
        # row received with its digest before the kill, and none received without one.
        claimed = sum(sum(m) for m in masks)
        assert step["proven"] <= claimed < step["rows"], (
            f"{claimed} rows claimed, {step['proven']} received with their digests before the kill "
            f"({step['moved']} received), of {step['rows']}")
        if claimed < sum(sum(rows) for rows in step["landed"]):
            assert "digests never came" in outcome["reason"], outcome["reason"]
    assert run.step("children")["live"] == [], "the killed peer is still running"


@MODES
@OPS
def test_shutdown_after_the_kill_strands_nothing(mode: TransferMode, local_op: str) -> None:
    run = _kill_run(mode.value, local_op)
    run.step("children")  # the scenario got as far as shutdown()
    assert "shutdown" in run.steps and run.rc == 0, f"shutdown() did not return: the process {run.ended}\n{run.crash}"
    assert run.steps["shutdown"]["left"] == 0, "an attempt was left unquiesced"


@MODES
def test_kill_fetcher_before_it_acknowledges(mode: TransferMode) -> None:
    """Every send completed and the fetcher, not acknowledged yet, dies: the heartbeat ends the
    wait within BOUND, and nothing is claimed."""
    run = _run("unacknowledged", mode.value)
    warm, sent = run.step("warm"), run.step("sent")
    if not (warm["done"] and warm["outcome"]["kind"] == "Delivered"):
        pytest.fail(f"the first transfer, at full pace, did not deliver: {warm['outcome']['kind']} "
                    f"{warm['outcome']['reason']!r}")
    if not sent["all_sent"] or sent["concluded"]:
        pytest.fail(f"the kill did not land after every send and before the acknowledgement: {sent}")
    bound, final = run.step("bound"), run.step("final")
    assert bound["done"] and bound["outcome"]["kind"] == "Failed", (
        f"no outcome within {BOUND:g}s of the kill; it came {final['seconds']:.1f}s after it: "
        f"{final['outcome']['kind']} {final['outcome']['reason']!r}")
    assert "disconnected" in bound["outcome"]["reason"], bound["outcome"]["reason"]
    assert not any(any(m) for m in bound["outcome"]["masks"])


def test_restarted_peer_with_the_same_name_is_reached_again() -> None:
    run = _run("restart")
    first, stale = run.step("first"), run.step("stale")
    if not (first["landed"] and first["done"] and first["outcome"]["kind"] == "Failed"):
        pytest.fail(f"the first transfer did not fail mid-way within {BOUND:g}s of the kill: {first}")
    if not (stale["done"] and stale["outcome"]["kind"] == "Failed"):
        pytest.fail(f"a hint of the dead process did not fail at once: {stale}")
    if not run.step("restarted")["same_name"]:
        pytest.fail("the restarted peer did not take the same agent name")
    assert "second" in run.steps, (
        f"the transfer with the restarted peer never concluded: the process {run.ended}\n{run.crash}")
    second = run.steps["second"]
    assert second["done"] and second["outcome"]["kind"] == "Delivered", second["outcome"]
    assert all(all(m) for m in second["outcome"]["masks"]) and all(all(rows) for rows in second["landed"])
    assert "shutdown" in run.steps and run.steps["shutdown"]["left"] == 0 and run.rc == 0, run.ended
