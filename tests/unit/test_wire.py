"""kvxfer.wire: round trips, authentication, limits and the refusal of each malformed field."""

from __future__ import annotations

import dataclasses
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import msgpack
import numpy as np
import pytest

from kvxfer.contract import (
    CacheKind,
    CompletionRecord,
    Hint,
    HintGroup,
    MemoryKind,
    RecordStatus,
    TransferMode,
    constant_mask,
)
from kvxfer.wire import (
    DEFAULT_LIMITS,
    WIRE_VERSION,
    Limits,
    WireError,
    decode_blob,
    decode_completion,
    decode_hint,
    encode_blob,
    encode_completion,
    encode_hint,
    hint_key_from_env,
)
from kvxfer.wire.auth import mac

KEY = bytes(range(32))
OTHER_KEY = bytes(range(1, 33))


@pytest.fixture(autouse=True)
def _no_env_key(monkeypatch: pytest.MonkeyPatch) -> None:
    # key=None reads KVXFER_HINT_KEY: keep the caller's environment out of these tests.
    monkeypatch.delenv("KVXFER_HINT_KEY", raising=False)


def make_group(name: str = "full", rows: int = 5, region_slots: int = 64, **kw: Any) -> HintGroup:
    slots = np.arange(rows, dtype=np.int64)[::-1] * 3 % region_slots
    fields: dict[str, Any] = dict(
        layer_group=name, kind=CacheKind.PAGED, region=f"{name}-region", address=0x7F00_0000_1000,
        slot_bytes=65536, region_slots=region_slots, memory_kind=MemoryKind.DEVICE, device_id=1,
        slots=slots, ordinals=np.arange(rows, dtype=np.int64) + 10,
    )
    fields.update(kw)
    return HintGroup(**fields)


def make_hint(**kw: Any) -> Hint:
    fields: dict[str, Any] = dict(
        backend="nixl", mode=TransferMode.PULL, agent="prefill-0", request="req-1", transfer_id="t" * 24,
        layout=bytes(range(256)), groups=(make_group("full"), make_group("swa", rows=3, kind=CacheKind.STATE)),
        endpoint=b"\x00agent-metadata\xff", extras=(("etcd", b"http://x:2379"), ("z", b"")),
    )
    fields.update(kw)
    return Hint(**fields)


def make_record(status: RecordStatus = RecordStatus.FAILED, sizes: tuple[int, ...] = (0, 1, 7, 8, 9, 1000)) -> CompletionRecord:
    rng = np.random.default_rng(7)
    masks = [rng.random(n) < 0.5 for n in sizes]
    return CompletionRecord("tid-1", "prefill-0", "req-1", status, masks, reason="peer vanished")


def raw_message(body: Any, msg_type: str = "hint", version: Any = WIRE_VERSION, key: bytes | None = None,
                envelope: dict[str, Any] | None = None) -> bytes:
    """A hand-built message: lets a test put anything at all in a field."""
    body_bytes = body if isinstance(body, bytes) else msgpack.packb(body, use_bin_type=True)
    env: dict[str, Any] = {"kvxfer": version, "type": msg_type, "body": body_bytes}
    if key is not None:
        env["mac"] = mac(key, WIRE_VERSION, msg_type, body_bytes)
    env.update(envelope or {})
    return msgpack.packb(env, use_bin_type=True)


def body_of(data: bytes) -> dict[str, Any]:
    return msgpack.unpackb(msgpack.unpackb(data)["body"])


def refused(data: Any, match: str, decode: Any = decode_hint, **kw: Any) -> str:
    with pytest.raises(WireError, match=match) as info:
        decode(data, **kw)
    return str(info.value)


# --- round trips ---------------------------------------------------------------------------


