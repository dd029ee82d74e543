"""The immutable description of the other end of a transfer.

A hint never says which local rows move: that comes from the local view alone. It carries
what the peer needs to reach this end's rows (agent, endpoint, region bases, slots and
ordinals), the layout identity both ends must share, the transfer mode and backend kind
both ends must agree on, and a fresh transfer id that matches completion records to one
attempt.

A hint is also a capability: in push mode whoever holds the decode end's hint can WRITE
into its rows. So it names who made it (``agent`` and ``run``, a ``Peer``), may name the
one peer allowed to use it (``audience``), and says until when it may be used
(``expires_ms``, wall-clock milliseconds since the epoch). A backend refuses, by name and
before touching anything, a hint bound to another peer (or to an earlier run of its own
agent: a restarted process is another peer), a hint past its expiry, and a hint it used
already; it remembers used hints until they expire, so that none is ever used twice. Once
the bound peer has used a hint, no honest backend will use it again, and the rows it
exposed may be reused. Ends on different hosts need clocks within a few seconds of each
other (NTP), far below any sensible lifetime.
"""

from __future__ import annotations

import enum
import functools
from dataclasses import dataclass, field
from typing import Any

from kvxfer.contract.arrays import IndexArray, all_distinct, bounds, frozen_int64, is_positions
from kvxfer.contract.geometry import KVGeometry
from kvxfer.contract.memory import MemoryKind
from kvxfer.contract.rows import CacheKind, TokenRange

DEFAULT_HINT_TTL_S = 120.0
"""How long a hint may be used after describe(): long enough for a prefill to run between a
decode end's describe() and the prefill end's publish(), short enough to bound how long a
backend must remember the hints it used."""
MAX_HINT_TTL_S = 3600.0
"""No backend makes, or accepts, a hint that lives longer: a used hint is remembered until it
expires, so a far-off expiry (a forged hint, or clocks far apart) would be kept for ever."""


class TransferMode(enum.Enum):
    """PUSH: the publisher WRITEs into the fetcher's rows. PULL: the fetcher READs."""

    PUSH = "push"
    PULL = "pull"


@dataclass(frozen=True, eq=False)
class HintGroup:
    """The peer's rows of one layer group: slot ``slots[i]`` of its region holds ``ordinals[i]``."""

    layer_group: str
    kind: CacheKind
    region: str
    address: int
    slot_bytes: int
    region_slots: int
    memory_kind: MemoryKind
    device_id: int
    slots: IndexArray
    ordinals: IndexArray

    def __post_init__(self) -> None:
        if not isinstance(self.layer_group, str) or not self.layer_group:
            raise ValueError(f"HintGroup.layer_group must be a non-empty str, got {self.layer_group!r}")
        if not isinstance(self.kind, CacheKind) or not isinstance(self.memory_kind, MemoryKind):
            raise TypeError("HintGroup.kind must be a CacheKind and memory_kind a MemoryKind")
        if self.address < 0 or self.slot_bytes <= 0 or self.region_slots <= 0 or self.device_id < 0:
            raise ValueError(f"HintGroup {self.layer_group!r}: bad region geometry")
        if self.address + self.slot_bytes * self.region_slots > 1 << 64:
            raise ValueError(f"HintGroup {self.layer_group!r}: region end overflows 64 bits")
        slots = frozen_int64(self.slots, f"hint slots of group {self.layer_group!r}")
        ordinals = frozen_int64(self.ordinals, f"hint ordinals of group {self.layer_group!r}")
        if slots.shape != ordinals.shape:
            raise ValueError(f"hint group {self.layer_group!r}: {slots.size} slots but {ordinals.size} ordinals")
        span = bounds(slots)
        if span is not None and (span[0] < 0 or span[1] >= self.region_slots):
            raise ValueError(f"hint group {self.layer_group!r}: slot outside [0, {self.region_slots})")
        positions = is_positions(ordinals)
        if not positions and not all_distinct(ordinals):
            raise ValueError(f"hint group {self.layer_group!r} repeats an ordinal")
        object.__setattr__(self, "slots", slots)
        object.__setattr__(self, "ordinals", ordinals)
        self.__dict__["ordinals_are_positions"] = positions  # seeds the cached property below

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        # Rebuilt (and so validated) through the constructor: a backend trusts a HintGroup's
        # slot bounds, and numpy does not pickle the read-only flag.
        return (HintGroup, (self.layer_group, self.kind, self.region, self.address, self.slot_bytes,
                            self.region_slots, self.memory_kind, self.device_id, self.slots, self.ordinals))

    @functools.cached_property
    def ordinals_are_positions(self) -> bool:
        """True when ordinals are 0..n-1 in order (known from construction)."""
        return is_positions(self.ordinals)

    def __len__(self) -> int:
        return int(self.slots.size)

    def _key(self) -> tuple[object, ...]:
        return (
            self.layer_group, self.kind, self.region, self.address, self.slot_bytes,
            self.region_slots, self.memory_kind, self.device_id,
            self.slots.tobytes(), self.ordinals.tobytes(),
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, HintGroup):
            return NotImplemented
        return self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())


