"""`kvxfer bench` stopped from a terminal: Ctrl-C sends SIGINT to the whole foreground process
group, the bench and the child processes of its two-process cases alike (a SubprocessPeer
child for kvxfer's UCX and NIXL backends, a multiprocessing child for raw NIXL). The bench
exits 130 and writes what it measured; no process prints a traceback, and none is left."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvxfer.bench.cases import Requirement, requirement_missing


def _group(pgid: int) -> dict[int, bytes]:
    """The running (not zombie) processes of process group ``pgid``, with their command lines."""
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            fields = stat[stat.rfind(")") + 2:].split()
            if int(fields[2]) == pgid and fields[0] != "Z":
                out[int(entry.name)] = (entry / "cmdline").read_bytes()
        except (OSError, IndexError, ValueError):
            continue
    return out


def _up(pid: int) -> bool:
    """The child has loaded UCX (under NIXL or ucxx): past its imports, building its end."""
    try:
        return "libucp" in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


@pytest.mark.parametrize(("case", "needs", "child", "signum"), [
    ("ucx_2p", Requirement.UCXX, b"kvxfer.testing.subprocess_peer", signal.SIGINT),
    ("ucx_2p", Requirement.UCXX, b"kvxfer.testing.subprocess_peer", signal.SIGTERM),  # a scheduler's stop
    ("nixl_2p", Requirement.NIXL, b"kvxfer.testing.subprocess_peer", signal.SIGINT),
    ("nixl_one_desc", Requirement.NIXL, b"multiprocessing.spawn", signal.SIGINT),
])
def test_a_signal_to_the_process_group_ends_the_bench_and_its_children_quietly(
        tmp_path: Path, case: str, needs: Requirement, child: bytes, signum: int) -> None:
    if (missing := requirement_missing(needs)) is not None:
        pytest.skip(missing)
    out = tmp_path / "result.json"
    # One point, timed until the budget: the signal lands while its figure is measured.
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvxfer.cli", "bench", "--preset", "tiny", "--cases", case, "--no-latency",
         "--no-overhead", "--row-sizes", "4K", "--rows", "8", "--slots", "scattered", "--directions", "push",
         "--reps", "1000000", "--budget", "120", "--json", str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
        # A shell that ran the suite in the background hands SIGINT down as ignored: give the
        # bench the terminal's default, as tests/e2e/test_pair.py does.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.default_int_handler))
    try:
        deadline = time.monotonic() + 120
        while not [pid for pid, cmdline in _group(proc.pid).items() if child in cmdline and _up(pid)]:
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.1)
        time.sleep(1.5)  # the child up and waiting on its parent: where a KeyboardInterrupt used to land
        os.killpg(proc.pid, signum)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert "kvxfer bench: interrupted; the figures measured before it are written" in err
    assert proc.returncode == 130, err
    figures = json.loads(out.read_text())["figures"]
    assert [(f["case"], f["status"], f["reason"]) for f in figures] == [(case, "skipped", "interrupted while measuring")]
    deadline = time.monotonic() + 10
    while _group(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _group(proc.pid) == {}, "a process of the bench's process group outlived it"