def test_hint_round_trip_is_equal_and_keeps_bytes_exact() -> None:
    hint = make_hint()
    back = decode_hint(encode_hint(hint))
    assert back == hint
    assert back.mac is None
    assert back.layout == bytes(range(256))  # every byte value survives
    assert back.endpoint == b"\x00agent-metadata\xff"
    assert back.extras == (("etcd", b"http://x:2379"), ("z", b""))
    for got, want in zip(back.groups, hint.groups):
        assert got.slots.dtype == np.int64 and not got.slots.flags.writeable
        np.testing.assert_array_equal(got.slots, want.slots)
        np.testing.assert_array_equal(got.ordinals, want.ordinals)


def test_extreme_values_survive() -> None:
    top = np.iinfo(np.int64)
    # The largest region the contract admits: it ends exactly at 2**64.
    group = make_group(rows=4, region_slots=2**62, address=2**64 - 2**63, slot_bytes=2, device_id=2**32,
                       slots=[0, 2**62 - 1, 5, 5], ordinals=[top.min, top.max, -1, 0])
    hint = make_hint(groups=(group,), endpoint=b"", extras=(), layout=b"")
    back = decode_hint(encode_hint(hint))
    assert back == hint
    assert back.groups[0].ordinals.tolist() == [top.min, top.max, -1, 0]


def test_arrays_travel_as_little_endian_int64() -> None:
    body = body_of(encode_hint(make_hint(groups=(make_group(rows=2, region_slots=1000, slots=[1, 258], ordinals=[-2, 3]),))))
    assert body["groups"][0]["slots"] == (1).to_bytes(8, "little") + (258).to_bytes(8, "little")
    assert body["groups"][0]["ordinals"] == (-2).to_bytes(8, "little", signed=True) + (3).to_bytes(8, "little")


def test_empty_hint_and_empty_group_round_trip() -> None:
    for hint in (make_hint(groups=()), make_hint(groups=(make_group(rows=0),))):
        assert decode_hint(encode_hint(hint)) == hint


def test_bytes_like_input_is_accepted() -> None:
    data = encode_hint(make_hint())
    assert decode_hint(bytearray(data)) == decode_hint(memoryview(data)) == make_hint()
    padded = np.frombuffer(data + bytes(8 - len(data) % 8), dtype=np.int64)  # a buffer of 8-byte items
    with pytest.raises(WireError, match="not valid msgpack"):  # trailing zero bytes, but no BufferError
        decode_hint(padded.data)
    with pytest.raises(WireError, match="strided memoryview"):
        decode_hint(memoryview(data)[::2])


def test_completion_round_trip_keeps_masks_exact() -> None:
    for status in RecordStatus:
        record = make_record(status)
        back = decode_completion(encode_completion(record))
        assert (back.transfer_id, back.sender, back.request, back.status, back.reason) == (
            "tid-1", "prefill-0", "req-1", status, "peer vanished")
        assert len(back.masks) == len(record.masks)
        for got, want in zip(back.masks, record.masks):
            assert got.dtype == np.bool_ and not got.flags.writeable
            np.testing.assert_array_equal(got, want)


def test_masks_travel_as_packed_bits_least_significant_first() -> None:
    record = CompletionRecord("t", "s", "r", RecordStatus.DELIVERED, [np.array([1, 0, 0, 0, 0, 0, 0, 0, 0, 1], bool)])
    assert body_of(encode_completion(record))["masks"] == [{"rows": 10, "bits": b"\x01\x02"}]


def test_whole_masks_are_shared_read_only_and_travel_as_the_same_bits() -> None:
    for rows in (1, 8, 13, 32, 4096, 1 << 18):
        shared = constant_mask(rows, True)
        assert shared is constant_mask(rows, True)
        assert not shared.flags.writeable
        with pytest.raises(ValueError):
            shared.flags.writeable = True  # a view of a read-only base: it stays read-only
        plain = np.ones(rows, dtype=np.bool_)
        # Recognised by identity when encoded, by its bits when decoded: the same bytes either way.
        assert encode_completion(CompletionRecord("t", "s", "r", RecordStatus.DELIVERED, [shared])) == \
            encode_completion(CompletionRecord("t", "s", "r", RecordStatus.DELIVERED, [plain]))
        back = decode_completion(encode_completion(CompletionRecord("t", "s", "r", RecordStatus.DELIVERED, [plain])))
        assert back.masks[0] is shared
    # One row short of whole decodes to its own mask, exactly.
    partial = np.ones(13, dtype=np.bool_)
    partial[12] = False
    back = decode_completion(encode_completion(CompletionRecord("t", "s", "r", RecordStatus.DELIVERED, [partial])))
    np.testing.assert_array_equal(back.masks[0], partial)
    assert back.masks[0] is not constant_mask(13, True)
    big = constant_mask((1 << 18) + 1, True)
    assert big.all() and not big.flags.writeable and big is not constant_mask((1 << 18) + 1, True)


