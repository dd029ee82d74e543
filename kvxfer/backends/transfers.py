"""Transfer ids: each describe() mints a fresh one, so completion records match one attempt."""

from __future__ import annotations

import secrets
import threading
from collections import OrderedDict
from collections.abc import Hashable
from typing import Any

import numpy as np

from kvxfer.contract import HintGroup, InvalidSubmission, View

_RETIRED_KEPT = 65536


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
    if len(a.groups) != len(b.groups):
        return False
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
    submission with it (a replay, or a retry after the peer reused its rows) is refused.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_view: OrderedDict[tuple[str, int, int], tuple[str, View]] = OrderedDict()
        self._retired: OrderedDict[str, None] = OrderedDict()
        self._used: OrderedDict[tuple[str, str], None] = OrderedDict()

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

    def check_unused(self, agent: str, transfer_id: str) -> None:
        """InvalidSubmission when this end already acted on the peer's transfer."""
        with self._lock:
            used = (agent, transfer_id) in self._used
        if used:
            raise InvalidSubmission(f"peer {agent!r}'s transfer {transfer_id} was used already: a hint moves bytes "
                                    "once; the peer must describe again")

    def use(self, agent: str, transfer_id: str) -> None:
        with self._lock:
            put_bounded(self._used, (agent, transfer_id), None, _RETIRED_KEPT)

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
