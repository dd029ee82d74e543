"""Experiment 4a: fuzzed wire messages. Real hint bytes (``encode_hint(backend.describe(view))``
of a NixlBackend and of a LoopbackBackend, push and pull, bound to a peer or not, signed or
not) and completion records about those transfers, mutated with a seeded ``random.Random``,
then decoded. The contract: every decode returns a value or raises ``WireError``; any other
exception is a finding. A decoded value must also encode again without any other exception.
"""

from __future__ import annotations

import base64
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np

from kvxfer.backends.nixl import NixlBackend
from kvxfer.contract import (
    CacheKind,
    CompletionRecord,
    LayerGroupRows,
    Peer,
    RecordStatus,
    TokenRange,
    TransferMode,
    View,
)
from kvxfer.testing.memory import HostRows
from kvxfer.testing.nixl_pairs import LOCAL_BUFFERS, host_rows
from kvxfer.testing.pairs import loopback_pair
from kvxfer.testing.reliability.common import Progress
from kvxfer.wire import WireError, decode_completion, decode_hint, encode_completion, encode_hint
from kvxfer.wire.auth import mac

KEY = bytes(range(32))  # signed seeds use this key, and are decoded with it
INT_EDGES = (-(2**63), -1, 0, 1, 7, 8, 2**31, 2**32, 2**63 - 1, 2**63, 2**64 - 1)


@dataclass(frozen=True)
class Seed:
    kind: str   # "hint" | "completion"
    source: str  # which backend made it, how
    data: bytes
    key: bytes  # b"": unsigned


@dataclass(frozen=True)
class DecodeTally:
    cases: int
    decoded_ok: int
    wire_error: int
    other: int                      # any exception but WireError: a finding
    other_types: dict[str, int]
    other_samples: tuple[str, ...]  # exception, mutation and the input's first bytes (base64)
    by_mutation: dict[str, int]


@dataclass(frozen=True)
class WireFuzzSummary:
    seeds: dict[str, int]
    hints: DecodeTally
    completions: DecodeTally


def _views(regions: tuple[Any, ...], request: str, rng: np.random.Generator) -> View:
    groups = []
    for i, region in enumerate(regions):
        n = int(rng.integers(1, min(region.slots, 24)))
        groups.append(LayerGroupRows(f"g{i}", CacheKind.PAGED, region, rng.permutation(region.slots)[:n],
                                     np.arange(n, dtype=np.int64)))
    return View(request, TokenRange(0, 16 * max(len(g) for g in groups)), tuple(groups), b"fuzz-layout")


def _records(hint_bytes: bytes, key: bytes, rng: np.random.Generator) -> list[bytes]:
    """Completion records about the transfer a hint describes, one per status."""
    hint = decode_hint(hint_bytes, key)
    out = []
    for status in RecordStatus:
        masks = [] if status is RecordStatus.CANCEL_REQUEST else [rng.random(len(g)) < 0.7 for g in hint.groups]
        reason = "" if status is RecordStatus.DELIVERED else f"peer {hint.agent!r} disconnected"
        out.append(encode_completion(CompletionRecord(hint.transfer_id, hint.agent, hint.request, status, masks,
                                                      reason), key))
    return out


def real_seeds(seed: int = 0) -> list[Seed]:
    rng = np.random.default_rng(seed)
    audience = Peer("kvxfer-fuzz-peer", "run-0123456789")
    hints: list[tuple[str, bytes, bytes]] = []
    for mode in TransferMode:
        memory: HostRows = host_rows(LOCAL_BUFFERS)
        backend = NixlBackend(mode=mode)
        try:
            backend.register(memory.regions)
            for bound in (None, audience):
                for key in (b"", KEY):
                    hint = backend.describe(_views(memory.regions, f"req-nixl-{mode.value}", rng), bound)
                    hints.append((f"nixl-{mode.value}-{'bound' if bound else 'open'}", encode_hint(hint, key), key))
        finally:
            backend.shutdown()
        pair = loopback_pair(mode)
        try:
            for bound in (None, audience):
                for key in (b"", KEY):
                    hint = pair.local.describe(_views(pair.local_regions, f"req-loop-{mode.value}", rng), bound)
                    hints.append((f"loopback-{mode.value}-{'bound' if bound else 'open'}", encode_hint(hint, key),
                                  key))
        finally:
            pair.close()
    seeds = [Seed("hint", name, data, key) for name, data, key in hints]
    for name, data, key in hints:
        seeds += [Seed("completion", f"record-of-{name}", r, key) for r in _records(data, key, rng)]
    return seeds


# --- values and mutations -----------------------------------------------------------------