def test_records_encoded_from_many_threads_are_exact() -> None:
    # pack() keeps one msgpack Packer per thread: concurrent encoders must not mix their bytes.
    records = [CompletionRecord(f"t{i}", "s", f"r{i}", RecordStatus.DELIVERED, [np.arange(i + 1) % 3 == 0])
               for i in range(64)]
    want = [encode_completion(r) for r in records]

    def encode_all(_: int) -> list[bytes]:
        return [encode_completion(r) for r in records for _ in range(20)][::20]

    with ThreadPoolExecutor(8) as pool:
        for got in pool.map(encode_all, range(16)):
            assert got == want


def test_blob_round_trip_and_kind_check() -> None:
    payload = bytes(range(256)) * 100
    assert decode_blob(encode_blob("nixl-md", payload), "nixl-md") == payload
    assert decode_blob(encode_blob("nixl-md", payload, KEY), "nixl-md", KEY) == payload
    refused(encode_blob("nixl-md", b"x"), "expected a blob of kind 'cancel', got kind 'nixl-md'",
            decode=decode_blob, kind="cancel")


# --- message type and version -----------------------------------------------------------------


def test_a_message_never_decodes_as_another_type() -> None:
    record, hint, blob = encode_completion(make_record()), encode_hint(make_hint()), encode_blob("k", b"")
    refused(record, "expected a hint message, got a completion message")
    refused(hint, "expected a completion message, got a hint message", decode=decode_completion)
    refused(blob, "expected a hint message, got a blob message")
    refused(hint, "expected a blob message, got a hint message", decode=decode_blob, kind="k")


def test_type_is_covered_by_the_mac() -> None:
    # A signed completion body relabelled as a hint must fail the MAC, not reach the parser.
    body = msgpack.unpackb(encode_completion(make_record(), KEY))
    relabelled = msgpack.packb({**body, "type": "hint"}, use_bin_type=True)
    refused(relabelled, "wrong MAC", key=KEY)


@pytest.mark.parametrize("version", [0, 2, 255])
def test_wrong_version_is_refused_naming_it(version: int) -> None:
    message = refused(raw_message(body_of(encode_hint(make_hint())), version=version), f"wire version {version}")
    assert f"version {WIRE_VERSION}" in message


def test_not_a_kvxfer_message() -> None:
    refused(msgpack.packb({"type": "hint"}), "not a kvxfer wire message")
    refused(msgpack.packb([1, "hint", b""]), "not a kvxfer wire message")
    refused(msgpack.packb({"kvxfer": "1", "type": "hint", "body": b""}), "wire version str")
    refused(raw_message({}, msg_type="gossip"), "field type must be one of")
    refused(raw_message({}, envelope={"extra": 1}), "unknown field.*'extra'")


# --- authentication ----------------------------------------------------------------------------


def test_signed_round_trip_and_re_encoding_is_stable() -> None:
    hint = make_hint()
    data = encode_hint(hint, KEY)
    back = decode_hint(data, KEY)
    assert back.mac is not None and len(back.mac) == 32
    assert dataclasses.replace(back, mac=None) == hint
    assert encode_hint(back, KEY) == data  # the MAC is recomputed, and deterministic
    assert decode_completion(encode_completion(make_record(), KEY), KEY).masks[5].tolist() == make_record().masks[5].tolist()


