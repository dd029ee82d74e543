"""Transfer ids and hint lifetimes: each describe() mints a fresh id, so completion records
match one attempt, and stamps who may use the hint and until when; each submission checks
that a peer's hint is for this backend, unexpired and unused."""

from __future__ import annotations

import secrets
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Hashable
from typing import Any

import numpy as np

from kvxfer.contract import (
    DEFAULT_HINT_TTL_S,
    MAX_HINT_TTL_S,
    Attempt,
    Hint,
    HintGroup,
    InvalidSubmission,
    Peer,
    SubmissionRejected,
    View,
)

_RETIRED_KEPT = 65536
_USED_LIVE_CAP = 1 << 20
"""Used hints not yet expired, at most: past this a submission is refused, never a used hint
forgotten (forgetting one would let its replay through)."""


def wall_ms() -> int:
    return time.time_ns() // 1_000_000


def put_bounded(table: OrderedDict[Any, Any], key: Hashable, value: Any, kept: int) -> None:
    """``table[key] = value`` as its newest entry, dropping the oldest past ``kept``: the
    backends' tables of early, withdrawn and used transfers, which a confused or hostile
    peer must not be able to grow."""
    table[key] = value
    table.move_to_end(key)
    while len(table) > kept:
        table.popitem(last=False)


def hint_groups(view: View) -> tuple[HintGroup, ...]:
    """The view's groups as the peer needs to see them, in the view's order."""
    return tuple(
        HintGroup(
            layer_group=g.layer_group, kind=g.kind, region=g.region.name, address=g.region.address,
            slot_bytes=g.region.slot_bytes, region_slots=g.region.slots,
            memory_kind=g.region.memory_kind, device_id=g.region.device_id,
            slots=g.slots, ordinals=g.ordinals,
        )
        for g in view.groups
    )


def _same_rows(a: View, b: View) -> bool:
    """The two views name the same rows (the described and the submitted one)."""
    if a is b:
        return True
    if len(a.groups) != len(b.groups) or a.geometry != b.geometry:
        return False  # the peer was shown another layout of these rows
    for x, y in zip(a.groups, b.groups):
        if x.layer_group != y.layer_group or x.region != y.region:
            return False
        for p, q in ((x.slots, y.slots), (x.ordinals, y.ordinals)):
            if p is not q and not np.array_equal(p, q):
                return False
    return True


