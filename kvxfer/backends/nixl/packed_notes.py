"""The packed path's notes between two NIXL ends (``req``, ``credit``, ``chunk``), and the
receiver's state of one transfer landing in its arena (``Inbound``): apart from the sender's
side in ``packed`` so that the job types (``jobs``) can name it without a cycle."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgpack

from kvxfer.contract import BoolArray
from kvxfer.wire.envelope import container_budget

NOTE_PREFIX = b"KXP1"  # never the start of a wire record (a msgpack map)
MAX_CHUNKS = 1 << 24  # a request for more chunks than this is malformed


# --- notes --------------------------------------------------------------------------------
def encode_note(kind: str, **fields: Any) -> bytes:
    return NOTE_PREFIX + msgpack.packb({"k": kind, **fields}, use_bin_type=True)


_NOTE_CONTAINERS = 4  # the map, and the grant, ok and no lists of a credit note


def decode_note(message: bytes) -> dict[str, Any]:
    """The note's fields; ValueError naming what is wrong. Bounded like the wire codec: a
    peer's note of nested arrays would otherwise cost many times its size in memory."""
    counted = container_budget(_NOTE_CONTAINERS)
    try:
        note = msgpack.unpackb(message[len(NOTE_PREFIX):], raw=False, strict_map_key=True,
                               list_hook=counted, object_hook=counted, max_array_len=MAX_CHUNKS,
                               max_map_len=16, max_ext_len=0)
    except Exception as exc:
        raise ValueError(f"packed note does not decode: {exc}") from None
    if not isinstance(note, dict) or note.get("k") not in ("req", "credit", "chunk"):
        raise ValueError("packed note has no known kind")
    if not isinstance(note.get("t"), str):
        raise ValueError("packed note names no transfer")
    return note


def ints(value: Any, what: str) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise ValueError(f"packed note field {what} must be a list of ints")
    return value



# --- the receiver -------------------------------------------------------------------------
@dataclass(eq=False)
class Inbound:
    """A transfer landing in this backend's arena: its slots, what was scattered, what to say."""

    sender: str
    wanted: int                                      # chunks the sender still needs slots for
    scattered: list[BoolArray]                       # per view group: rows in place
    expected: int                                    # rows the sender will send; -1: unknown
    requested: bool = True                           # False: slots granted at fetch(), no ``req`` yet
    granted: set[int] = field(default_factory=set)  # slots the sender may be writing
    grant: list[int] = field(default_factory=list)  # to send: new slots
    ok: list[int] = field(default_factory=list)     # to send: chunks scattered
    no: list[int] = field(default_factory=list)     # to send: chunks dropped
    # Between two geometries (``geometry_packed.Shaped``): the plan's segments scattered, and
    # ``expected`` counts segments, not rows.
    shaped: Any = None
    # With integrity on (pool rows): each row's digest, taken as it was scattered, so that the
    # record's digests need only be compared (``RowCheck.check_summed``).
    sums: list[Any] | None = None

    @property
    def complete(self) -> bool:
        if self.shaped is not None:
            return self.expected >= 0 and self.shaped.count == self.expected
        return self.expected >= 0 and sum(int(m.sum()) for m in self.scattered) == self.expected

    @property
    def landed_all(self) -> bool:
        """Every row (between geometries: every segment of the plan) was scattered."""
        if self.shaped is not None:
            return bool(self.shaped.landed.all())
        return all(bool(m.all()) for m in self.scattered)

    def on_request(self, chunks: int, rows: int, held: int) -> None:
        """The sender's ``req`` after slots were granted at fetch(): it holds ``held`` of them
        (a grant still on its way is not counted: granting too much is safe, as unused slots
        come back when the transfer ends, where granting too little would leave it waiting)."""
        self.requested, self.expected = True, rows
        self.wanted = max(0, chunks - held)

    @property
    def owes_note(self) -> bool:
        return bool(self.grant or self.ok or self.no)

    def note(self, transfer_id: str) -> bytes:
        """What is owed, as a ``credit`` note; owed still until ``sent()``: a note that could
        not be sent (etcd has not delivered the sender's metadata yet) goes with the next."""
        return encode_note("credit", t=transfer_id, grant=self.grant, ok=self.ok, no=self.no)

    def sent(self) -> None:
        self.grant, self.ok, self.no = [], [], []
