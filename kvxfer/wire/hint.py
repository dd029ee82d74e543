"""Hints on the wire: ``encode_hint`` / ``decode_hint``.

Body (a msgpack map, str keys, every key required)::

    backend, agent, request, transfer_id: str (non-empty)    mode: "push" | "pull"
    layout: bin    endpoint: bin (up to 4 MiB: may be a NIXL agent's metadata)
    extras: array of [key: str (non-empty), value: bin] pairs, keys unique, order kept
    run: str (may be empty)    audience: nil | [agent: str, run: str] (both non-empty)
    expires_ms: uint (wall clock, ms since the epoch; 0 = none, which backends refuse)
    groups: array of maps {layer_group, region: str (non-empty); kind: "paged" | "state";
            memory_kind: "host" | "device"; address, slot_bytes, region_slots,
            device_id: uint; slots, ordinals: bin (little-endian int64, one per row)}
    geometry (optional, present when the hint describes an engine's own KV): see
            ``kvxfer.wire.geometry``

``Hint.mac`` is not sent as a field: the envelope's MAC covers the body. A decoded hint
carries the MAC it was verified with (None for an unsigned message), and ``encode_hint``
ignores the ``mac`` it is given and signs afresh, so re-encoding a decoded hint with the
same key reproduces it exactly.
"""

from __future__ import annotations

from typing import Any

from kvxfer.contract import CacheKind, Hint, HintGroup, MemoryKind, Peer, TokenRange, TransferMode
from kvxfer.wire.arrays import int64_from_bytes, int64_to_bytes
from kvxfer.wire.envelope import Buffer, open_message, seal
from kvxfer.wire.errors import WireError
from kvxfer.wire.fields import Fields, check_str, describe
from kvxfer.wire.geometry import decode_geometry, encode_geometry
from kvxfer.wire.limits import DEFAULT_LIMITS, Limits

_HINT_KEYS = frozenset({"backend", "mode", "agent", "request", "transfer_id", "layout", "endpoint", "extras", "groups",
                        "run", "audience", "expires_ms"})
_GROUP_KEYS = frozenset({
    "layer_group", "kind", "region", "address", "slot_bytes", "region_slots", "memory_kind", "device_id",
    "slots", "ordinals",
})
_MAP_FIELDS = 16  # more entries than any map of the body has


def encode_hint(hint: Hint, key: bytes | None = None, *, limits: Limits = DEFAULT_LIMITS) -> bytes:
    """The wire bytes of ``hint``; signed with ``key`` (see ``kvxfer.wire.auth`` for None and b"")."""
    if not isinstance(hint, Hint):
        raise WireError(f"encode_hint needs a Hint, got {type(hint).__name__}")
    _check_sizes(hint, limits)
    body = {
        "backend": hint.backend, "mode": hint.mode.value, "agent": hint.agent, "request": hint.request,
        "transfer_id": hint.transfer_id, "layout": hint.layout, "endpoint": hint.endpoint,
        "extras": [[k, v] for k, v in hint.extras],
        "run": hint.run, "expires_ms": hint.expires_ms,
        "audience": None if hint.audience is None else [hint.audience.agent, hint.audience.run],
        "groups": [
            {
                "layer_group": g.layer_group, "kind": g.kind.value, "region": g.region, "address": g.address,
                "slot_bytes": g.slot_bytes, "region_slots": g.region_slots, "memory_kind": g.memory_kind.value,
                "device_id": g.device_id, "slots": int64_to_bytes(g.slots), "ordinals": int64_to_bytes(g.ordinals),
            }
            for g in hint.groups
        ],
    }
    if hint.geometry is not None:
        body["geometry"] = encode_geometry(hint.geometry, hint.tokens or TokenRange(0, 0), limits)
    return seal("hint", body, key, limits)


def decode_hint(data: Buffer, key: bytes | None = None, *, limits: Limits = DEFAULT_LIMITS) -> Hint:
    """The Hint in ``data``; WireError for anything malformed, oversized, of another version
    or type, unsigned while a key applies, or wrongly signed."""
    items = max(limits.groups, limits.extras, _MAP_FIELDS)
    # The body map, the extras array and one pair per extra, the groups array and one map per
    # group, the audience pair; the geometry's map, its two pairs, its regions array and one
    # array per region.
    containers = 4 + limits.extras + limits.groups + 4 + limits.groups
    body, mac = open_message(data, "hint", key, limits, max_items=items, max_containers=containers)
    f = Fields(body, "hint", _HINT_KEYS, frozenset({"geometry"}))
    text = limits.string_bytes
    strings = {name: f.text(name, text) for name in ("backend", "agent", "request", "transfer_id")}
    mode = f.choice("mode", TransferMode)
    layout = f.binary("layout", limits.layout_bytes)
    endpoint = f.binary("endpoint", limits.endpoint_bytes)
    extras = _decode_extras(f.array("extras", limits.extras), limits)
    groups = tuple(_decode_group(g, i, limits) for i, g in enumerate(f.array("groups", limits.groups)))
    run = f.text("run", text, empty=True)
    expires_ms = f.uint("expires_ms")
    audience = _decode_audience(body["audience"], text)
    geometry, tokens = decode_geometry(body["geometry"], limits) if f.has("geometry") else (None, None)
    try:
        return Hint(mode=mode, layout=layout, groups=groups, endpoint=endpoint, extras=extras, mac=mac, run=run,
                    audience=audience, expires_ms=expires_ms, geometry=geometry, tokens=tokens, **strings)
    except (TypeError, ValueError) as exc:  # e.g. a layer group named twice
        raise WireError(f"hint: {exc}") from None