def any_value(r: random.Random, depth: int = 0) -> Any:
    """Any msgpack value, nested a little: what a hostile peer can put in a field."""
    pick = r.randrange(10 if depth < 3 else 7)
    if pick == 0:
        return None
    if pick == 1:
        return r.random() < 0.5
    if pick == 2:
        return r.choice(INT_EDGES) if r.random() < 0.5 else r.randint(-(2**63), 2**64 - 1)
    if pick == 3:
        return r.choice([0.0, -0.0, 1.5, float("nan"), float("inf"), -float("inf"), 1e308])
    if pick == 4:
        return "".join(chr(r.choice([r.randrange(32, 127), r.randrange(0x80, 0xD7FF)])) for _ in range(r.randrange(9)))
    if pick == 5:
        return r.choice(["push", "pull", "paged", "state", "host", "device", "delivered", "failed", "", "x" * 5000])
    if pick == 6:
        return r.randbytes(r.choice([0, 1, 7, 8, 9, 16, 33]))
    if pick in (7, 8):
        return [any_value(r, depth + 1) for _ in range(r.randrange(4))]
    keys = [r.choice(["", "slots", "rows", "bits", "x" * r.randrange(1, 9)]) for _ in range(r.randrange(4))]
    return {k: any_value(r, depth + 1) for k in keys}


