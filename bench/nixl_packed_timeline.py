"""Timeline of one packed NIXL push in both processes: where its milliseconds go.

Runs ``bench/nixl_packed.py``'s packed push (publisher here, fetcher in a child) with the
steps of both ends stamped (CLOCK_MONOTONIC, comparable across the two processes) by
wrapping them: publish(), the notes each end sends and receives (``req``, ``credit`` with
the slots granted and chunks acknowledged, ``chunk``, the completion record), the batched
gathers and scatters, each WRITE's post, its DONE and its release, and each end's outcome. Prints the
last repetition's events in microseconds since its publish() call, the fetcher's indented;
the wrappers cost time themselves, so read the gaps, not the sum. ``[cpu N us]`` is the CPU
time the stamping thread used since its own previous stamp.

    python bench/nixl_packed_timeline.py [--rows 4096] [--row-bytes 65536] [--chunk-mib 32]
                                         [--memory device] [--poll-us 100] [--devices P,D]
                                         [--path packed|unpacked] [--layout scattered|contiguous]

``--path unpacked`` stamps the unpacked push instead (``--chunk-mib`` is then its chunk size);
with ``--layout contiguous`` its rows coalesce into one descriptor per chunk.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

TRACE_ENV = "KVXFER_TIMELINE_DIR"
_EVENTS: list[tuple[int, str, str, str]] = []
_LAST_CPU: dict[int, int] = {}  # thread -> its CPU time at its previous stamp


def _stamp(end: str, name: str, detail: str = "") -> None:
    # With the CPU time the stamping thread spent since its previous stamp: a gap that is
    # mostly CPU is work, one that is not is waiting (a sleep, a lock, the GIL, preemption).
    now, cpu, thread = time.monotonic_ns(), time.thread_time_ns(), threading.get_ident()
    spent = (cpu - _LAST_CPU[thread]) // 1000 if thread in _LAST_CPU else -1
    _LAST_CPU[thread] = cpu
    _EVENTS.append((now, end, name, f"{detail} [cpu {spent} us]" if spent >= 0 else detail))


def _wrap(owner: Any, attr: str, end: str, after: Any = None, bracket: bool = True) -> None:
    """Stamp ``attr`` on entry and exit (``bracket``); ``after(result, args)`` may stamp more."""
    original = getattr(owner, attr)

    @functools.wraps(original)
    def stamped(*args: Any, **kwargs: Any) -> Any:
        if bracket:
            _stamp(end, attr + ">")
        result = original(*args, **kwargs)
        if bracket:
            _stamp(end, attr + "<")
        if after is not None:
            after(result, args)
        return result

    setattr(owner, attr, stamped)


def install(end: str) -> None:
    """Stamp this process's NixlBackend ("S" the publisher, "R" the fetcher)."""
    from kvxfer.backends.common import attempt, engine
    from kvxfer.backends.nixl import agent as nixl_agent
    from kvxfer.backends.nixl import backend as nixl
    from kvxfer.backends.nixl import packed as nixl_packed
    from kvxfer.backends.nixl import packed_notes as nixl_notes
    from kvxfer.backends.nixl import paths, sender

    def kind(message: bytes) -> str:
        if not message.startswith(nixl_notes.NOTE_PREFIX):
            return "record"
        note = nixl_notes.decode_note(message)
        return note["k"] if note["k"] != "credit" else f"credit +{len(note['grant'])} ok{len(note['ok'])}"

    _wrap(nixl.NixlBackend, "publish", end)
    _wrap(nixl_packed.Arena, "gather", end, lambda _, a: _stamp(end, "  chunks", str(len(a[1]))))
    _wrap(nixl_packed.Arena, "scatter", end, lambda _, a: _stamp(end, "  chunks", str(len(a[1]))))
    _wrap(nixl_agent.NixlAgent, "post", end)
    _wrap(nixl_agent.NixlAgent, "release", end)
    _wrap(nixl_agent.NixlAgent, "ensure_peer", end)
    _wrap(sender, "plan_chunks", end)
    _wrap(paths, "count_descriptors", end)
    _wrap(nixl, "conclusion", end)
    _wrap(nixl, "encode_completion", end)
    _wrap(engine, "check_submission", end)
    _wrap(nixl, "match_rows", end)
    _wrap(nixl_agent.NixlAgent, "notify", end, lambda _, a: _stamp(end, "sent", kind(a[2])))
    _wrap(nixl_agent.NixlAgent, "state", end, lambda r, _: r != "PROC" and _stamp(end, "WRITE", r), bracket=False)
    received = nixl_agent.NixlAgent.notifications

    def notifications(self: Any) -> dict[str, list[bytes]]:
        out = received(self)
        if out:
            _stamp(end, "received", ", ".join(kind(m) for ms in out.values() for m in ms))
        return out

    nixl_agent.NixlAgent.notifications = notifications  # type: ignore[method-assign]
    _wrap(attempt.TrackedAttempt, "conclude", end, lambda _, a: _stamp(end, "outcome", type(a[1]).__name__),
          bracket=False)
    shutdown = nixl.NixlBackend.shutdown

    def dump_then_shutdown(self: Any, *args: Any, **kwargs: Any) -> Any:
        Path(os.environ[TRACE_ENV], f"{end}-{os.getpid()}.json").write_text(json.dumps(_EVENTS))
        return shutdown(self, *args, **kwargs)

    nixl.NixlBackend.shutdown = dump_then_shutdown  # type: ignore[method-assign]


