"""The receiving end of the packed path: landing slots granted to the waits that want them,
chunks scattered from the arena into their rows, acknowledgements back to the sender.

A passive wait lands packed once its sender asks for slots (its ``req`` note), or, for a
large fetch(), once slots were granted ahead of the ask (``nixl.packed.PREGRANT_SLOTS``).
Only the backend's progress thread calls this.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvxfer.backends.common.attempt import TrackedAttempt
from kvxfer.backends.common.integrity import RowCheck
from kvxfer.backends.common.transfers import put_bounded
from kvxfer.backends.nixl.geometry_packed import landing_segments, packed_bytes, request_limit, scatter_calls, shaped
from kvxfer.backends.nixl.jobs import PassiveWait
from kvxfer.backends.nixl.packed import Arena, Landing, rows_from_runs
from kvxfer.backends.nixl.packed_notes import Inbound, ints
from kvxfer.contract import Delivered, Failed
from kvxfer.native import RowCopyError

log = logging.getLogger(__name__)

KEPT = 4096  # requests that came before their fetch(), and senders heard from: the newest kept


@dataclass(frozen=True)
class ReceiverHooks:
    """What the receiver needs of its backend."""

    wait_for: Callable[[str], PassiveWait | None]  # the passive wait of our transfer id (under the jobs lock)
    is_retired: Callable[[str], bool]
    notify: Callable[[str, bytes], bool]  # False: the peer is gone or not loaded
    knows: Callable[[str], bool]  # the peer's metadata is loaded
    count: Callable[..., None]
    set_path: Callable[[TrackedAttempt, str], None]
    end_passive: Callable[[PassiveWait], None]


class PackedReceiver:
    def __init__(self, name: str, lock: threading.Lock, integrity: RowCheck, hooks: ReceiverHooks) -> None:
        self.name = name
        self._integrity = integrity  # when it applies, a wait concludes from the record, which has the digests
        self.arena: Arena | None = None  # the backend's, once its first register() made it
        self._lock = lock  # the backend's jobs lock: guards ``inbound`` and ``early_requests``
        self._hooks = hooks
        self.inbound: dict[str, PassiveWait] = {}  # waits landing packed, by our transfer id
        self.early_requests: OrderedDict[str, tuple[str, int, int, int]] = OrderedDict()
        self.heard: OrderedDict[str, None] = OrderedDict()  # peers whose notifications reached us

    def heard_from(self, sender: str) -> None:
        put_bounded(self.heard, sender, None, KEPT)

    def forget_peer(self, peer: str) -> None:
        self.heard.pop(peer, None)

    def grant_ahead(self, wait: PassiveWait, slots: int) -> None:
        """Under the jobs lock, at fetch(): slots to grant before the sender asks."""
        wait.inbound = Inbound(wait.hint.agent, slots, wait.view.row_masks(), -1, requested=False, shaped=shaped(wait))
        self.inbound[wait.own_id] = wait

    def release(self, wait: PassiveWait) -> None:
        """The peer wrote its last byte into our memory: its arena slots are ours again."""
        with self._lock:
            self.inbound.pop(wait.own_id, None)
        if wait.inbound is not None and self.arena is not None:
            self.arena.free_in.extend(wait.inbound.granted)
            wait.inbound.granted.clear()

    # --- requests ---------------------------------------------------------------------
    def ready_requests(self, passive: dict[str, PassiveWait]) -> list[tuple[str, str, int, int, int]]:
        """Under the jobs lock: requests that came early and whose wait now exists."""
        return [(t, *self.early_requests.pop(t)) for t in list(self.early_requests) if t in passive]

    def on_request(self, sender: str, transfer_id: str, chunks: int, rows: int, held: int) -> None:
        """The sender asks for slots for ``chunks`` packed chunks (``held``: slots it holds of
        ours already). ValueError for a request that cannot be right."""
        wait = self._hooks.wait_for(transfer_id)
        if wait is None:
            with self._lock:
                if not self._hooks.is_retired(transfer_id):
                    put_bounded(self.early_requests, transfer_id, (sender, chunks, rows, held), KEPT)
            return
        inbound = wait.inbound
        if wait.hint.agent != sender or (inbound is not None and inbound.requested) or self.arena is None:
            log.warning("nixl backend %s: ignored a packed request from %r for transfer %s", self.name, sender,
                        transfer_id)
            return
        limit = request_limit(wait)  # rows; between geometries, segments of the plan
        if not 0 < chunks <= max(1, limit) or not -1 <= rows <= limit or held < 0:
            raise ValueError(f"a packed request for {chunks} chunks of {rows} rows ({held} slots held), the "
                             f"transfer has {limit} rows")
        if inbound is None:
            wait.inbound = Inbound(sender, chunks, wait.view.row_masks(), rows, shaped=shaped(wait))
        else:
            inbound.on_request(chunks, rows, held)  # slots were granted at fetch(); chunks may have landed
        with self._lock:
            self.inbound[transfer_id] = wait
        self._hooks.set_path(wait.attempt, "packed")
        self._hooks.count(packed_received=1)
        self.finish_if_complete(wait)

    # --- credits ------------------------------------------------------------------------
    def grant_credits(self) -> None:
        """Free arena slots to the transfers that want them, in turn (those whose sender asked
        first); then send what is owed."""
        arena = self.arena
        with self._lock:
            waits = list(self.inbound.items())
        if arena is None or not waits:
            return
        granted = self._share_slots(arena, [w for _, w in waits])
        if granted:
            self._hooks.count(credits_granted=granted)
        for transfer_id, wait in waits:
            self._send_grant(arena, transfer_id, wait)

    def _share_slots(self, arena: Arena, waits: list[PassiveWait]) -> int:
        """Hand free landing slots out round-robin; the number granted."""
        wanting, room = self._wanting(arena, waits)
        granted = 0
        while arena.free_in and wanting:
            for inbound in list(wanting):
                if not arena.free_in:
                    break
                if not inbound.requested:
                    if room <= 0:
                        wanting.remove(inbound)
                        continue
                    room -= 1
                slot = arena.free_in.popleft()
                inbound.granted.add(slot)
                inbound.grant.append(slot)
                inbound.wanted -= 1
                granted += 1
                if inbound.wanted == 0:
                    wanting.remove(inbound)
        return granted

    def _wanting(self, arena: Arena, waits: list[PassiveWait]) -> tuple[list[Inbound], int]:
        """(the waits that want slots, those whose sender asked first; how many slots may
        still go to senders that have not asked)."""
        live = [w.inbound for w in waits if w.inbound and w.inbound.wanted > 0 and w.attempt.poll() is None
                and not w.attempt.cancel_requested]  # a cancelled wait concludes this step: no new writes
        # Unasked grants go only to senders we have heard from: one that never loaded our
        # metadata could not answer the withdrawal that frees them if the wait ends unasked.
        ahead = [i for i in live if not i.requested and i.sender in self.heard and self._hooks.knows(i.sender)]
        # Slots held for senders that have not asked are at most half of the landing slots.
        room = arena.landing_slots // 2 - sum(len(w.inbound.granted) for w in waits
                                              if w.inbound is not None and not w.inbound.requested)
        return [i for i in live if i.requested] + ahead, room

    def _send_grant(self, arena: Arena, transfer_id: str, wait: PassiveWait) -> None:
        inbound = wait.inbound
        if inbound is None or not inbound.owes_note or not self._hooks.knows(wait.hint.agent):
            return  # an etcd sender not loaded yet is told once the heartbeat has loaded it
        grant, asked = list(inbound.grant), inbound.requested
        if self._hooks.notify(wait.hint.agent, inbound.note(transfer_id)):
            inbound.sent()
            if not asked:
                self._hooks.count(credits_ahead=len(grant))
        elif not asked:
            # Unasked slots the sender never heard of: take them back (it asks if it needs them).
            inbound.granted.difference_update(grant)
            arena.free_in.extend(grant)
            inbound.wanted += len(grant)
            inbound.grant.clear()

    def finish_if_complete(self, wait: PassiveWait) -> None:
        """Every row the sender will send is in place: conclude now rather than one
        notification later. The sender still needs the last acknowledgement."""
        inbound = wait.inbound
        if inbound is None or not inbound.complete or wait.attempt.poll() is not None:
            return
        if self._hooks.notify(inbound.sender, inbound.note(wait.own_id)):
            inbound.sent()
        if self._integrity.checks_records(wait.view):
            return  # the publisher's record carries the digests: conclude_packed checks them
        wait.attempt.conclude(Delivered(tuple(wait.masks())))
        self._hooks.end_passive(wait)

    # --- landing ------------------------------------------------------------------------
    def land(self, notes: list[tuple[str, dict[str, Any]]]) -> None:
        """Packed chunks are in our arena: scatter them into their waits' rows (all queued
        before one wait for the device), then acknowledge."""
        landings = []
        for sender, note in notes:
            try:
                landing = self._landing(sender, note)
            except ValueError as exc:
                log.warning("nixl backend %s: dropped a packed note from %r: %s", self.name, sender, exc)
                continue
            if landing is not None:
                landings.append(landing)
        if not landings:
            return
        arena = self.arena
        assert arena is not None  # a landing exists only in an arena
        # A wait that a later note of this batch failed (or that ended meanwhile) takes no
        # more rows: its outcome's masks are final.
        ended = [x for x in landings if x.wait.attempt.poll() is not None]
        for x in ended:
            arena.free_in.append(x.slot)
            x.wait.inbound.no.append(x.chunk)
        landings = [x for x in landings if x not in ended]
        if not landings:
            return
        try:
            _scatter(arena, landings)
            failure = None
        except RowCopyError as exc:
            failure = str(exc)
        for x in landings:
            arena.free_in.append(x.slot)
            wait, inbound = x.wait, x.wait.inbound
            if failure is not None:
                inbound.no.append(x.chunk)
                wait.attempt.conclude(Failed(f"packed chunk {x.chunk} from {inbound.sender!r}: {failure}",
                                             wait.masks()))
                continue
            inbound.ok.append(x.chunk)
            if x.segments is None and self._integrity.applies(wait.view):
                if inbound.sums is None:
                    inbound.sums = [np.zeros(len(g), dtype=np.uint64) for g in wait.view.groups]
                inbound.sums[x.group][x.rows] = self._integrity.sum_landed(x.region, x.slots)
            self._hooks.count(chunks_scattered=1, bytes_scattered=_landed(x))
            self.finish_if_complete(wait)

    def _landing(self, sender: str, note: dict[str, Any]) -> Landing | None:
        """Where a chunk's rows go; None when it is dropped unscattered (its slot freed, the
        sender told ``no``). ValueError for a chunk that is not ours to land."""
        transfer_id = note["t"]
        chunk, slot = ints([note.get("c"), note.get("s")], "c/s")
        group = -1 if "a" in note else ints([note.get("g")], "g")[0]  # "a": segments of a geometry's plan
        wait = self._hooks.wait_for(transfer_id)
        inbound = wait.inbound if wait is not None else None
        arena = self.arena
        if wait is None or inbound is None or inbound.sender != sender or arena is None:
            raise ValueError(f"chunk {chunk} for transfer {transfer_id}, which is not landing here")
        if slot not in inbound.granted:
            inbound.no.append(chunk)
            raise ValueError(f"chunk {chunk} of transfer {transfer_id} is in slot {slot}, not granted to it")
        inbound.granted.discard(slot)
        if wait.attempt.poll() is not None:
            inbound.no.append(chunk)  # concluded (cancelled, timed out): its rows stay as reported
            arena.free_in.append(slot)
            return None
        try:
            if inbound.shaped is not None:  # between two geometries: segments of the plan, not rows
                rows_group = wait.view.groups[0]
                found = landing_segments(inbound.shaped, note, arena)
                return Landing(wait, chunk, slot, 0, rows_group.slots[:0], rows_group.region, rows_group.slots[:0],
                               segments=found)
            if not 0 <= group < len(wait.view.groups):
                raise ValueError(f"group {group} of a view with {len(wait.view.groups)} groups")
            rows_group = wait.view.groups[group]
            rows = rows_from_runs(note.get("rs"), note.get("rl"), len(rows_group))
            region = rows_group.region
            if rows.size * region.slot_bytes > arena.slot_bytes:
                raise ValueError(f"{rows.size} rows of {region.slot_bytes} bytes exceed an arena slot")
            if (region.memory_kind, region.device_id) != (arena.memory_kind, arena.device_id):
                raise ValueError(f"region {region.name!r} is not in the arena's memory")
            slots = rows_group.slots[rows]
        except (ValueError, IndexError) as exc:
            # The slot was taken from the granted set above: it must go back, and the sender
            # must hear "no", whatever was wrong with the note.
            arena.free_in.append(slot)
            inbound.no.append(chunk)
            wait.attempt.conclude(Failed(f"packed chunk {chunk} from {sender!r}: {exc}", wait.masks()))
            return None
        return Landing(wait, chunk, slot, group, rows, region, slots)


def _scatter(arena: Arena, landings: list[Landing]) -> None:
    """Every landing's slot into its rows (a geometry's: into its layout); RowCopyError."""
    rows = [x for x in landings if x.segments is None]
    if rows:
        arena.scatter([(x.slot, x.region, x.slots) for x in rows])
    if len(rows) < len(landings):
        arena.transform(scatter_calls(arena, [x for x in landings if x.segments is not None]))


def _landed(x: Landing) -> int:
    """Mark a scattered landing's rows in place; its bytes."""
    inbound = x.wait.inbound
    if x.segments is not None:
        inbound.scattered = inbound.shaped.mark(*x.segments)
        return packed_bytes(inbound.shaped.transform.plan, *x.segments)
    inbound.scattered[x.group][x.rows] = True
    return int(x.rows.size) * x.region.slot_bytes
