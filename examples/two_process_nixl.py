"""Your own memory, two processes, NIXL: the prefill end in a child process pushes rows of a
numpy buffer into the decode end's buffer here, and every row is checked byte for byte.

    python examples/two_process_nixl.py

What it shows (the README's "Your own memory across processes"):
- your memory enters as ``SlotRegion``s (address, slot size, slot count, memory kind);
- a ``View`` names which slots hold which token blocks (ordinals);
- call order: each end describes its view; hints cross as bytes (``kvxfer.wire``); the hint
  that exposes rows to a write (the decode end's, in push mode) is bound to the one peer that
  may use it; then each end submits;
- ``wake`` is called on a backend thread: set an event there, do the work on yours.
"""

from __future__ import annotations

import multiprocessing as mp
import sys
import threading
from multiprocessing.connection import Connection

import numpy as np

from kvxfer import wire
from kvxfer.backends.nixl import NixlBackend
from kvxfer.contract import (
    CacheKind,
    Delivered,
    LayerGroupRows,
    MemoryKind,
    Peer,
    SlotRegion,
    TokenRange,
    TransferMode,
    View,
)

ROW_BYTES = 64 << 10      # one row: one block of every layer, K and V
SLOTS = 64                # rows each buffer holds
BLOCKS = 24               # the request's token blocks (16 tokens each)
LAYOUT = b"example-model/v1"  # both ends must share it: the pool's layout identity


def view_of(buffer: np.ndarray, name: str, slots: np.ndarray) -> tuple[SlotRegion, View]:
    region = SlotRegion(name, buffer.ctypes.data, ROW_BYTES, SLOTS, MemoryKind.HOST)
    rows = LayerGroupRows("full", CacheKind.PAGED, region, slots, np.arange(BLOCKS, dtype=np.int64))
    return region, View("request-1", TokenRange(0, BLOCKS * 16), (rows,), LAYOUT)


def prefill(conn: Connection) -> None:
    """The child: rows 0..BLOCKS-1 of the request live in scattered slots of its buffer."""
    buffer = np.random.default_rng(1).integers(0, 256, (SLOTS, ROW_BYTES), dtype=np.uint8)
    region, view = view_of(buffer, "prefill-kv", np.random.default_rng(2).permutation(SLOTS)[:BLOCKS])
    backend = NixlBackend(mode=TransferMode.PUSH)
    try:
        assert not backend.register([region])
        conn.send((backend.peer.agent, backend.peer.run))    # 1. who may write with the decode hint
        decode_hint = wire.decode_hint(conn.recv())               # 3. the decode end's hint
        conn.send(wire.encode_hint(backend.describe(view, decode_hint.peer)))  # 4. ours, bound to the decode end
        done = threading.Event()
        attempt = backend.publish(view, decode_hint, wake=done.set)       # 5. WRITE into the decode rows
        while attempt.poll() is None or not attempt.quiesced():
            done.wait(1.0)
            done.clear()
        conn.send(type(attempt.poll()).__name__)
    finally:
        backend.shutdown()


def main() -> int:
    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    child = ctx.Process(target=prefill, args=(theirs,), name="prefill-end")
    child.start()
    buffer = np.zeros((SLOTS, ROW_BYTES), dtype=np.uint8)
    slots = np.random.default_rng(3).permutation(SLOTS)[:BLOCKS]
    region, view = view_of(buffer, "decode-kv", slots)
    backend = NixlBackend(mode=TransferMode.PUSH)
    try:
        assert not backend.register([region])       # returns the regions it could not reach: none
        prefill_peer = Peer(*ours.recv())
        ours.send(wire.encode_hint(backend.describe(view, prefill_peer)))  # 2. bound to that one peer
        prefill_hint = wire.decode_hint(ours.recv())
        woken = threading.Event()
        attempt = backend.fetch(view, prefill_hint, wake=woken.set)    # concludes on the publisher's record
        while attempt.poll() is None or not attempt.quiesced():
            if not woken.wait(30.0):
                raise SystemExit("no outcome within 30 s")
            woken.clear()
        outcome = attempt.poll()
        publisher_outcome = ours.recv()
    finally:
        backend.shutdown()
        child.join(30)
    source = np.random.default_rng(1).integers(0, 256, (SLOTS, ROW_BYTES), dtype=np.uint8)
    sent = source[np.random.default_rng(2).permutation(SLOTS)[:BLOCKS]]
    exact = bool(np.array_equal(buffer[slots], sent))
    print(f"fetch: {type(outcome).__name__}, {outcome.rows_delivered}/{BLOCKS} rows; publisher: {publisher_outcome}; "
          f"bytes {'equal' if exact else 'DIFFER'}")
    return 0 if isinstance(outcome, Delivered) and exact and child.exitcode == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
