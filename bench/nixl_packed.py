"""NixlBackend push of scattered rows between two processes: one descriptor per row (unpacked)
against the packed path, with raw NIXL's one-descriptor WRITE of the same bytes, measured in
the same run, as the ceiling.

    .venv/bin/python bench/nixl_packed.py [--rows 4096] [--row-bytes 65536] [--reps 5] [--memory host|device]
                                          [--fetch-ahead-ms 20] [--layout scattered|contiguous]
                                          [--chunk-mib 16,256] [--paths unpacked,packed]
                                          [--post-inline auto,never] [--devices P,D] [--json out.json]

``--layout contiguous`` gives both ends consecutive slots, so that the unpacked path
coalesces them into one descriptor per chunk: then ``--chunk-mib`` (a list; 0 is the
backend's default) shows what the unpacked path's chunk size costs against the ceiling.

``--devices P,D`` (device memory) puts the publisher's rows and arena on CUDA device P and
the fetcher's on D; the run then also times torch's copy from device P to device D of the
same bytes (``device_copy``: D2D on one GPU, the peer copy across two), the reference
the packed target (docs/performance.md) is a share of.

Every figure is payload bytes over the time from the call that moves them to the moment they
are proven at the destination: raw NIXL, post to DONE (busy-polled); NixlBackend, publish() to
the publisher's outcome (unpacked: every request DONE, NIXL flushed; packed: every chunk
acknowledged as scattered by the peer). Rows are scattered at random on both ends (nothing
coalesces), host memory (or device memory with --memory device), pages faulted in beforehand;
the first run of each case warms up.
The fetcher registers its fetch ``--fetch-ahead-ms`` before the timed publish, as a decode
end does when it admits a request (the packed path's landing slots granted ahead come from
then; 0 times them back to back). The fetcher's outcome must be Delivered for every row, the path taken is read from the
backends' stats, and the bytes of the last repetition are compared row for row.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from typing import Any

os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

import numpy as np  # noqa: E402

from kvxfer.backends.nixl import NixlBackend  # noqa: E402
from kvxfer.bench.cases import device_scope  # noqa: E402
from kvxfer.contract import CacheKind, Delivered, LayerGroupRows, TokenRange, TransferMode, View  # noqa: E402
from kvxfer.testing.nixl_pairs import rows_of, touch_pages  # noqa: E402
from kvxfer.testing.subprocess_peer import SubprocessPeer  # noqa: E402
from kvxfer.wire import decode_hint, encode_hint  # noqa: E402


def summary(seconds: list[float], nbytes: int) -> dict[str, float]:
    return {"best_gbps": nbytes / min(seconds) / 1e9, "median_gbps": nbytes / statistics.median(seconds) / 1e9,
            "best_s": min(seconds), "median_s": statistics.median(seconds), "reps": len(seconds)}


def device_copy(nbytes: int, reps: int, devices: tuple[int, int]) -> dict[str, float]:
    """torch's copy of the payload from device P to device D, in this process (the reference)."""
    import torch

    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=f"cuda:{devices[0]}")
    dst = torch.zeros(nbytes, dtype=torch.uint8, device=f"cuda:{devices[1]}")
    times = []
    for i in range(reps + 1):
        torch.cuda.synchronize(devices[0])
        torch.cuda.synchronize(devices[1])
        start = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize(devices[1])
        torch.cuda.synchronize(devices[0])
        if i:
            times.append(time.perf_counter() - start)
    if not torch.equal(dst.cpu(), src.cpu()):
        raise RuntimeError("device copy: bytes differ")
    del src, dst
    torch.cuda.empty_cache()
    return summary(times, nbytes)


def raw_one_descriptor(nbytes: int, reps: int, memory: str, devices: tuple[int, int] = (0, 0)) -> dict[str, float]:
    """NIXL itself, no kvxfer code: the whole payload as one WRITE descriptor into a child."""
    from kvxfer.bench.nixl_raw import NixlPair

    pair = NixlPair(nbytes, memory, devices)
    try:
        zero = np.zeros(1, dtype=np.int64)
        handle = pair.handle("WRITE", pair.local.address + zero, pair.remote_address + zero, nbytes)
        times = []
        for i in range(reps + 1):
            start = time.perf_counter()
            pair.run(handle)
            if i:
                times.append(time.perf_counter() - start)
        check = pair.verify("WRITE", zero, zero, nbytes, seed=7)
        pair.run(handle)
        if not check():
            raise RuntimeError("raw NIXL: bytes at the target differ")
        pair.release(handle)
    finally:
        pair.close()
    return summary(times, nbytes)