@dataclass(frozen=True)
class Peer:
    """One backend instance: its agent name and its run, a fresh id each time a backend is
    made, so that a restarted process under the same agent name is another peer."""

    agent: str
    run: str

    def __post_init__(self) -> None:
        if not isinstance(self.agent, str) or not self.agent or not isinstance(self.run, str) or not self.run:
            raise ValueError(f"Peer needs a non-empty agent and run, got {self.agent!r}, {self.run!r}")

    def __str__(self) -> str:
        return f"{self.agent!r} (run {self.run})"


@dataclass(frozen=True)
class Hint:
    """The other end of one transfer, as it described itself."""

    backend: str
    mode: TransferMode
    agent: str
    request: str
    transfer_id: str
    layout: bytes
    groups: tuple[HintGroup, ...]
    endpoint: bytes = b""
    extras: tuple[tuple[str, bytes], ...] = field(default=())
    mac: bytes | None = None
    run: str = ""                  # the describing backend's run ("": unknown, as in hand-made hints)
    audience: Peer | None = None   # the one peer that may use this hint (None: any peer, once)
    expires_ms: int = 0            # wall clock, ms since the epoch; 0: none (refused by every backend)
    geometry: KVGeometry | None = None  # the describing end's KV layout, when its view had one
    tokens: TokenRange | None = None    # with a geometry: the tokens the describing view covers

    def __post_init__(self) -> None:
        for name in ("backend", "agent", "request", "transfer_id"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise ValueError(f"Hint.{name} must be a non-empty str, got {value!r}")
        if not isinstance(self.mode, TransferMode):
            raise TypeError(f"Hint.mode must be a TransferMode, got {self.mode!r}")
        if not isinstance(self.layout, bytes) or not isinstance(self.endpoint, bytes):
            raise TypeError("Hint.layout and Hint.endpoint must be bytes")
        if not isinstance(self.run, str):
            raise TypeError(f"Hint.run must be a str, got {self.run!r}")
        if self.audience is not None and not isinstance(self.audience, Peer):
            raise TypeError(f"Hint.audience must be a Peer or None, got {self.audience!r}")
        if isinstance(self.expires_ms, bool) or not isinstance(self.expires_ms, int) or not 0 <= self.expires_ms < 1 << 63:
            raise ValueError(f"Hint.expires_ms must be an int in [0, 2**63), got {self.expires_ms!r}")
        self._check_geometry()
        groups = tuple(self.groups)
        if not all(isinstance(g, HintGroup) for g in groups):
            raise TypeError("Hint.groups must hold HintGroup items")
        names = [g.layer_group for g in groups]
        if len(set(names)) != len(names):
            raise ValueError(f"Hint names a layer group twice: {names}")
        extras = tuple((str(k), bytes(v)) for k, v in self.extras)
        object.__setattr__(self, "groups", groups)
        object.__setattr__(self, "extras", extras)

    def _check_geometry(self) -> None:
        if self.geometry is not None and not isinstance(self.geometry, KVGeometry):
            raise TypeError(f"Hint.geometry must be a KVGeometry or None, got {type(self.geometry).__name__}")
        if (self.geometry is None) != (self.tokens is None) or (
                self.tokens is not None and not isinstance(self.tokens, TokenRange)):
            raise ValueError("Hint.geometry and Hint.tokens (a TokenRange) come together or not at all")

    @property
    def peer(self) -> Peer | None:
        """The backend that made this hint, or None when it did not say its run."""
        return Peer(self.agent, self.run) if self.run else None

    def group(self, layer_group: str) -> HintGroup | None:
        for g in self.groups:
            if g.layer_group == layer_group:
                return g
        return None

    def extra(self, key: str) -> bytes | None:
        for k, v in self.extras:
            if k == key:
                return v
        return None

    @property
    def rows(self) -> int:
        return int(sum(len(g) for g in self.groups))

