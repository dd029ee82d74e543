"""publish() call -> the native copy call, once per request as serving makes them (CPU, emulated).

    .venv/bin/python to_native.py [REPS]

An IpcBackend push pair over kvxfer.testing.host_cuda (ipc_pair.push_pair, no GPU): every
sample describes both views, registers the decode end's fetch in the child, sleeps 0.5 ms,
then times one publish() of 32 x 64 KiB rows up to the moment its native copy call starts,
in wall time and in the publishing thread's CPU time (equal: the thread runs, it does not wait).
"""

import statistics
import sys
import time

import numpy as np

import kvxfer.backends.ipc as ipc
import kvxfer.backends.ipc_pair as pair

STAMP: dict[str, tuple[int, int]] = {}


class Stamped:
    """The CUDA calls (emulated), with the copy call's entry stamped."""

    def __init__(self, module: object) -> None:
        self._module = module

    def __getattr__(self, name: str) -> object:
        return getattr(self._module, name)

    def cuda_copy_rows_then(self, *args: object) -> object:
        STAMP.setdefault("native", (time.perf_counter_ns(), time.thread_time_ns()))
        return self._module.cuda_copy_rows_then(*args)  # type: ignore[attr-defined]


_init = ipc.IpcBackend.__init__


def _stamped_init(self: ipc.IpcBackend, *args: object, **kwargs: object) -> None:
    _init(self, *args, **kwargs)  # type: ignore[arg-type]
    self._native = Stamped(self._native)  # type: ignore[assignment]


def main(reps: int, rows: int = 32, row: int = 65536, warmup: int = 20) -> None:
    ipc.IpcBackend.__init__ = _stamped_init  # type: ignore[method-assign]
    slots = rows + rows // 4
    wall, cpu = [], []
    with pair.push_pair(row, slots, True, True, (0, 0)) as (peer, memory, local):
        rng = np.random.default_rng(1)
        for i in range(reps + warmup):
            lv = pair.one_group_view(memory.regions[0], rng.permutation(slots)[:rows].astype(np.int64), f"r{i}")
            pv = pair.one_group_view(peer.regions[0], rng.permutation(slots)[:rows].astype(np.int64), f"r{i}")
            hint = peer.describe(pv)
            handle = peer.start("fetch", pv, local.describe(lv))
            time.sleep(0.0005)
            STAMP.clear()
            t0, c0 = time.perf_counter_ns(), time.thread_time_ns()
            attempt = local.publish(lv, hint)
            attempt.wait(30)
            outcome, _quiet = peer.result(handle, 30)
            if outcome is None or not outcome.all_delivered:
                raise RuntimeError(f"not delivered: {outcome!r}")
            if i >= warmup:
                wall.append((STAMP["native"][0] - t0) / 1e3)
                cpu.append((STAMP["native"][1] - c0) / 1e3)
    print(f"publish() -> native call, {reps} samples: wall p50 {statistics.median(wall):.1f} us "
          f"(p10 {np.percentile(wall, 10):.1f}), thread CPU p50 {statistics.median(cpu):.1f} us")


if __name__ == "__main__":  # the decode end is a spawned child: it imports this file
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 500)
