"""Where an IpcBackend push spends its time, step by step (a diagnostic for the GPU machine).

    python bench/ipc_breakdown.py [--cases 262144x4096,16384x65536,32x65536] [--reps 5] [--small-reps 200]
                                  [--emulated] [--busy-poll] [--devices P,D] [--tail 0.02]
                                  [--settle-us 0]

The publisher is an IpcBackend here; the fetcher an IpcBackend in a child process
(``ipc_pair.ChildPeer``). Both processes wrap the backend's steps (checks, row matching,
launch, the native call, record encoding and decoding, finishing) with CLOCK_MONOTONIC
stamps, which the two processes share. Each line is the median over the repetitions of a
step's stamp, in microseconds since the publish() call. The wrappers cost time themselves
(tens of microseconds per request on a slow host): read differences, not the total.
``--busy-poll`` makes the decode end busy-poll, with its doorbell (``kvxfer.backends.ipc.doorbells``).
``--emulated`` runs both ends over kvxfer.testing.host_cuda (no GPU): the control path's
Python costs on any machine; its copies are host memcpy, so those steps say nothing of a GPU.
``--tail F`` adds the medians over the slowest fraction F of the samples (by when the decode
end saw its outcome), to show which step grows in the tail; collections of Python's garbage
collector are stamped in both processes (``gc0>`` .. ``gc2<``) and counted there.
``--settle-us N`` sleeps N µs between the decode end's registration of its fetch and the
publish (serving registers it a prefill earlier; a ping alone sometimes races the decode
end's handling of it).
``--devices 0,1`` puts the publisher's rows on GPU 0 and the fetcher's on GPU 1.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from typing import Any

import numpy as np

import kvxfer.backends.common.engine as engine
import kvxfer.backends.ipc.backend as ipc
import kvxfer.backends.ipc.channel as ipc_channel
import kvxfer.backends.ipc.frames as ipc_frames
import kvxfer.testing.ipc_pairs as pair
from kvxfer.backends.ipc.copies import CopyQueue
from kvxfer.backends.ipc.waits import PassiveWaits
from kvxfer.bench.config import devices_argument

STAMPS: list[tuple[str, int]] = []
_ORIGINAL_SERVE = pair._serve


def _stamp(label: str) -> None:
    STAMPS.append((label, time.monotonic_ns()))


def _timed(fn: Any, name: str) -> Any:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        _stamp(name + ">")
        out = fn(*args, **kwargs)
        _stamp(name + "<")
        return out
    return wrapper


class _TimedNative:
    """The native module, with the row copy call and the first completed event query stamped."""

    def __init__(self, module: Any) -> None:
        self._module = module

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)

    def cuda_copy_rows(self, *args: Any, **kwargs: Any) -> Any:
        _stamp("native>")
        out = self._module.cuda_copy_rows(*args, **kwargs)
        _stamp("native<")
        return out

    def cuda_copy_rows_then(self, *args: Any, **kwargs: Any) -> Any:  # the last kernel, the doorbell store and the event
        _stamp("native_then>")
        out = self._module.cuda_copy_rows_then(*args, **kwargs)
        _stamp("native_then<")
        return out

    def event_query(self, event: int) -> bool:
        done = bool(self._module.event_query(event))
        if done:
            _stamp("event_done")
        return done


def _gc_stamp(phase: str, info: dict[str, int]) -> None:
    _stamp(f"gc{info['generation']}{'>' if phase == 'start' else '<'}")


def instrument() -> None:
    # Collections stamped too (gc0> .. gc2<): a pause of the collector is a candidate for the tail.
    if _gc_stamp not in gc.callbacks:
        gc.callbacks.append(_gc_stamp)
    # Each function wrapped in the module that calls it.
    for module, name in ((engine, "check_submission"), (ipc, "match_rows"), (ipc_frames, "encode_completion"),
                         (ipc_frames, "decode_completion")):
        setattr(module, name, _timed(getattr(module, name), name))
    # The progress thread's socket/doorbell spin (busy_poll): entered and returned.
    ipc_channel.Channel.spin = _timed(ipc_channel.Channel.spin, "spin")  # type: ignore[method-assign]
    backend = ipc.IpcBackend
    # Stamped under the names these steps had as IpcBackend methods, so that runs compare.
    for owner, name, label in ((CopyQueue, "launch", "_launch"), (backend, "_complete", "_complete"),
                               (backend, "_finish", "_finish"), (backend, "_on_frame", "_on_frame"),
                               (backend, "_on_record", "_on_record"), (CopyQueue, "peer_exports", "_peer_exports"),
                               (PassiveWaits, "check_bells", "_check_bells"), (PassiveWaits, "on_token", "_on_token")):
        setattr(owner, name, _timed(getattr(owner, name), label))
    init = backend.__init__

    def timed_init(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        self._copies.native = _TimedNative(self._copies.native)  # the copy queue makes the stamped calls

    backend.__init__ = timed_init  # type: ignore[method-assign]


def serve_instrumented(conn: Any, spec: Any) -> None:
    """The child: the usual IPC peer, instrumented, answering a 'stamps' command too."""
    instrument()
    handle = pair._handle

    def with_stamps(cmd: str, args: list[Any], *rest: Any) -> Any:
        if cmd == "stamps":
            out = list(STAMPS)
            STAMPS.clear()
            return out
        _stamp(f"cmd:{cmd}>")  # the child's command thread (it takes the GIL too)
        try:
            return handle(cmd, args, *rest)
        finally:
            _stamp(f"cmd:{cmd}<")

    pair._handle = with_stamps
    _ORIGINAL_SERVE(conn, spec)


def run(row: int, rows: int, reps: int, warmup: int = 3, emulated: bool = False, busy_poll: bool = False,
        devices: tuple[int, int] = (0, 0), tail: float = 0.0, settle_us: int = 0) -> None:
    slots = rows + rows // 4
    samples: list[dict[str, int]] = []
    pair._serve = serve_instrumented  # the spawned child runs this module's function
    try:
        with pair.push_pair(row, slots, emulated, busy_poll, devices) as (peer, memory, local):
            _sample(peer, memory, local, slots, rows, reps, warmup, samples, settle_us)
    finally:
        pair._serve = _ORIGINAL_SERVE
    _report(samples, row, rows, emulated, tail)


def _sample(peer: Any, memory: Any, local: Any, slots: int, rows: int, reps: int, warmup: int,
            samples: list[dict[str, int]], settle_us: int) -> None:
    rng = np.random.default_rng(1)
    for i in range(reps + warmup):
        lv = pair.one_group_view(memory.regions[0], rng.permutation(slots)[:rows].astype(np.int64), f"r{i}")
        pv = pair.one_group_view(peer.regions[0], rng.permutation(slots)[:rows].astype(np.int64), f"r{i}")
        hint = peer.describe(pv)
        handle = peer.start("fetch", pv, local.describe(lv))
        peer._call("stamps")
        STAMPS.clear()
        if settle_us:  # the decode end's fetch registered that long before the publish, as in serving
            time.sleep(settle_us / 1e6)
        woke: list[int] = []
        _stamp("t0")
        start = STAMPS[-1][1]
        attempt = local.publish(lv, hint, lambda w=woke: w.append(time.monotonic_ns()))
        _stamp("publish_ret")
        if not attempt.wait(30):
            raise RuntimeError("the publisher did not conclude")
        outcome, _quiet = peer.result(handle, 30)
        if outcome is None or not outcome.all_delivered:
            raise RuntimeError(f"not delivered: {outcome!r}")
        seen: dict[str, int] = {}
        for label, t in STAMPS:
            if t >= start:  # stamps of the harness before t0 (a collection while preparing) are not this sample's
                seen.setdefault(label, t)
        seen["local_wake"] = woke[0]
        for label, t in peer._call("stamps"):
            if t >= start:
                seen.setdefault("peer:" + label, t)
        if peer.last_visible_ns is None:
            raise RuntimeError("the decode process did not stamp its outcome")
        seen["peer_visible"] = peer.last_visible_ns
        if i >= warmup:
            samples.append(seen)


def _report(samples: list[dict[str, int]], row: int, rows: int, emulated: bool, tail: float) -> None:
    if not samples:
        raise SystemExit("no samples: --reps must be at least 1")
    what = f"{'emulated (host memory), ' if emulated else ''}{rows} x {row // 1024} KiB ({rows * row / 2**20:.0f} MiB)"
    _print_medians(f"--- {what}, median over {len(samples)} (us since t0)", samples)
    if tail > 0 and all("peer_visible" in s for s in samples):
        slow = sorted(samples, key=lambda s: s["peer_visible"] - s["t0"])[-max(1, round(len(samples) * tail)):]
        _print_medians(f"--- the slowest {len(slow)} by peer_visible ({tail:.0%}), median over them (us since t0)", slow)
        with_gc = sum(any(k.startswith(("gc", "peer:gc")) for k in s) for s in slow)
        print(f"  a garbage collection ran in {with_gc} of them "
              f"(and in {sum(any(k.startswith(('gc', 'peer:gc')) for k in s) for s in samples)} of all {len(samples)})")


def _print_medians(title: str, samples: list[dict[str, int]]) -> None:
    """Each label's median over the samples holding it (a step some samples skip, such as a
    garbage collection, is marked with how many held it), in order of those medians."""
    print(title)
    medians = {}
    for label in {k for s in samples for k in s}:
        values = [s[label] - s["t0"] for s in samples if label in s]
        medians[label] = (statistics.median(values) / 1e3, len(values))
    for label, (value, held) in sorted(medians.items(), key=lambda kv: kv[1][0]):
        note = "" if held == len(samples) else f"   (in {held})"
        print(f"  {label:28s} {value:10.1f}{note}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default="262144x4096,16384x65536,32x65536", help="ROWSxROW_BYTES, comma-separated")
    ap.add_argument("--reps", type=int, default=5, help="repetitions of cases of more than 1,000 rows")
    ap.add_argument("--small-reps", type=int, default=200, help="repetitions of smaller cases")
    ap.add_argument("--emulated", action="store_true", help="kvxfer.testing.host_cuda instead of CUDA (no GPU)")
    ap.add_argument("--busy-poll", action="store_true", help="the decode end busy-polls (and offers its doorbell)")
    ap.add_argument("--devices", default=(0, 0), type=devices_argument,
                    help="CUDA devices of the publisher's and the fetcher's rows (e.g. 0,1)")
    ap.add_argument("--tail", type=float, default=0.0,
                    help="also the medians over this slowest fraction of samples (e.g. 0.02), by peer_visible")
    ap.add_argument("--settle-us", type=int, default=0,
                    help="microseconds to sleep between the decode end's fetch registration and the publish")
    args = ap.parse_args(argv)
    if not 0.0 <= args.tail < 1.0:
        ap.error("--tail is a fraction in [0, 1)")
    if args.emulated and args.devices != (0, 0):
        ap.error("--emulated has one device: leave --devices at 0,0")
    instrument()
    for case in args.cases.split(","):
        rows, row = (int(x) for x in case.split("x"))
        run(row, rows, args.reps if rows > 1000 else args.small_reps, emulated=args.emulated,
            busy_poll=args.busy_poll, devices=args.devices, tail=args.tail,
            settle_us=args.settle_us)
    return 0


if __name__ == "__main__":
    sys.exit(main())