class OwnTransfers:
    """The ids this end minted in describe(), by view, and those already used up; and the
    peers' transfer ids this end has acted on.

    fetch()/publish() of a view use the id of that view's latest describe(), and only for
    the rows that describe() showed the peer; once the attempt exists the id is consumed,
    and a record naming a retired id is stale. A peer's hint moves bytes once: a second
    submission with it (a replay, or a retry after the peer reused its rows) is refused, and
    so is a hint bound to another peer or past its expiry. A used hint is remembered until
    it expires, however many transfers follow.
    """

    def __init__(self, agent: str, ttl_s: float = DEFAULT_HINT_TTL_S) -> None:
        if not 0 < ttl_s <= MAX_HINT_TTL_S:
            raise ValueError(f"hint_ttl_s must lie in (0, {MAX_HINT_TTL_S:g}] seconds, got {ttl_s!r}")
        self.peer = Peer(agent, secrets.token_hex(8))
        self.ttl_ms = int(ttl_s * 1000)
        self._lock = threading.Lock()
        self._by_view: OrderedDict[tuple[str, int, int], tuple[str, View]] = OrderedDict()
        self._retired: OrderedDict[str, None] = OrderedDict()
        # Peers' hints this end acted on -> (the hint's expiry in ms, the attempt that used it,
        # None once it quiesced): remembered until the hint expires.
        self._used: OrderedDict[tuple[str, str], tuple[int, Attempt | None]] = OrderedDict()
        # Keys of used hints whose attempt is still held, oldest first: each use() lets go of
        # a few that quiesced, so finished attempts are not kept for the hints' lifetime.
        self._holding: deque[tuple[str, str]] = deque()

    def expiry(self) -> int:
        """The expiry to stamp on a hint described now."""
        return wall_ms() + self.ttl_ms

    @staticmethod
    def _key(view: View) -> tuple[str, int, int]:
        return (view.request, view.tokens.start, view.tokens.end)

    def mint(self, view: View) -> str:
        transfer_id = secrets.token_hex(12)
        with self._lock:  # bounded: views described but never submitted
            put_bounded(self._by_view, self._key(view), (transfer_id, view), _RETIRED_KEPT)
        return transfer_id

    def lookup(self, view: View) -> str:
        """The id of the view's latest describe(); InvalidSubmission when there is none, or
        when ``view`` holds other rows than the described one (the peer was shown those)."""
        with self._lock:
            found = self._by_view.get(self._key(view))
        if found is None:
            raise InvalidSubmission(
                f"no describe() for request {view.request!r} tokens "
                f"[{view.tokens.start}, {view.tokens.end}): describe the view and send its hint to the peer first"
            )
        transfer_id, described = found
        if not _same_rows(described, view):
            raise InvalidSubmission(
                f"request {view.request!r} tokens [{view.tokens.start}, {view.tokens.end}): the view holds other rows "
                "than the one described; describe it again and send the new hint")
        return transfer_id

    def check_for_us(self, hint: Hint) -> None:
        """InvalidSubmission when ``hint`` is bound to another peer or has expired (and the used
        hints that expired are forgotten, whatever the answer)."""
        with self._lock:
            self._forget_expired()
        audience = hint.audience
        if audience is not None and audience != self.peer:
            if audience.agent == self.peer.agent:
                raise InvalidSubmission(
                    f"hint for transfer {hint.transfer_id} is bound to run {audience.run} of agent {audience.agent!r}; "
                    f"this is run {self.peer.run} (the agent restarted since the hint was made): the peer must "
                    "describe again for this run")
            raise InvalidSubmission(
                f"hint for transfer {hint.transfer_id} is bound to {audience}, not to this backend {self.peer}: "
                "only the peer it was made for may use it")
        now = wall_ms()
        if hint.expires_ms == 0:
            raise InvalidSubmission(f"hint for transfer {hint.transfer_id} carries no expiry: the peer must describe "
                                    "again (hints from this kvxfer always expire)")
        if now > hint.expires_ms:
            raise InvalidSubmission(f"hint for transfer {hint.transfer_id} expired {(now - hint.expires_ms) / 1000:.1f}s "
                                    "ago: the peer must describe again")
        if hint.expires_ms - now > MAX_HINT_TTL_S * 1000:
            raise InvalidSubmission(
                f"hint for transfer {hint.transfer_id} expires {(hint.expires_ms - now) / 1000:.0f}s from now, over "
                f"the {MAX_HINT_TTL_S:g}s any hint may live: a forged hint, or clocks far apart")

    def check_usable(self, hint: Hint) -> None:
        """After ``check_for_us`` (each backend calls it first, for either side): InvalidSubmission
        when this end already acted on the peer's transfer (SubmissionRejected when too many used
        hints are still live to take one more)."""
        with self._lock:
            used = (hint.agent, hint.transfer_id) in self._used
            full = len(self._used) >= _USED_LIVE_CAP
        if used:
            raise InvalidSubmission(f"peer {hint.agent!r}'s transfer {hint.transfer_id} was used already: a hint "
                                    "moves bytes once; the peer must describe again")
        if full:
            raise SubmissionRejected(f"{_USED_LIVE_CAP} used hints have not expired yet; retry later")

    def use(self, hint: Hint, attempt: Attempt) -> None:
        """Remember ``hint`` as used by ``attempt`` until it expires (check_usable came
        first). Call it before anything is posted: ``withdraw`` trusts it."""
        key = (hint.agent, hint.transfer_id)
        with self._lock:
            self._used[key] = (hint.expires_ms, attempt)
            self._holding.append(key)
            for _ in range(min(2, len(self._holding))):
                held = self._holding.popleft()
                found = self._used.get(held)
                if found is None or found[1] is None:
                    continue
                if found[1].quiesced():
                    self._used[held] = (found[0], None)
                else:
                    self._holding.append(held)

    def withdraw(self, hint: Hint) -> bool:
        """``Backend.withdraw``: True when nothing of this end can reach the peer's rows
        through ``hint`` any more, now or later: it was never used here (and now counts as
        used, so it is refused from now on) or the attempt that used it has quiesced."""
        key = (hint.agent, hint.transfer_id)
        with self._lock:
            self._forget_expired()
            found = self._used.get(key)
            if found is None:
                # Kept until it expires (or a while, for a hint without one): a later
                # submission with it is refused as used.
                self._used[key] = (max(hint.expires_ms, wall_ms() + self.ttl_ms), None)
                return True
            expires, attempt = found
            if attempt is None:
                return True
            if not attempt.quiesced():
                return False
            self._used[key] = (expires, None)  # no need to keep the attempt alive
            return True

    def _forget_expired(self) -> None:
        now = wall_ms()
        used = self._used
        while used:
            key, (expires, _) = next(iter(used.items()))
            if expires >= now:
                break
            del used[key]

    def consume(self, view: View, transfer_id: str) -> None:
        with self._lock:
            found = self._by_view.get(self._key(view))
            if found is not None and found[0] == transfer_id:
                del self._by_view[self._key(view)]

    def retire(self, transfer_id: str) -> None:
        with self._lock:
            put_bounded(self._retired, transfer_id, None, _RETIRED_KEPT)

    def is_retired(self, transfer_id: str) -> bool:
        with self._lock:
            return transfer_id in self._retired