def backend_push(path: str, rows: int, row_bytes: int, reps: int, memory_kind: str,
                 options: dict[str, Any], fetch_ahead_s: float = 0.02,
                 peer_factory: str = "kvxfer.testing.nixl_pairs:child_backend",
                 peer_env: dict[str, str] | None = None, contiguous: bool = False,
                 devices: tuple[int, int] = (0, 0)) -> dict[str, Any]:
    """NixlBackend publisher here, NixlBackend fetcher in a child (made by ``peer_factory``);
    ``path``: packed always|never; ``contiguous``: consecutive slots on both ends (each
    repetition at another offset) instead of scattered ones; ``devices``: the CUDA devices of
    the publisher's and the fetcher's device rows."""
    slots = rows * 2
    opts = {"packed": path, "deadline_s": 300.0, **options}
    memory = rows_of(memory_kind, (("S", row_bytes, slots),), devices[0])
    touch_pages(memory)
    with device_scope(memory_kind, devices[0]):
        local = NixlBackend(mode=TransferMode.PUSH, **opts)
        local.register(memory.regions)
    peer = SubprocessPeer(peer_factory, {"mode": "push", "buffers": [["P", row_bytes, slots]], "touch": True,
                                         "memory_kind": memory_kind, "device": devices[1], **opts}, env=peer_env)
    rng = np.random.default_rng(1)
    ordinals = np.arange(rows, dtype=np.int64)
    times = []
    try:
        payload = rng.integers(0, 256, rows * row_bytes, dtype=np.uint8).tobytes()
        for i in range(reps + 1):
            if contiguous:
                ls = np.arange(rows, dtype=np.int64) + (i % 2) * rows
                ps = np.arange(rows, dtype=np.int64) + ((i + 1) % 2) * rows
            else:
                ls = rng.permutation(slots)[:rows].astype(np.int64)
                ps = rng.permutation(slots)[:rows].astype(np.int64)
            request = f"{path}-{i}"
            lview = View(request, TokenRange(0, rows * 16),
                         (LayerGroupRows("g", CacheKind.PAGED, memory.regions[0], ls, ordinals),), b"B")
            pview = View(request, TokenRange(0, rows * 16),
                         (LayerGroupRows("g", CacheKind.PAGED, peer.regions[0], ps, ordinals),), b"B")
            if i == reps:
                memory.write("S", ls, payload)
            hint = decode_hint(peer.describe_bytes(pview))  # the fetcher describes, then waits
            handle = peer.start_bytes("fetch", pview, encode_hint(local.describe(lview)))
            # In serving the decode end registers its fetch when it admits the request, long
            # before prefill publishes; the packed path's slots granted ahead come from then.
            time.sleep(fetch_ahead_s)
            start = time.perf_counter()
            attempt = local.publish(lview, hint)
            if not attempt.wait(300.0):
                raise RuntimeError(f"{path}: publish did not conclude")
            elapsed = time.perf_counter() - start
            outcome, quiet = peer.result(handle, 120.0)
            mine = attempt.poll()
            if not isinstance(mine, Delivered) or not isinstance(outcome, Delivered) or not outcome.all_delivered:
                raise RuntimeError(f"{path}: not every row delivered: {mine} / {outcome}")
            if local.path_of(attempt) != ("packed" if path == "always" else "unpacked"):
                raise RuntimeError(f"{path}: went {local.path_of(attempt)}")
            if i:
                times.append(elapsed)
        if peer.read("P", ps) != payload:
            raise RuntimeError(f"{path}: bytes at the fetcher differ")
        stats = local.stats()
    finally:
        local.shutdown()
        peer.close()
    return {**summary(times, rows * row_bytes), "stats": stats.__dict__, "options": opts,
            "fetch_ahead_s": fetch_ahead_s, "contiguous": contiguous, "devices": list(devices)}


