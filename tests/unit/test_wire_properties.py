"""Property tests of kvxfer.wire: valid messages round trip; any other bytes raise WireError only."""

from __future__ import annotations

import dataclasses
from typing import Any

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvxfer.contract import CacheKind, CompletionRecord, Hint, HintGroup, MemoryKind, Peer, RecordStatus, TransferMode
from kvxfer.wire import (
    WireError,
    decode_blob,
    decode_completion,
    decode_hint,
    encode_blob,
    encode_completion,
    encode_hint,
)
from kvxfer.wire.auth import mac

FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
INT64 = st.integers(np.iinfo(np.int64).min, np.iinfo(np.int64).max)
names = st.text(min_size=1, max_size=12)
keys = st.one_of(st.just(b""), st.binary(min_size=16, max_size=64))  # b"": explicitly unsigned


@pytest.fixture(autouse=True)
def _no_env_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVXFER_HINT_KEY", raising=False)


@st.composite
def hint_groups(draw: st.DrawFn, name: str) -> HintGroup:
    region_slots = draw(st.integers(1, 2**40))
    rows = draw(st.integers(0, 40))
    slots = draw(st.lists(st.integers(0, region_slots - 1), min_size=rows, max_size=rows))
    ordinals = draw(st.lists(INT64, min_size=rows, max_size=rows, unique=True))
    # A valid region ends at or below 2**64: draw the size first, then an address that fits.
    slot_bytes = draw(st.integers(1, min(2**64 // region_slots, 2**64 - 1)))  # a uint64 on the wire
    address = draw(st.integers(0, 2**64 - slot_bytes * region_slots))
    return HintGroup(
        layer_group=name, kind=draw(st.sampled_from(CacheKind)), region=draw(names),
        address=address, slot_bytes=slot_bytes,
        region_slots=region_slots, memory_kind=draw(st.sampled_from(MemoryKind)),
        device_id=draw(st.integers(0, 2**32)), slots=np.array(slots, dtype=np.int64),
        ordinals=np.array(ordinals, dtype=np.int64),
    )


@st.composite
def hints(draw: st.DrawFn) -> Hint:
    group_names = draw(st.lists(names, max_size=4, unique=True))
    extra_keys = draw(st.lists(names, max_size=4, unique=True))
    return Hint(
        backend=draw(names), mode=draw(st.sampled_from(TransferMode)), agent=draw(names), request=draw(names),
        transfer_id=draw(names), layout=draw(st.binary(max_size=48)),
        groups=tuple(draw(hint_groups(n)) for n in group_names),
        endpoint=draw(st.binary(max_size=64)),
        extras=tuple((k, draw(st.binary(max_size=16))) for k in extra_keys),
        run=draw(st.one_of(st.just(""), names)),
        audience=draw(st.one_of(st.none(), st.builds(Peer, names, names))),
        expires_ms=draw(st.integers(0, 2**63 - 1)),
    )


@st.composite
def records(draw: st.DrawFn) -> CompletionRecord:
    sizes = draw(st.lists(st.integers(0, 70), max_size=4))
    masks = [np.array(draw(st.lists(st.booleans(), min_size=n, max_size=n)), dtype=np.bool_) for n in sizes]
    return CompletionRecord(draw(names), draw(names), draw(names), draw(st.sampled_from(RecordStatus)), masks,
                            reason=draw(st.text(max_size=30)))


def same_record(a: CompletionRecord, b: CompletionRecord) -> bool:
    return (a.transfer_id, a.sender, a.request, a.status, a.reason) == (b.transfer_id, b.sender, b.request, b.status, b.reason) \
        and len(a.masks) == len(b.masks) and all(x.tolist() == y.tolist() for x, y in zip(a.masks, b.masks))


# --- round trips ---------------------------------------------------------------------------


@FAST
@given(hints(), keys)
def test_hint_round_trip(hint: Hint, key: bytes) -> None:
    back = decode_hint(encode_hint(hint, key), key)
    assert (back.mac is not None) == bool(key)
    assert dataclasses.replace(back, mac=None) == hint
    for got, want in zip(back.groups, hint.groups):
        assert got.slots.tobytes() == want.slots.tobytes() and got.ordinals.tobytes() == want.ordinals.tobytes()


@FAST
@given(records(), keys)
def test_completion_round_trip(record: CompletionRecord, key: bytes) -> None:
    back = decode_completion(encode_completion(record, key), key)
    assert same_record(back, record)
    for mask in back.masks:  # real bool arrays, read-only (a view of unpacked bits)
        assert mask.dtype == np.bool_ and not mask.flags.writeable
        assert set(mask.view(np.uint8).tolist()) <= {0, 1}


@FAST
@given(names, st.binary(max_size=200), keys)
def test_blob_round_trip(kind: str, payload: bytes, key: bytes) -> None:
    assert decode_blob(encode_blob(kind, payload, key), kind, key) == payload


# --- nothing but WireError escapes -----------------------------------------------------------


def _decode_blob_k(data: Any, key: bytes) -> bytes:
    return decode_blob(data, "k", key)


def decode_any(data: Any, key: bytes) -> list[Any]:
    """Decode as each message type; every outcome must be a value or a WireError."""
    results: list[Any] = []
    for decode in (decode_hint, decode_completion, _decode_blob_k):
        try:
            results.append(decode(data, key))
        except WireError as exc:
            assert str(exc)  # every refusal says something
            results.append(exc)
    return results


@FAST
@given(st.binary(max_size=300), keys)
def test_random_bytes_only_raise_wire_error(data: bytes, key: bytes) -> None:
    decode_any(data, key)


# Any msgpack value at all, nested: what a hostile peer can put in any field.
msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=8)
    | st.binary(max_size=24),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=12,
)


@st.composite
def mutated_bytes(draw: st.DrawFn, data: bytes) -> bytes:
    buf = bytearray(data)
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["flip", "set", "delete", "insert", "truncate"]))
        at = draw(st.integers(0, max(len(buf) - 1, 0)))
        if op == "flip" and buf:
            buf[at] ^= 1 << draw(st.integers(0, 7))
        elif op == "set" and buf:
            buf[at] = draw(st.integers(0, 255))
        elif op == "delete":
            del buf[at:at + draw(st.integers(1, 9))]
        elif op == "insert":
            buf[at:at] = draw(st.binary(min_size=1, max_size=9))
        else:
            del buf[at:]
    return bytes(buf)