def test_wrong_key_is_refused() -> None:
    refused(encode_hint(make_hint(), KEY), "hint message has a wrong MAC", key=OTHER_KEY)
    refused(encode_completion(make_record(), KEY), "completion message has a wrong MAC",
            decode=decode_completion, key=OTHER_KEY)
    refused(encode_blob("nixl-md", b"x", KEY), "wrong MAC", decode=decode_blob, kind="nixl-md", key=OTHER_KEY)


def test_unsigned_refused_when_a_key_is_set_and_signed_refused_without_one() -> None:
    refused(encode_hint(make_hint()), "unsigned but a key is configured", key=KEY)
    refused(encode_hint(make_hint(), KEY), "signed but no key is configured", key=b"")


def test_altered_body_or_mac_is_refused() -> None:
    data = encode_hint(make_hint(), KEY)
    body = msgpack.unpackb(data)
    tampered = bytearray(body["body"])
    tampered[-1] ^= 1
    refused(msgpack.packb({**body, "body": bytes(tampered)}), "wrong MAC", key=KEY)
    refused(msgpack.packb({**body, "mac": body["mac"][:31]}), "wrong MAC", key=KEY)
    refused(msgpack.packb({**body, "mac": "x" * 32}), "field mac must be bin", key=KEY)


def test_env_key_is_hex_and_used_when_key_is_none(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVXFER_HINT_KEY", f"  {KEY.hex()}\n")
    assert hint_key_from_env() == KEY
    data = encode_hint(make_hint())  # key=None: signed with the environment's key
    assert decode_hint(data, KEY).mac is not None
    assert decode_hint(data).mac is not None
    refused(encode_hint(make_hint(), b""), "unsigned but a key is configured")  # b"" forced no key at the sender
    assert decode_hint(encode_hint(make_hint(), b""), b"") == make_hint()  # and b"" forces none here too
    refused(data, "wrong MAC", key=OTHER_KEY)  # an explicit key beats the environment


@pytest.mark.parametrize("value, match", [("not-hex-at-all!", "KVXFER_HINT_KEY must be the key in hex"),
                                          ("abcd", "KVXFER_HINT_KEY holds a 2-byte key")])
def test_bad_env_key_is_refused_by_name(monkeypatch: pytest.MonkeyPatch, value: str, match: str) -> None:
    monkeypatch.setenv("KVXFER_HINT_KEY", value)
    with pytest.raises(WireError, match=match):
        hint_key_from_env()
    with pytest.raises(WireError, match=match):
        encode_hint(make_hint())
    with pytest.raises(WireError, match=match):
        decode_hint(b"anything")


def test_empty_env_key_means_no_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVXFER_HINT_KEY", "  ")
    assert hint_key_from_env() is None
    assert decode_hint(encode_hint(make_hint())) == make_hint()


def test_short_or_mistyped_explicit_key_is_refused() -> None:
    with pytest.raises(WireError, match="key is 5 bytes; at least 16"):
        encode_hint(make_hint(), b"short")
    with pytest.raises(WireError, match="key must be bytes or None, got str"):
        decode_hint(encode_hint(make_hint()), "x" * 32)  # type: ignore[arg-type]


# --- limits ------------------------------------------------------------------------------------


def test_whole_message_limit_is_checked_before_parsing() -> None:
    small = Limits(message_bytes=1000)
    data = encode_hint(make_hint(groups=(make_group(rows=100),)))
    refused(data, f"message is {len(data)} bytes, the limit is 1000", limits=small)
    with pytest.raises(WireError, match="the limit is 1000"):
        encode_hint(make_hint(groups=(make_group(rows=100),)), limits=small)


def test_endpoint_may_carry_4_mib_but_not_more() -> None:
    md = bytes(4 << 20)
    assert decode_hint(encode_hint(make_hint(endpoint=md))).endpoint == md
    with pytest.raises(WireError, match="field endpoint is 4194305 bytes, the limit is 4194304"):
        encode_hint(make_hint(endpoint=md + b"x"))
    roomy = Limits(endpoint_bytes=8 << 20)
    refused(encode_hint(make_hint(endpoint=md + b"x"), limits=roomy), "field endpoint is 4194305 bytes")


def test_row_group_string_and_extra_limits() -> None:
    tight = Limits(rows=10, groups=2, string_bytes=30, extras=1, extra_bytes=4, layout_bytes=8)
    cases = [
        (make_hint(groups=(make_group(rows=11),), extras=(), layout=b""), "11 rows, the limit is 10"),
        (make_hint(groups=tuple(make_group(f"g{i}") for i in range(3)), extras=(), layout=b""), "limit is 2"),
        (make_hint(request="r" * 31, groups=(), extras=(), layout=b""), "field request"),
        (make_hint(request="é" * 16, groups=(), extras=(), layout=b""), "field request"),  # 32 UTF-8 bytes
        (make_hint(groups=(), extras=(("a", b""), ("b", b"")), layout=b""), "2 extras|field extras has 2 items"),
        (make_hint(groups=(), extras=(("a", b"12345"),), layout=b""), "extra 'a' is 5 bytes"),
        (make_hint(groups=(), extras=(), layout=b"123456789"), "field layout is 9 bytes"),
    ]
    for hint, match in cases:
        with pytest.raises(WireError, match=match):
            encode_hint(hint, limits=tight)  # the sender names it ...
        refused(encode_hint(hint), match, limits=tight)  # ... and so does a receiver with tighter limits
    record = make_record(sizes=(11,))
    with pytest.raises(WireError, match="mask 0 has 11 rows"):
        encode_completion(record, limits=tight)
    refused(encode_completion(record), "11 rows, the limit is 10", decode=decode_completion, limits=tight)
    with pytest.raises(WireError, match="payload is 5 bytes"):
        encode_blob("k", b"12345", limits=Limits(blob_bytes=4))
    refused(encode_blob("k", b"12345"), "payload", decode=decode_blob, kind="k", limits=Limits(blob_bytes=4))


def test_default_limits_hold_the_documented_values() -> None:
    assert DEFAULT_LIMITS.endpoint_bytes == 4 << 20
    assert DEFAULT_LIMITS.rows >= 1 << 20
    with pytest.raises(ValueError, match="Limits.rows"):
        Limits(rows=0)


# --- malformed fields --------------------------------------------------------------------------


def _hint_body() -> dict[str, Any]:
    return body_of(encode_hint(make_hint()))


def _with(path: tuple[Any, ...], value: Any) -> dict[str, Any]:
    body = _hint_body()
    target = body
    for step in path[:-1]:
        target = target[step]
    if value is _DELETE:
        del target[path[-1]]
    else:
        target[path[-1]] = value
    return body


_DELETE = object()


@pytest.mark.parametrize("path, value, match", [
    (("agent",), _DELETE, "hint: missing field.*agent"),
    (("agent",), "", "hint: field agent must not be empty"),
    (("agent",), b"bytes", "hint: field agent must be str, got bin"),
    (("mode",), "sideways", r"hint: field mode must be one of \['push', 'pull'\], got 'sideways'"),
    (("mode",), 1, "hint: field mode must be one of .*got int"),
    (("layout",), "text", "hint: field layout must be bin, got str"),
    (("extras",), {"a": b""}, "hint: field extras must be an array, got map"),
    (("extras",), [["a", b""], ["a", b""]], "extra 'a' appears twice"),
    (("extras",), [["a", "not-bin"]], r"extras item 0 must be a \[str, bin\] pair"),
    (("extras",), [["", b""]], "extras item 0 key must not be empty"),
    (("groups",), [1], "hint group 0: expected a map, got int"),
    (("groups", 0, "slot_bytes"), True, r"hint group 0 \('full'\): field slot_bytes must be a non-negative int, got bool"),
    (("groups", 0, "address"), -1, r"field address must be a non-negative int, got int"),
    (("groups", 0, "address"), 1.5, r"field address must be a non-negative int, got float"),
    (("groups", 0, "slot_bytes"), 0, r"hint group 0 \('full'\): HintGroup 'full': bad region geometry"),
    (("groups", 0, "kind"), "PAGED", r"field kind must be one of \['paged', 'state'\]"),
    (("groups", 0, "memory_kind"), None, r"field memory_kind must be one of .*got nil"),
    (("groups", 0, "slots"), b"1234567", r"field slots: 7 bytes is not a whole number of int64"),
    (("groups", 0, "slots"), (99).to_bytes(8, "little") * 5, r"hint group 0 \('full'\): .*slot outside \[0, 64\)"),
    (("groups", 0, "ordinals"), b"", r"hint group 0 \('full'\): .*5 slots but 0 ordinals"),
    (("groups", 1, "layer_group"), "full", "hint: Hint names a layer group twice"),
    (("groups", 0, "spare"), 1, r"hint group 0 \('full'\): unknown field.*'spare'"),
    (("groups", 0, "region"), _DELETE, r"hint group 0 \('full'\): missing field.*region"),
    (("surprise",), 1, "hint: unknown field.*'surprise'"),
])
def test_each_malformed_hint_field_is_named(path: tuple[Any, ...], value: Any, match: str) -> None:
    refused(raw_message(_with(path, value)), match)
    refused(raw_message(_with(path, value), key=KEY), match, key=KEY)  # a valid MAC does not make it valid


def test_body_level_malformations() -> None:
    refused(raw_message([1, 2]), "hint: expected a map, got array")
    refused(raw_message(b"\x81\x01\x02"), "not valid msgpack")  # int map key
    refused(raw_message(msgpack.packb(_hint_body()) + b"\x00"), "hint body is not valid msgpack")  # trailing byte
    refused(raw_message(b"\xd6\xff\x00\x00\x00\x00"), "hint body is not valid msgpack")  # timestamp ext
    refused(raw_message(b"\xc7\x00\x05"), "hint body is not valid msgpack")  # empty ext
    refused(raw_message(b"\x91" * 5000 + b"\xc0"), "hint body is not valid msgpack")  # nesting too deep
    refused(raw_message(b"\xa2\xff\xfe"), "hint body is not valid msgpack")  # invalid UTF-8
    refused(raw_message(b"\xdd\xff\xff\xff\xff"), "hint body is not valid msgpack")  # array claims 4G items
    refused(raw_message(_hint_body(), envelope={"body": "text"}), "field body must be bin, got str")
    for junk in (b"", b"\xc1", b"\xff" * 3, "a str", None, 42):
        with pytest.raises(WireError):
            decode_hint(junk)  # type: ignore[arg-type]


@pytest.mark.parametrize("mask, match", [
    ({"rows": 9, "bits": b"\x00"}, "1 bytes of bits for 9 rows, expected 2"),
    ({"rows": 3, "bits": b"\x08"}, "bits set beyond row 3"),
    ({"rows": -1, "bits": b""}, "field rows must be a non-negative int"),
    ({"rows": 1}, "missing field.*bits"),
    ([1, b"\x00"], "completion record mask 0: expected a map, got array"),
])
def test_malformed_masks_are_named(mask: Any, match: str) -> None:
    body = body_of(encode_completion(make_record(sizes=(4,))))
    body["masks"] = [mask]
    refused(raw_message(body, msg_type="completion"), match, decode=decode_completion)


def test_malformed_record_fields_are_named() -> None:
    body = body_of(encode_completion(make_record()))
    refused(raw_message({**body, "status": "done"}, msg_type="completion"),
            r"completion record: field status must be one of \['delivered'", decode=decode_completion)
    refused(raw_message({**body, "sender": ""}, msg_type="completion"), "field sender must not be empty",
            decode=decode_completion)
    refused(raw_message({**body, "reason": 3}, msg_type="completion"), "field reason must be str",
            decode=decode_completion)


def test_encode_refuses_what_decode_would_refuse() -> None:
    with pytest.raises(WireError, match="encode_hint needs a Hint"):
        encode_hint(make_record())  # type: ignore[arg-type]
    with pytest.raises(WireError, match="extra key appears twice"):
        encode_hint(make_hint(extras=(("a", b"1"), ("a", b"2"))))
    with pytest.raises(WireError, match="field region must not be empty"):
        encode_hint(make_hint(groups=(make_group(region=""),)))
    with pytest.raises(ValueError, match="overflows 64 bits"):  # the contract refuses it before the codec
        make_group(address=2**64)
    with pytest.raises(WireError, match="blob kind must be str"):
        encode_blob(b"k", b"")  # type: ignore[arg-type]


# --- large messages (speed is measured by bench/, not asserted here) -------------------------


def test_a_million_row_hint_round_trips() -> None:
    rows = 1_000_000
    group = make_group(rows=rows, region_slots=rows, slots=np.arange(rows)[::-1], ordinals=np.arange(rows))
    hint = make_hint(groups=(group,))
    back = decode_hint(encode_hint(hint, KEY), KEY)
    np.testing.assert_array_equal(back.groups[0].slots, group.slots)
    np.testing.assert_array_equal(back.groups[0].ordinals, group.ordinals)


def _nested(width: int, depth: int) -> bytes:
    """msgpack of arrays ``width`` wide and ``depth`` deep, empty at the leaves: one byte each."""
    out = b"\x90"
    for _ in range(depth):
        out = bytes([0x90 | width]) + out * width
    return out


def test_nested_arrays_are_refused_before_they_cost_memory() -> None:
    # 8 wide and 7 deep: 2.4 MiB of one-byte empty arrays, which unbounded would become
    # 2.4 million Python lists (about 170 MB) before any field check, with a key set or not.
    bomb = _nested(8, 7)
    envelope = (b"\x85" + msgpack.packb("kvxfer") + msgpack.packb(WIRE_VERSION) + msgpack.packb("type")
                + msgpack.packb("hint") + msgpack.packb("body") + msgpack.packb(b"{}", use_bin_type=True)
                + msgpack.packb("mac") + msgpack.packb(bytes(32), use_bin_type=True) + msgpack.packb("x") + bomb)
    assert refused(envelope, "more than 1 arrays and maps", key=KEY)
    body = b"\x81" + msgpack.packb("extras") + bomb
    # With the audience pair, and room for a geometry of Limits.groups regions (4 + 256 more).
    assert refused(raw_message(body), "more than 584 arrays and maps")
    record = b"\x81" + msgpack.packb("masks") + bomb  # the body, the masks, one map per mask, the digests
    assert refused(raw_message(record, "completion"), "more than 259 arrays and maps", decode=decode_completion)
    # A real hint at the limits still decodes: 64 extras and 256 groups.
    full = make_hint(extras=tuple((f"x{i}", b"v") for i in range(64)),
                     groups=tuple(make_group(f"g{i}") for i in range(256)))
    assert decode_hint(encode_hint(full)) == full


def test_a_released_buffer_is_refused_by_name() -> None:
    view = memoryview(encode_hint(make_hint()))
    view.release()
    refused(view, "cannot be read as bytes")


def test_ordinals_that_wrap_around_int64_still_count_as_repeated() -> None:
    # 0, 2**56, ..., 2**63 - 2**56, then -2**63 ... up to 0 again: each step is positive
    # modulo 2**64, so a subtraction saw a sorted array; the first and last are both 0.
    ordinals = (np.arange(257, dtype=np.uint64) * np.uint64(1 << 56)).view(np.int64)
    assert ordinals[0] == ordinals[-1] == 0
    with pytest.raises(ValueError, match="repeats an ordinal"):
        make_group(rows=257, region_slots=1000, ordinals=ordinals)


def test_contract_arrays_cannot_be_made_writeable_again() -> None:
    hint = decode_hint(encode_hint(make_hint()))
    for array in (hint.groups[0].slots, hint.groups[0].ordinals, make_group().slots, constant_mask(4, True),
                  constant_mask(1 << 19, False)):
        with pytest.raises(ValueError):
            array.flags.writeable = True
        base = array.base
        while isinstance(base, np.ndarray):
            with pytest.raises(ValueError):
                base.flags.writeable = True
            base = base.base
