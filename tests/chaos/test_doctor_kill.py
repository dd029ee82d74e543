"""A doctor killed mid-probe (a timeout, Ctrl-C twice, the OOM killer) leaves no probe behind:
the ucx probes spin on UCX progress and would otherwise each keep a core busy until the
machine restarts (three such orphans once slowed a whole test run by a third)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from kvxfer.backends.ucx.transport import ucxx_unavailable
from kvxfer.testing.waiting import settle

if (missing := ucxx_unavailable()) is not None:  # not importorskip: importing ucxx changes os.environ
    pytest.skip(missing, allow_module_level=True)


def _probes(marker: str) -> list[int]:
    """Pids of the ucx probe processes whose command line carries ``marker`` (their byte count)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue  # gone meanwhile
        if b"kvxfer.doctor.ucx" in argv and marker.encode() in argv:
            found.append(int(entry.name))
    return found


def test_killing_the_doctor_mid_probe_ends_both_ucx_probes() -> None:
    nbytes = (64 << 20) + 8 * (os.getpid() % 4096)  # marks this test's probes among any others
    marker = str(nbytes)
    # Thousands of 64 MiB messages: the probes are still sending when the doctor is killed.
    code = f"from kvxfer.doctor.ucx import probe; probe(nbytes={nbytes}, reps=4000, timeout=600)"
    doctor = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        assert settle(lambda: len(_probes(marker)) == 2, timeout=60), "the receiver and the sender never started"
        pids = _probes(marker)
    finally:
        doctor.send_signal(signal.SIGKILL)
        doctor.wait()
    assert settle(lambda: not _probes(marker), timeout=30), f"probes {pids} still run after their doctor was killed"
