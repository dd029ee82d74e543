"""Several hints as one message: the hints of one request's transfers between two TP groups.

A decode worker of TP 2 fed by a prefill worker of TP 1 describes one transfer per decode
rank (and per source rank, when a rank's heads come from several): the router carries them
as one opaque message, like a single hint. ``encode_hints`` of one hint is that hint's own
message, so ends that move one transfer per request speak exactly as before; more make a
``hints`` message whose body is ``{"hints": [bin, ...]}``, each item a whole hint message
(signed on its own when a key applies, and the bundle too).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvxfer.contract import Hint
from kvxfer.wire.envelope import Buffer, open_message, seal, unpack
from kvxfer.wire.errors import WireError
from kvxfer.wire.fields import Fields, describe
from kvxfer.wire.hint import decode_hint, encode_hint
from kvxfer.wire.limits import DEFAULT_LIMITS, Limits

MAX_HINTS = 64  # transfers of one request: TP ranks times source ranks


def encode_hints(hints: Sequence[Hint], key: bytes | None = None, *, limits: Limits = DEFAULT_LIMITS) -> bytes:
    """One message carrying ``hints`` (at least one, at most MAX_HINTS), in order."""
    hints = tuple(hints)
    if not 1 <= len(hints) <= MAX_HINTS:
        raise WireError(f"a hints message carries 1 to {MAX_HINTS} hints, got {len(hints)}")
    if len(hints) == 1:
        return encode_hint(hints[0], key, limits=limits)
    return seal("hints", {"hints": [encode_hint(h, key, limits=limits) for h in hints]}, key, limits)


def decode_hints(data: Buffer, key: bytes | None = None, *, limits: Limits = DEFAULT_LIMITS) -> tuple[Hint, ...]:
    """The hints in ``data``: a single hint message gives one. WireError for anything else."""
    if _message_type(data, limits) != "hints":
        return (decode_hint(data, key, limits=limits),)
    body, _ = open_message(data, "hints", key, limits, max_items=MAX_HINTS, max_containers=2)
    items = Fields(body, "hints", frozenset({"hints"})).array("hints", MAX_HINTS)
    if len(items) < 2:
        raise WireError(f"a hints message carries at least 2 hints, got {len(items)}")
    out = []
    for i, item in enumerate(items):
        if type(item) is not bytes:
            raise WireError(f"hints item {i} must be bin, got {describe(item)}")
        out.append(decode_hint(item, key, limits=limits))
    return tuple(out)


def _message_type(data: Buffer, limits: Limits) -> object:
    """The envelope's type field, or None when ``data`` is no envelope (the full decode then
    names what is wrong)."""
    try:
        outer = unpack(data, "message", limits, max_items=8, max_containers=1)
    except WireError:
        return None
    return outer.get("type") if type(outer) is dict else None