@FAST
@given(st.data(), hints(), records(), keys)
def test_mutated_encodings_only_raise_wire_error(data: st.DataObject, hint: Hint, record: CompletionRecord,
                                                 key: bytes) -> None:
    for original in (encode_hint(hint, key), encode_completion(record, key), encode_blob("k", b"payload", key)):
        mutated = data.draw(mutated_bytes(original))
        outcomes = decode_any(mutated, key)
        if key and mutated != original:
            # Signed: a mutation is refused, or (when it only re-spelled the envelope) yields the original.
            hint_out, record_out, blob_out = outcomes
            assert isinstance(hint_out, WireError) or dataclasses.replace(hint_out, mac=None) == hint
            assert isinstance(record_out, WireError) or same_record(record_out, record)
            assert isinstance(blob_out, WireError) or blob_out == b"payload"


def _sign(body: Any, msg_type: str, key: bytes) -> bytes:
    body_bytes = msgpack.packb(body, use_bin_type=True)
    envelope: dict[str, Any] = {"kvxfer": 1, "type": msg_type, "body": body_bytes}
    if key:
        envelope["mac"] = mac(key, 1, msg_type, body_bytes)
    return msgpack.packb(envelope, use_bin_type=True)


def near_miss(value: Any) -> st.SearchStrategy[Any]:
    """Values of the same msgpack type as ``value``: wrong in size or range, not in kind."""
    if isinstance(value, bool):
        return st.booleans()
    if isinstance(value, int):
        return st.integers(-(2**63), 2**64 - 1) | st.integers(-2, 80)
    if isinstance(value, bytes):
        return st.binary(max_size=40) | st.builds(lambda b, n: b * n, st.binary(min_size=1, max_size=8), st.integers(1, 6))
    if isinstance(value, str):
        return st.text(max_size=8) | st.sampled_from(["push", "pull", "paged", "state", "host", "device", "failed", ""])
    return msgpack_values


@st.composite
def field_edits(draw: st.DrawFn, body: dict[str, Any]) -> dict[str, Any]:
    """The body with 1-3 fields, anywhere in it, given another value (near miss or any
    msgpack value), deleted, or joined by an unknown one."""
    body = msgpack.unpackb(msgpack.packb(body, use_bin_type=True))  # a deep copy
    maps = [body] + [g for g in body.get("groups", []) if isinstance(g, dict)] + list(body.get("masks", []))
    for _ in range(draw(st.integers(1, 3))):
        target = draw(st.sampled_from(maps))
        op = draw(st.sampled_from(["near", "near", "near", "any", "delete", "add"]))
        if op == "add" or not target:
            target[draw(st.text(max_size=8))] = draw(msgpack_values)
            continue
        field = draw(st.sampled_from(sorted(target)))
        if op == "delete":
            del target[field]
        else:
            target[field] = draw(near_miss(target[field]) if op == "near" else msgpack_values)
    return body


@settings(FAST, max_examples=150)
@given(st.data(), hints(), records(), keys)
def test_any_field_value_only_raises_wire_error(data: st.DataObject, hint: Hint, record: CompletionRecord,
                                                key: bytes) -> None:
    # Validly signed, well-formed msgpack, one field wrong: the field checks (not the MAC or
    # the msgpack parser) must refuse it, as a WireError.
    for msg_type, original in (("hint", encode_hint(hint, b"")), ("completion", encode_completion(record, b""))):
        body = msgpack.unpackb(msgpack.unpackb(original)["body"])
        decode_any(_sign(data.draw(field_edits(body)), msg_type, key), key)