def child(**kwargs: Any) -> Any:
    """The fetcher's factory (SubprocessPeer): stamped, then nixl_pairs' own."""
    install("R")
    from kvxfer.testing.nixl_pairs import child_backend

    return child_backend(**kwargs)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--row-bytes", type=int, default=64 << 10)
    parser.add_argument("--chunk-mib", type=int, default=32)
    parser.add_argument("--arena-mib", type=int, default=512)
    parser.add_argument("--memory", choices=("host", "device"), default="device")
    parser.add_argument("--poll-us", type=float, default=100.0)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--path", choices=("packed", "unpacked"), default="packed")
    parser.add_argument("--layout", choices=("scattered", "contiguous"), default="scattered")
    parser.add_argument("--devices", metavar="P,D", help="CUDA devices of the publisher's and the fetcher's rows")
    args = parser.parse_args(argv)
    here = str(Path(__file__).resolve().parent)
    sys.path.insert(0, here)
    import nixl_packed  # noqa: PLC0415 - the sibling script, on the path just above

    try:
        devices = nixl_packed.parse_devices(args.devices, args.memory)
    except ValueError as exc:
        parser.error(str(exc))

    with tempfile.TemporaryDirectory() as trace_dir:
        os.environ[TRACE_ENV] = trace_dir
        install("S")
        env = {"PYTHONPATH": os.pathsep.join([here, os.environ.get("PYTHONPATH", "")]), TRACE_ENV: trace_dir}
        options = {"arena_bytes": args.arena_mib << 20, "poll_s": args.poll_us * 1e-6,
                   ("packed_chunk_bytes" if args.path == "packed" else "chunk_bytes"): args.chunk_mib << 20}
        result = nixl_packed.backend_push("always" if args.path == "packed" else "never", args.rows, args.row_bytes,
                                          args.reps, args.memory, options, peer_factory="nixl_packed_timeline:child",
                                          peer_env=env, contiguous=args.layout == "contiguous", devices=devices)
        events = sorted(e for f in Path(trace_dir).glob("*.json") for e in json.loads(f.read_text()))
    print(f"{args.rows} {args.layout} rows x {args.row_bytes >> 10} KiB, {args.memory} memory, chunks of "
          f"{args.chunk_mib} MiB: {args.path} {result['best_gbps']:.1f} GB/s best, {result['median_gbps']:.1f} median")
    start = [t for t, end, name, _ in events if (end, name) == ("S", "publish>")][-1]
    for t, end, name, detail in events:
        if t >= start:
            print(f"{(t - start) / 1e3:9.1f}  {'':28s}" if end == "R" else f"{(t - start) / 1e3:9.1f}  ",
                  f"{name} {detail}".rstrip())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