def parse_devices(text: str | None, memory: str) -> tuple[int, int]:
    """``--devices P,D``: two CUDA device indices, for device memory only; ValueError if not."""
    if text is None:
        return (0, 0)
    if memory != "device":
        raise ValueError("--devices needs --memory device")
    parts = text.split(",")
    if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
        raise ValueError(f"--devices takes two CUDA device indices P,D, got {text!r}")
    return int(parts[0]), int(parts[1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--row-bytes", type=int, default=64 << 10)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--arena-mib", type=int, default=0, help="0: the backend's default for the memory kind")
    parser.add_argument("--packed-chunk-mib", type=int, default=0, help="0: the backend's default")
    parser.add_argument("--memory", choices=("host", "device"), default="host")
    parser.add_argument("--poll-us", type=float, default=500.0,
                        help="progress-thread pause while transfers are pending (NixlBackend poll_s)")
    parser.add_argument("--fetch-ahead-ms", type=float, default=20.0,
                        help="time between the fetcher's fetch() and the timed publish() (0: back to back)")
    parser.add_argument("--layout", choices=("scattered", "contiguous"), default="scattered")
    parser.add_argument("--chunk-mib", default="0",
                        help="the unpacked path's chunk sizes to measure, MiB, comma-separated (0: the backend's default)")
    parser.add_argument("--paths", default="unpacked,packed", help="which of unpacked,packed to measure")
    parser.add_argument("--post-inline", default="auto",
                        help="the unpacked path's post_inline values to measure, comma-separated: auto (None), "
                             "always (True), never (False)")
    parser.add_argument("--devices", metavar="P,D",
                        help="CUDA devices of the publisher's and the fetcher's rows (device memory; default 0,0)")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args(argv)
    try:
        devices = parse_devices(args.devices, args.memory)
    except ValueError as exc:
        parser.error(str(exc))
    chunk_mib = [int(c) for c in args.chunk_mib.split(",")]
    paths = args.paths.split(",")
    inline_values = {"auto": None, "always": True, "never": False}
    inlines = args.post_inline.split(",")
    if any(c < 0 for c in chunk_mib) or not set(paths) <= {"unpacked", "packed"} or not paths:
        parser.error("--chunk-mib takes sizes >= 0; --paths takes unpacked and/or packed")
    if not set(inlines) <= set(inline_values):
        parser.error("--post-inline takes auto, always and/or never")
    nbytes = args.rows * args.row_bytes
    options = {"arena_bytes": args.arena_mib << 20 if args.arena_mib else None,
               "packed_chunk_bytes": args.packed_chunk_mib << 20 if args.packed_chunk_mib else None,
               "poll_s": args.poll_us * 1e-6}
    result: dict[str, Any] = {
        "machine": {"host": platform.node(), "cpus": os.cpu_count(), "python": sys.version.split()[0],
                    "loadavg": os.getloadavg()},
        "rows": args.rows, "row_bytes": args.row_bytes, "bytes": nbytes, "reps": args.reps, "memory": args.memory,
        "layout": args.layout, "devices": list(devices),
    }
    contiguous = args.layout == "contiguous"
    names = []
    if args.memory == "device":
        result["device_copy"] = device_copy(nbytes, args.reps, devices)
        names.append("device_copy")
    result["raw_one_descriptor"] = raw_one_descriptor(nbytes, args.reps, args.memory, devices)
    names.append("raw_one_descriptor")
    if "unpacked" in paths:
        for inline in inlines:
            for mib in chunk_mib:
                name = ("unpacked" if mib == 0 else f"unpacked_chunk_{mib}MiB") + \
                    ("" if inline == "auto" else f"_inline_{inline}")
                chunk = {"chunk_bytes": mib << 20} if mib else {}
                result[name] = backend_push("never", args.rows, args.row_bytes, args.reps, args.memory,
                                            {**options, **chunk, "post_inline": inline_values[inline]},
                                            args.fetch_ahead_ms / 1e3, contiguous=contiguous, devices=devices)
                names.append(name)
    if "packed" in paths:
        result["packed"] = backend_push("always", args.rows, args.row_bytes, args.reps, args.memory, options,
                                        args.fetch_ahead_ms / 1e3, contiguous=contiguous, devices=devices)
        names.append("packed")
    ceiling = result["raw_one_descriptor"]["best_gbps"]
    copy = result["device_copy"]["best_gbps"] if "device_copy" in result else None
    where = f", devices {devices[0]} -> {devices[1]}" if args.memory == "device" else ""
    print(f"{args.rows} {args.layout} rows x {args.row_bytes // 1024} KiB = {nbytes >> 20} MiB, two processes, "
          f"{args.memory} memory{where}, best / median of {args.reps}")
    for name in names:
        r = result[name]
        of_copy = f", {r['best_gbps'] / copy:5.1%} of the device copy" if copy else ""
        print(f"  {name:26s} {r['best_gbps']:8.2f} / {r['median_gbps']:8.2f} GB/s   "
              f"({r['best_gbps'] / ceiling:5.1%} of the one-descriptor ceiling{of_copy})")
    if "packed" in result and "unpacked" in result:
        print(f"  packed / unpacked (best): {result['packed']['best_gbps'] / result['unpacked']['best_gbps']:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