def _decode_audience(value: Any, max_bytes: int) -> Peer | None:
    if value is None:
        return None
    if type(value) is not list or len(value) != 2 or any(type(v) is not str for v in value):
        raise WireError(f"hint: field audience must be nil or an [agent, run] pair of str, got {describe(value)}")
    for name, item in zip(("agent", "run"), value):
        check_str(item, f"hint: field audience {name}", max_bytes)
    return Peer(value[0], value[1])


def _decode_extras(items: list[Any], limits: Limits) -> tuple[tuple[str, bytes], ...]:
    out: list[tuple[str, bytes]] = []
    seen: set[str] = set()
    for i, item in enumerate(items):
        if type(item) is not list or len(item) != 2 or type(item[0]) is not str or type(item[1]) is not bytes:
            raise WireError(f"hint: field extras item {i} must be a [str, bin] pair, got {describe(item)}")
        name, value = item
        check_str(name, f"hint: field extras item {i} key", limits.string_bytes)
        if len(value) > limits.extra_bytes:
            raise WireError(f"hint: extra {name!r} is {len(value)} bytes, the limit is {limits.extra_bytes}")
        if name in seen:
            raise WireError(f"hint: extra {name!r} appears twice")
        seen.add(name)
        out.append((name, value))
    return tuple(out)


def _decode_group(value: Any, index: int, limits: Limits) -> HintGroup:
    where = f"hint group {index}"
    peek = value.get("layer_group") if type(value) is dict else None
    if type(peek) is str and 0 < len(peek) <= 64:  # name the group in every error, once it has a name
        where = f"hint group {index} ({peek!r})"
    f = Fields(value, where, _GROUP_KEYS)
    text = limits.string_bytes
    name, kind, region = f.text("layer_group", text), f.choice("kind", CacheKind), f.text("region", text)
    address, slot_bytes, region_slots = f.uint("address"), f.uint("slot_bytes"), f.uint("region_slots")
    memory_kind, device_id = f.choice("memory_kind", MemoryKind), f.uint("device_id")
    slots = int64_from_bytes(f.binary("slots", limits.message_bytes), f"{where}: field slots", limits.rows)
    ordinals = int64_from_bytes(f.binary("ordinals", limits.message_bytes), f"{where}: field ordinals", limits.rows)
    try:
        return HintGroup(name, kind, region, address, slot_bytes, region_slots, memory_kind, device_id, slots, ordinals)
    except (TypeError, ValueError) as exc:  # the contract's own checks: geometry, slots in range, lengths
        raise WireError(f"{where}: {exc}") from None


def _check_sizes(hint: Hint, limits: Limits) -> None:
    """The decoder's limits, checked at the sender so that an oversized hint is named there."""
    for name in ("backend", "agent", "request", "transfer_id"):
        check_str(getattr(hint, name), f"hint: field {name}", limits.string_bytes)
    check_str(hint.run, "hint: field run", limits.string_bytes, empty=True)
    if hint.audience is not None:
        check_str(hint.audience.agent, "hint: field audience agent", limits.string_bytes)
        check_str(hint.audience.run, "hint: field audience run", limits.string_bytes)
    if len(hint.layout) > limits.layout_bytes:
        raise WireError(f"hint: field layout is {len(hint.layout)} bytes, the limit is {limits.layout_bytes}")
    if len(hint.endpoint) > limits.endpoint_bytes:
        raise WireError(f"hint: field endpoint is {len(hint.endpoint)} bytes, the limit is {limits.endpoint_bytes}")
    if len(hint.extras) > limits.extras:
        raise WireError(f"hint: {len(hint.extras)} extras, the limit is {limits.extras}")
    names = [k for k, _ in hint.extras]
    if len(set(names)) != len(names):
        raise WireError(f"hint: an extra key appears twice in {names}")
    for name, value in hint.extras:
        check_str(name, "hint: extras key", limits.string_bytes)
        if len(value) > limits.extra_bytes:
            raise WireError(f"hint: extra {name!r} is {len(value)} bytes, the limit is {limits.extra_bytes}")
    if len(hint.groups) > limits.groups:
        raise WireError(f"hint: {len(hint.groups)} groups, the limit is {limits.groups}")
    for g in hint.groups:
        check_str(g.layer_group, "hint group layer_group", limits.string_bytes)
        check_str(g.region, f"hint group {g.layer_group!r}: field region", limits.string_bytes)
        if len(g) > limits.rows:
            raise WireError(f"hint group {g.layer_group!r}: {len(g)} rows, the limit is {limits.rows}")

