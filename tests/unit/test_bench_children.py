"""A bench case's child process starts with SIGINT blocked, so that the terminal's Ctrl-C (sent
to the whole process group) reaches only the bench; a Ctrl-C during the references' second
pass keeps the first pass's figures and still counts as an interruption."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from kvxfer.bench.cases import Role
from kvxfer.bench.children import running_children, start_child, stop
from kvxfer.bench.config import preset
from kvxfer.bench.registry import registry
from kvxfer.bench.runner import run


def _blocked(pid: int) -> set[int]:
    mask = next(line for line in Path(f"/proc/{pid}/status").read_text().splitlines() if line.startswith("SigBlk:"))
    bits = int(mask.split()[1], 16)
    return {n for n in range(1, 65) if bits & (1 << (n - 1))}


def test_a_child_started_through_start_child_has_sigint_blocked_and_the_bench_does_not() -> None:
    child = start_child(lambda: subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]))
    try:
        assert signal.SIGINT in _blocked(child.pid)
        assert child.pid in running_children()
        assert signal.SIGINT not in signal.pthread_sigmask(signal.SIG_BLOCK, set())  # this thread's mask is as it was
        os.kill(child.pid, signal.SIGINT)
        time.sleep(0.3)
        assert child.poll() is None  # SIGINT stays pending; the bench stops its children itself
    finally:
        assert stop([child.pid]) == [child.pid]
        child.wait(10)
    assert child.returncode == -signal.SIGTERM


def test_a_first_multiprocessing_spawn_is_blocked_too() -> None:
    """multiprocessing's first spawn launches its resource tracker and unblocks SIGINT after
    that launch: a fresh interpreter shows that the child still starts with SIGINT blocked."""
    script = textwrap.dedent("""
        import multiprocessing as mp, time
        from kvxfer.bench.children import start_child
        if __name__ == "__main__":
            proc = mp.get_context("spawn").Process(target=time.sleep, args=(30,), daemon=True)
            start_child(proc.start)
            status = open(f"/proc/{proc.pid}/status").read()
            print(next(line for line in status.splitlines() if line.startswith("SigBlk:")).split()[1])
            proc.kill()
            proc.join()
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert int(done.stdout.split()[-1], 16) & (1 << (signal.SIGINT - 1))


def test_a_ctrl_c_in_the_second_pass_keeps_the_first_and_counts_as_interrupted() -> None:
    class CopyThenCtrlC:
        calls = 0

        def __init__(self, config: object) -> None:
            self._real = registry()["local_copy"].factory(config)

        def throughput(self, point: object) -> object:
            CopyThenCtrlC.calls += 1
            if CopyThenCtrlC.calls > 2:  # the second pass
                raise KeyboardInterrupt
            return self._real.throughput(point)  # type: ignore[arg-type]

        def close(self) -> None:
            self._real.close()

    specs = dict(registry())
    specs["local_copy"] = dataclasses.replace(specs["local_copy"], factory=CopyThenCtrlC)  # type: ignore[arg-type]
    assert specs["local_copy"].role is Role.REFERENCE  # measured again in the second pass
    cfg = dataclasses.replace(preset("tiny"), cases=("local_copy",), latency=None, overhead=None)
    result = run(cfg, specs=specs)
    assert result.interrupted
    assert len(result.figures) == 2 and all(f.ok for f in result.figures)
    assert not any("passes_gbps_best" in f.facts for f in result.figures)