def near_miss(r: random.Random, value: Any) -> Any:
    """A value of the same msgpack type, wrong in size or range."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):  # msgpack carries [-2**63, 2**64): nothing outside can be sent
        return min(max(r.choice(INT_EDGES + (value + 1, value - 1, value * 2**20)), -(2**63)), 2**64 - 1)
    if isinstance(value, bytes):
        return r.choice([b"", value[:-1], value + b"\x00", value * 3, r.randbytes(len(value) + r.randrange(-3, 4)
                                                                                  if len(value) > 3 else 3)])
    if isinstance(value, str):
        return r.choice(["", value + "x", value[:1], "é" * 1500, "\u0000", value.upper()])
    if isinstance(value, list):
        return r.choice([[], value + value, value[:1], [value], list(reversed(value))])
    return any_value(r)


def _reseal(msg_type: str, body: Any, key: bytes) -> bytes:
    """A well-formed envelope around ``body``, validly signed when ``key``: what reaches the
    field checks rather than the MAC check."""
    body_bytes = msgpack.packb(body, use_bin_type=True)
    envelope: dict[str, Any] = {"kvxfer": 1, "type": msg_type, "body": body_bytes}
    if key:
        envelope["mac"] = mac(key, 1, msg_type, body_bytes)
    return msgpack.packb(envelope, use_bin_type=True)


def _maps(body: Any) -> list[Any]:
    """Every map and array of a decoded body, where a field edit can land."""
    out, todo = [], [body]
    while todo:
        node = todo.pop()
        if isinstance(node, (dict, list)):
            out.append(node)
            todo.extend(node.values() if isinstance(node, dict) else node)
    return out


def _edit_fields(r: random.Random, seed: Seed, others: list[Seed]) -> bytes:
    body = msgpack.unpackb(msgpack.unpackb(seed.data, raw=False)["body"], raw=False)
    for _ in range(r.randint(1, 3)):
        target = r.choice(_maps(body))
        if isinstance(target, list):
            if target and r.random() < 0.7:
                i = r.randrange(len(target))
                target[i] = near_miss(r, target[i]) if r.random() < 0.6 else any_value(r)
            else:
                target.append(any_value(r))
            continue
        op = r.choice(["near", "near", "near", "any", "delete", "add", "bool-for-int"])
        if op == "add" or not target:
            target[r.choice(["extra", "mac", "groups", "x" * r.randrange(1, 5)])] = any_value(r)
            continue
        name = r.choice(sorted(target))
        if op == "delete":
            del target[name]
        elif op == "bool-for-int":
            target[name] = True
        else:
            target[name] = near_miss(r, target[name]) if op == "near" else any_value(r)
    return _reseal(seed.kind, body, seed.key)


def _edit_envelope(r: random.Random, seed: Seed, others: list[Seed]) -> bytes:
    outer = msgpack.unpackb(seed.data, raw=False)
    field = r.choice(["kvxfer", "type", "body", "mac", "extra"])
    outer[field] = r.choice([any_value(r), 2, "blob", "completion" if seed.kind == "hint" else "hint",
                             r.randbytes(32)])
    return msgpack.packb(outer, use_bin_type=True)


def _nest(r: random.Random, seed: Seed, others: list[Seed]) -> bytes:
    """A field holding arrays nested far deeper than any real message."""
    depth = r.choice([64, 1000, 100_000])
    body = msgpack.unpackb(msgpack.unpackb(seed.data, raw=False)["body"], raw=False)
    deep = b"\x91" * depth + b"\xc0"  # fixarray(1) ... nil, spliced in as raw msgpack
    name = r.choice(sorted(body))
    marker = b"\xa5" + b"NESTD"
    body[name] = "NESTD"
    raw = msgpack.packb(body, use_bin_type=True).replace(marker, deep, 1)
    envelope: dict[str, Any] = {"kvxfer": 1, "type": seed.kind, "body": raw}
    if seed.key:  # signed, so that the body parser (not the MAC check) meets the nesting
        envelope["mac"] = mac(seed.key, 1, seed.kind, raw)
    return msgpack.packb(envelope, use_bin_type=True)


def _bytes_edit(op: str) -> Callable[[random.Random, Seed, list[Seed]], bytes]:
    def edit(r: random.Random, seed: Seed, others: list[Seed]) -> bytes:
        buf = bytearray(seed.data)
        for _ in range(r.randint(1, 4)):
            at = r.randrange(max(len(buf), 1))
            if op == "flip" and buf:
                buf[at] ^= 1 << r.randrange(8)
            elif op == "set" and buf:
                buf[at] = r.randrange(256)
            elif op == "truncate":
                del buf[at:]
            elif op == "delete":
                del buf[at:at + r.randint(1, 16)]
            elif op == "insert":
                buf[at:at] = r.randbytes(r.randint(1, 16))
            elif op == "splice":  # a piece of another real message in place of a piece of this one
                other = r.choice(others).data
                a = r.randrange(len(other))
                buf[at:at + r.randint(0, 64)] = other[a:a + r.randint(1, 64)]
        return bytes(buf)
    return edit


def _random_bytes(r: random.Random, seed: Seed, others: list[Seed]) -> bytes:
    return r.randbytes(r.choice([0, 1, 2, 5, 16, 100, 1000]))


MUTATIONS: dict[str, Callable[[random.Random, Seed, list[Seed]], bytes]] = {
    **{op: _bytes_edit(op) for op in ("flip", "set", "truncate", "delete", "insert", "splice")},
    "fields": _edit_fields, "envelope": _edit_envelope, "nesting": _nest, "random": _random_bytes,
}
WEIGHTS = {"flip": 3, "set": 2, "truncate": 1, "delete": 1, "insert": 1, "splice": 2, "fields": 6, "envelope": 1,
           "nesting": 1, "random": 1}


def _tally(kind: str, seeds: list[Seed], cases: int, r: random.Random, shown: Progress) -> DecodeTally:
    decode: Callable[[bytes, bytes], Any] = decode_hint if kind == "hint" else decode_completion
    encode: Callable[[Any, bytes], bytes] = encode_hint if kind == "hint" else encode_completion
    mine = [s for s in seeds if s.kind == kind]
    names, weights = list(WEIGHTS), list(WEIGHTS.values())
    ok = wire = 0
    other_types: dict[str, int] = {}
    samples: list[str] = []
    by_mutation: dict[str, int] = {}
    for i in range(cases):
        seed = r.choice(mine)
        how = r.choices(names, weights)[0]
        by_mutation[how] = by_mutation.get(how, 0) + 1
        data = MUTATIONS[how](r, seed, seeds)
        step = "decode"
        try:
            value = decode(data, seed.key)
            step = "encode again"
            encode(value, seed.key)
            ok += 1
        except WireError:
            if step == "decode":
                wire += 1
            else:
                ok += 1  # decoded; refusing to re-encode it is the codec's documented answer
        except Exception as exc:  # the finding this experiment looks for
            name = f"{type(exc).__name__} ({step})"
            other_types[name] = other_types.get(name, 0) + 1
            if len(samples) < 10:
                samples.append(f"{name}: {str(exc)[:160]} | {how} of {seed.source} | "
                               f"{base64.b64encode(data[:120]).decode()}")
        shown.tick(i + 1, f"{kind}s")
    return DecodeTally(cases, ok, wire, sum(other_types.values()), other_types, tuple(samples), by_mutation)


def run_wire_fuzz(hint_cases: int, completion_cases: int, *, seed: int = 0, progress: bool = True) -> WireFuzzSummary:
    seeds = real_seeds(seed)
    r = random.Random(seed)
    shown = Progress("fuzz (wire)", hint_cases + completion_cases, enabled=progress)
    hints = _tally("hint", seeds, hint_cases, r, shown)
    completions = _tally("completion", seeds, completion_cases, r, shown)
    counts: dict[str, int] = {}
    for s in seeds:
        counts[s.kind] = counts.get(s.kind, 0) + 1
    shown.finish(f"{hints.other + completions.other} exceptions other than WireError")
    return WireFuzzSummary(counts, hints, completions)
