"""A real round trip through the contract: scattered rows of two layer groups, pushed and
pulled between two loopback backends, with a partial failure and its exact masks.

Run: .venv/bin/python examples/loopback_roundtrip.py
"""

from __future__ import annotations

import numpy as np

from kvxfer.backends.loopback import LoopbackBackend, LoopbackFabric
from kvxfer.contract import CacheKind, LayerGroupRows, TokenRange, TransferMode, View
from kvxfer.testing.memory import HostBuffer

ROW_BYTES = {"full_attn": 4096, "sliding": 1024}
BLOCKS = 12


def views(rng: np.random.Generator, prefill: dict[str, HostBuffer], decode: dict[str, HostBuffer],
          request: str) -> tuple[View, View]:
    def side(buffers: dict[str, HostBuffer]) -> View:
        groups = tuple(
            LayerGroupRows(name, CacheKind.PAGED, buf.region,
                           rng.choice(buf.region.slots, BLOCKS, replace=False), np.arange(BLOCKS))
            for name, buf in buffers.items()
        )
        return View(request, TokenRange(0, BLOCKS * 16), groups, layout=b"example-layout")

    return side(prefill), side(decode)


def transfer(mode: TransferMode, fail_after: int | None = None) -> None:
    fabric = LoopbackFabric()
    prefill = LoopbackBackend(fabric, "prefill", mode, fail_after_rows=fail_after)
    decode = LoopbackBackend(fabric, "decode", mode, fail_after_rows=fail_after)
    prefill_memory = {g: HostBuffer(f"P-{g}", n, 64) for g, n in ROW_BYTES.items()}
    decode_memory = {g: HostBuffer(f"D-{g}", n, 64) for g, n in ROW_BYTES.items()}
    prefill.register([b.region for b in prefill_memory.values()])
    decode.register([b.region for b in decode_memory.values()])
    rng = np.random.default_rng(7)
    for buf in prefill_memory.values():
        buf.array[:] = rng.integers(0, 256, buf.array.shape, dtype=np.uint8)
    prefill_view, decode_view = views(rng, prefill_memory, decode_memory, "req-1")

    # Each end describes itself; a router would carry these hints as bytes.
    prefill_hint = prefill.describe(prefill_view, decode.peer)  # each bound to the one peer that may use it
    decode_hint = decode.describe(decode_view, prefill.peer)
    fetch = decode.fetch(decode_view, prefill_hint)
    publish = prefill.publish(prefill_view, decode_hint)
    assert fetch.wait(10) and publish.wait(10), "transfer did not finish"
    outcome = fetch.poll()
    assert outcome is not None

    exact = all(
        np.array_equal(decode_memory[g.layer_group].array[g.slots[m]], prefill_memory[g.layer_group].array[pg.slots[m]])
        for g, pg, m in zip(decode_view.groups, prefill_view.groups, outcome.masks)
    )
    moved = sum(int(m.sum()) * ROW_BYTES[g.layer_group] for g, m in zip(decode_view.groups, outcome.masks))
    print(f"{mode.value:>4}  fail_after={fail_after!s:>4}  decode outcome: {type(outcome).__name__:<9} "
          f"rows {outcome.rows_delivered}/{decode_view.rows}  bytes {moved:>7}  delivered rows byte-exact: {exact}")
    if outcome.rows_delivered < decode_view.rows:
        print("      masks:", " ".join("".join("1" if x else "." for x in m) for m in outcome.masks))
    for backend in (prefill, decode):
        assert backend.shutdown() == frozenset(), "an attempt was left unquiesced"


def main() -> None:
    print(f"loopback round trip: {len(ROW_BYTES)} layer groups x {BLOCKS} scattered blocks")
    for mode in TransferMode:
        transfer(mode)
        transfer(mode, fail_after=17)


if __name__ == "__main__":
    main()
