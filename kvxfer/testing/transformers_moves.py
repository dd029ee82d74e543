"""In-process steps the transformers adapter's tests share: prefill prompts to their first
tokens in one engine, step one until its requests are done, and move one lease's rows into
another over a loopback wire."""

from __future__ import annotations

from typing import Any

from kvxfer.adapters.transformers import TransformersEngine
from kvxfer.backends.loopback import LoopbackBackend
from kvxfer.lender.external import ExternalLease


def prefill_all(engine: TransformersEngine, prompts: list[list[int]]) -> dict[str, int]:
    """Prefill ``prompts`` as requests ``r0``, ``r1``, ... and step until each has its first
    token: request -> first token."""
    for i, p in enumerate(prompts):
        engine.prefill(f"r{i}", p)
    while len(engine.prefilled) < len(prompts):
        engine.step()
    return {r: d.first for r, d in engine.prefilled.items()}


def decode_all(engine: TransformersEngine, count: int) -> dict[str, list[int]]:
    """Step ``engine`` until ``count`` requests have finished: request -> its tokens."""
    got: dict[str, list[int]] = {}
    while len(got) < count:
        engine.step()
        got.update(engine.results())
    return got


def move(wire: tuple[LoopbackBackend, LoopbackBackend], read: ExternalLease, write: ExternalLease) -> Any:
    """One transfer from ``read`` (at ``wire[0]``) into ``write`` (at ``wire[1]``), both leases
    tracked, what arrived marked, both released: the fetch's outcome."""
    src, dst = wire
    hint_d, hint_p = dst.describe(write.view(), src.peer), src.describe(read.view(), dst.peer)
    fetch = dst.fetch(write.view(), hint_p)
    publish = src.publish(read.view(), hint_d)
    read.track(publish)
    write.track(fetch)
    assert fetch.wait(10) and publish.wait(10)
    outcome = fetch.poll()
    write.mark_arrived(outcome.masks)
    read.release()
    write.release()
    return outcome
