"""Transfer ids: each describe() mints a fresh one, so completion records match one attempt."""

from __future__ import annotations

import secrets
import threading
from collections import OrderedDict

from kvxfer.contract import HintGroup, InvalidSubmission, View

_RETIRED_KEPT = 65536


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


class OwnTransfers:
    """The ids this end minted in describe(), by view, and those already used up.

    fetch()/publish() of a view use the id of that view's latest describe(); once the
    attempt exists the id is consumed, and a record naming a retired id is stale.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_view: dict[tuple[str, int, int], str] = {}
        self._retired: OrderedDict[str, None] = OrderedDict()

    @staticmethod
    def _key(view: View) -> tuple[str, int, int]:
        return (view.request, view.tokens.start, view.tokens.end)

    def mint(self, view: View) -> str:
        transfer_id = secrets.token_hex(12)
        with self._lock:
            self._by_view[self._key(view)] = transfer_id
        return transfer_id

    def lookup(self, view: View) -> str:
        """The id of the view's latest describe(); InvalidSubmission when there is none."""
        with self._lock:
            transfer_id = self._by_view.get(self._key(view))
        if transfer_id is None:
            raise InvalidSubmission(
                f"no describe() for request {view.request!r} tokens "
                f"[{view.tokens.start}, {view.tokens.end}): describe the view and send its hint to the peer first"
            )
        return transfer_id

    def consume(self, view: View, transfer_id: str) -> None:
        with self._lock:
            if self._by_view.get(self._key(view)) == transfer_id:
                del self._by_view[self._key(view)]

    def retire(self, transfer_id: str) -> None:
        with self._lock:
            self._retired[transfer_id] = None
            while len(self._retired) > _RETIRED_KEPT:
                self._retired.popitem(last=False)

    def is_retired(self, transfer_id: str) -> bool:
        with self._lock:
            return transfer_id in self._retired
