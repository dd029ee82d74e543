"""The packed NIXL path with two real agents in this process: bytes exact through the bounce
arenas, exact masks on faults and cancels, arena slots reused on credits, the automatic
choice of path, and the helpers' refusals."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from kvxfer.backends.common.attempt import TrackedAttempt
from kvxfer.backends.nixl import NixlBackend
from kvxfer.backends.nixl.agent import PeerUnknown
from kvxfer.backends.nixl.packed import (
    ARENA_EXTRA,
    ArenaInfo,
    PackedJob,
    rows_from_runs,
    runs_of,
)
from kvxfer.backends.nixl.packed_notes import NOTE_PREFIX, decode_note, encode_note
from kvxfer.contract import (
    CacheKind,
    Cancelled,
    Delivered,
    Failed,
    InvalidSubmission,
    LayerGroupRows,
    MemoryKind,
    TokenRange,
    TransferMode,
    View,
)
from kvxfer.testing.memory import HostRows, shut_down_keeping
from kvxfer.testing.nixl_pairs import host_rows
from kvxfer.testing.progress_hold import hold_progress
from kvxfer.testing.waiting import settle

ROW = 4096
SLOTS = 256
SENTINEL = 0xA5
_GATES: list[threading.Event] = []  # held progress threads, all released at a test's end
# Memory a backend registered, kept until it has shut down (and for good where an attempt was
# left unquiesced): a test's helpers drop their reference while a push may still read it, and
# freed rows are soon reused (CI saw a Delivered push with wrong bytes that way).
_KEPT: list[HostRows] = []


@pytest.fixture
def made() -> Iterator[list[NixlBackend]]:
    backends: list[NixlBackend] = []
    yield backends
    for gate in _GATES:  # also when the test failed while one was held: shutdown joins the thread
        gate.set()
    _GATES.clear()
    left = shut_down_keeping(backends, _KEPT)
    assert left == [frozenset()] * len(backends), "an attempt was left unquiesced"
    assert not [t for t in threading.enumerate() if t.name.startswith("kvxfer-nixl-")], "a progress thread lives on"


def _backend(made: list[NixlBackend], name: str, row: int = ROW, **options: object) -> tuple[NixlBackend, HostRows]:
    memory = host_rows(((f"{name}0", row, SLOTS), (f"{name}1", row // 2, SLOTS)))
    options = {"arena_bytes": 1 << 20, "packed_chunk_bytes": 64 << 10, **options}
    backend = NixlBackend(mode=TransferMode.PUSH, **options)  # type: ignore[arg-type]
    backend.register(memory.regions)
    made.append(backend)
    _KEPT.append(memory)
    return backend, memory


def _view(memory: HostRows, request: str, rows: int, seed: int, skip: int = 0, contiguous: bool = False,
          part: int = 0) -> View:
    """``rows`` ordinals per group in scattered slots (or one contiguous run); the first ``skip``
    ordinals left out (a prefix this end already holds). Views of one seed and different
    ``part`` use disjoint slots."""
    rng = np.random.default_rng(seed)
    groups = []
    for i, region in enumerate(memory.regions):
        slots = np.arange(7, 7 + rows) if contiguous else rng.permutation(region.slots)[part * rows:(part + 1) * rows]
        groups.append(LayerGroupRows(f"g{i}", CacheKind.PAGED, region, slots[skip:].astype(np.int64),
                                     np.arange(skip, rows, dtype=np.int64)))
    return View(request, TokenRange(0, rows * 16), tuple(groups), b"L")


def _fill(memory: HostRows, view: View, seed: int) -> dict[str, bytes]:
    rng = np.random.default_rng(seed)
    out = {}
    for g in view.groups:
        out[g.layer_group] = rng.integers(0, 256, len(g) * g.region.slot_bytes, dtype=np.uint8).tobytes()
        memory.write(g.region.name, g.slots, out[g.layer_group])
    return out


def _sentinel(memory: HostRows, view: View) -> None:
    for g in view.groups:
        memory.write(g.region.name, g.slots, bytes([SENTINEL]) * (len(g) * g.region.slot_bytes))


def _push(pub: NixlBackend, pview: View, fet: NixlBackend, fview: View) -> tuple[object, object, object, object]:
    fhint = fet.describe(fview)
    waiting = fet.fetch(fview, pub.describe(pview))
    sending = pub.publish(pview, fhint)
    assert sending.wait(10.0) and waiting.wait(10.0), "the push did not conclude and quiesce"
    return sending, waiting, sending.poll(), waiting.poll()


def _rows(memory: HostRows, group: LayerGroupRows, rows: np.ndarray) -> bytes:
    return memory.read(group.region.name, group.slots[rows])


def test_packed_push_scattered_rows_two_groups_prefix_held_byte_exact(made: list[NixlBackend]) -> None:
    pub, pmem = _backend(made, "P", packed="always")
    fet, fmem = _backend(made, "F", packed="always")
    rows, held = 100, 30
    pview = _view(pmem, "prefix", rows, 1)
    fview = _view(fmem, "prefix", rows, 2, skip=held)  # the fetcher holds the first 30 blocks
    payload = _fill(pmem, pview, 3)
    _sentinel(fmem, fview)
    sending, waiting, mine, theirs = _push(pub, pview, fet, fview)
    assert isinstance(mine, Delivered) and isinstance(theirs, Delivered) and theirs.all_delivered, (mine, theirs)
    # Only the rows the fetcher lacks moved (publisher's rows `held:`), each byte for byte.
    assert [int(m.sum()) for m in mine.masks] == [rows - held] * 2 and not any(m[:held].any() for m in mine.masks)
    for pg, fg in zip(pview.groups, fview.groups):
        size = fg.region.slot_bytes
        assert fmem.read(fg.region.name, fg.slots) == payload[pg.layer_group][held * size:]
    assert pub.path_of(sending) == "packed" and fet.path_of(waiting) == "packed"  # type: ignore[arg-type]
    sent, landed = pub.stats(), fet.stats()
    moved = (rows - held) * (ROW + ROW // 2)
    assert sent.packed_submissions == 1 and sent.unpacked_submissions == 0 and sent.bytes_sent == moved
    assert landed.packed_received == 1 and landed.bytes_scattered == moved
    assert landed.chunks_scattered == sent.chunks_sent >= 2  # one chunk cannot hold both groups


def test_hint_advertises_the_arena(made: list[NixlBackend]) -> None:
    fet, fmem = _backend(made, "F")
    info = ArenaInfo.of(fet.describe(_view(fmem, "hint", 4, 5)))
    assert info is not None and info.memory_kind is MemoryKind.HOST and info.slot_bytes == 64 << 10
    assert info.slots == 16 and info.nbytes == 1 << 20


@pytest.mark.parametrize("limit", [5, 16, 37])
def test_injected_fault_mid_way_masks_exact(made: list[NixlBackend], limit: int) -> None:
    # Chunks of 16 rows of the first group: the fault lands inside a chunk, on a boundary,
    # and in a later chunk; both ends report exactly the first `limit` rows, all of them in place.
    pub, pmem = _backend(made, "P", packed="always", fail_after_rows=limit)
    fet, fmem = _backend(made, "F", packed="always")
    pview, fview = _view(pmem, "fault", 60, 6), _view(fmem, "fault", 60, 7)
    payload = _fill(pmem, pview, 8)
    _sentinel(fmem, fview)
    _, _, mine, theirs = _push(pub, pview, fet, fview)
    expected = np.zeros(60, dtype=bool)
    expected[:limit] = True
    for outcome in (mine, theirs):
        assert isinstance(outcome, Failed) and "injected fault" in outcome.reason, outcome
        assert np.array_equal(outcome.masks[0], expected) and not outcome.masks[1].any()
    g = fview.groups[0]
    assert _rows(fmem, g, np.arange(limit)) == payload["g0"][: limit * ROW]
    assert _rows(fmem, g, np.arange(limit, 60)) == bytes([SENTINEL]) * ((60 - limit) * ROW)


def test_cancel_mid_way_both_ends_report_the_scattered_chunks(made: list[NixlBackend]) -> None:
    pub, pmem = _backend(made, "P", packed="always", chunk_pause_s=0.05)
    fet, fmem = _backend(made, "F", packed="always")
    # The sender stops once a chunk is acknowledged: it cannot finish before the cancel lands.
    held, gate = hold_progress(pub, gates=_GATES, ready=lambda: any(job.done for job in list(pub._active)))
    pview, fview = _view(pmem, "cancel", 200, 9), _view(fmem, "cancel", 200, 10)
    payload = _fill(pmem, pview, 11)
    _sentinel(fmem, fview)
    fhint = fet.describe(fview)
    waiting = fet.fetch(fview, pub.describe(pview))
    sending = pub.publish(pview, fhint)
    assert held.wait(10.0), "no chunk was acknowledged"
    sending.cancel()
    gate.set()
    assert sending.wait(10.0) and waiting.wait(10.0)
    mine, theirs = sending.poll(), waiting.poll()
    assert isinstance(mine, Cancelled) and isinstance(theirs, Cancelled) and theirs.by_peer, (mine, theirs)
    assert 0 < mine.rows_delivered < 400
    for a, b in zip(mine.masks, theirs.masks):
        assert np.array_equal(a, b), "the two ends disagree on which rows are in place"
    for i, (pg, fg) in enumerate(zip(pview.groups, fview.groups)):
        size = fg.region.slot_bytes
        got = fmem.read(fg.region.name, fg.slots)
        for r in range(len(fg)):
            row = got[r * size:(r + 1) * size]
            assert row == (payload[pg.layer_group][r * size:(r + 1) * size] if theirs.masks[i][r]
                           else bytes([SENTINEL]) * size), f"group {i} row {r}"


def test_fetcher_cancel_mid_way_later_chunks_dropped_unscattered(made: list[NixlBackend]) -> None:
    # The receiver concludes at its cancel with the rows it scattered; chunks still in flight are
    # acknowledged "not scattered" and their rows stay untouched, so both ends report the same rows.
    # Two landing slots of 2-4 rows and slow polling: ~75 credit rounds of a few ms, chunks
    # always in flight when the cancel lands.
    opts = {"packed": "always", "arena_bytes": 32 << 10, "packed_chunk_bytes": 8 << 10, "poll_s": 0.002}
    pub, pmem = _backend(made, "P", **opts)
    fet, fmem = _backend(made, "F", **opts)
    # The receiver stops once it scattered a chunk (it grants no slot and concludes nothing
    # meanwhile, so the push cannot end before the cancel lands).
    held, gate = hold_progress(fet, gates=_GATES, ready=lambda: fet.stats().chunks_scattered > 0)
    pview, fview = _view(pmem, "fcancel", 200, 15), _view(fmem, "fcancel", 200, 16)
    payload = _fill(pmem, pview, 17)
    _sentinel(fmem, fview)
    fhint = fet.describe(fview)
    waiting = fet.fetch(fview, pub.describe(pview))
    sending = pub.publish(pview, fhint)
    assert held.wait(10.0), "no chunk was scattered"
    waiting.cancel()
    gate.set()
    assert sending.wait(10.0) and waiting.wait(10.0)
    mine, theirs = sending.poll(), waiting.poll()
    assert isinstance(theirs, Cancelled) and not theirs.by_peer, theirs
    assert isinstance(mine, Cancelled) and mine.by_peer, mine
    assert 0 < theirs.rows_delivered < 400
    for a, b in zip(mine.masks, theirs.masks):
        assert np.array_equal(a, b), "the two ends disagree on which rows are in place"
    time.sleep(0.1)  # nothing may land after the outcome: rows reported False stay untouched
    for i, (pg, fg) in enumerate(zip(pview.groups, fview.groups)):
        size = fg.region.slot_bytes
        got = fmem.read(fg.region.name, fg.slots)
        for r in range(len(fg)):
            row = got[r * size:(r + 1) * size]
            assert row == (payload[pg.layer_group][r * size:(r + 1) * size] if theirs.masks[i][r]
                           else bytes([SENTINEL]) * size), f"group {i} row {r}"


def test_small_arena_reuses_slots_on_credits_bytes_exact(made: list[NixlBackend]) -> None:
    # Two landing slots of 8 KiB at the fetcher and 2 gather slots at the publisher: 4 MiB of
    # 4 KiB rows need ~500 chunks, so every slot is granted, scattered and granted again.
    opts = {"packed": "always", "arena_bytes": 32 << 10, "packed_chunk_bytes": 8 << 10}
    pub, pmem = _backend(made, "P", **opts)
    fet, fmem = _backend(made, "F", **opts)
    pview, fview = _view(pmem, "credits", 256, 12), _view(fmem, "credits", 256, 13)
    payload = _fill(pmem, pview, 14)
    _sentinel(fmem, fview)
    _, _, mine, theirs = _push(pub, pview, fet, fview)
    assert isinstance(mine, Delivered) and isinstance(theirs, Delivered) and theirs.all_delivered
    for pg, fg in zip(pview.groups, fview.groups):
        assert fmem.read(fg.region.name, fg.slots) == payload[pg.layer_group]
    sent, landed = pub.stats(), fet.stats()
    chunks = 256 // 2 + 256 // 4  # 8 KiB slots: 2 rows of 4 KiB, 4 rows of 2 KiB
    assert sent.chunks_sent == landed.chunks_scattered == landed.credits_granted == chunks


def test_auto_picks_packed_for_scattered_rows_and_unpacked_for_runs(made: list[NixlBackend]) -> None:
    pub, pmem = _backend(made, "P", packed_min_descriptors=8)
    fet, fmem = _backend(made, "F", packed_min_descriptors=8)
    for i, (contiguous, rows, path) in enumerate([(True, 100, "unpacked"), (False, 100, "packed"),
                                                  (False, 4, "unpacked")]):
        pview = _view(pmem, f"auto{i}", rows, 20 + i, contiguous=contiguous)
        fview = _view(fmem, f"auto{i}", rows, 30 + i, contiguous=contiguous)
        payload = _fill(pmem, pview, 40 + i)
        before = pub.stats()
        sending, waiting, mine, theirs = _push(pub, pview, fet, fview)
        assert isinstance(theirs, Delivered) and theirs.all_delivered
        for pg, fg in zip(pview.groups, fview.groups):
            assert fmem.read(fg.region.name, fg.slots) == payload[pg.layer_group]
        assert pub.path_of(sending) == path, (contiguous, rows)  # type: ignore[arg-type]
        after = pub.stats()
        assert (after.packed_submissions - before.packed_submissions, after.unpacked_submissions
                - before.unpacked_submissions) == ((1, 0) if path == "packed" else (0, 1))
        assert fet.path_of(waiting) == path  # type: ignore[arg-type]




def _landing_slots_free(backend: NixlBackend) -> bool:
    arena = backend._arena
    return arena is not None and len(arena.free_in) == arena.landing_slots


@dataclass
class AheadPush:
    """A push whose fetch() was registered first, and had its slots granted ahead."""

    pub: NixlBackend
    fet: NixlBackend
    pmem: HostRows  # held here: the backends only registered its memory
    fmem: HostRows
    pview: View
    fview: View
    payload: dict[str, bytes]
    fhint: Any = None
    sending: Any = None
    waiting: Any = None

    def publish(self) -> tuple[Any, Any]:
        self.sending = self.pub.publish(self.pview, self.fhint)
        assert self.sending.wait(10.0) and self.waiting.wait(10.0), "the push did not conclude and quiesce"
        for pg, fg in zip(self.pview.groups, self.fview.groups):
            assert self.fmem.read(fg.region.name, fg.slots) == self.payload[pg.layer_group]
        return self.sending.poll(), self.waiting.poll()


def _introduce(pub: NixlBackend, pmem: HostRows, fet: NixlBackend, fmem: HostRows) -> None:
    """One small push, so that the fetcher has heard from the publisher (slots are granted
    ahead only to a sender that has notified us: it can then answer a withdrawal)."""
    pview, fview = _view(pmem, "hello", 2, 1, contiguous=True), _view(fmem, "hello", 2, 1, contiguous=True)
    _, _, mine, theirs = _push(pub, pview, fet, fview)
    assert isinstance(mine, Delivered) and isinstance(theirs, Delivered), (mine, theirs)


def _fetch_ahead(made: list[NixlBackend], request: str, seed: int, contiguous: bool = False) -> AheadPush:
    """8 landing slots of 64 KiB, 100 rows a group: the fetch is granted 4 slots ahead."""
    pub, pmem = _backend(made, "P", packed_min_descriptors=8)
    fet, fmem = _backend(made, "F", packed_min_descriptors=8)
    _introduce(pub, pmem, fet, fmem)
    pview = _view(pmem, request, 100, seed, contiguous=contiguous)
    fview = _view(fmem, request, 100, seed + 1, contiguous=contiguous)
    push = AheadPush(pub, fet, pmem, fmem, pview, fview, _fill(pmem, pview, seed + 2))
    _sentinel(fmem, fview)
    push.fhint = fet.describe(fview)
    push.waiting = fet.fetch(fview, pub.describe(pview))
    assert settle(lambda: fet.stats().credits_ahead == 4 and pub._early_credits), "no slots granted ahead"
    return push


def test_fetch_grants_slots_ahead_and_the_push_starts_on_them(made: list[NixlBackend]) -> None:
    # A 100-row scattered fetch registered first gets 4 of the 8 landing slots at once, before
    # the publisher asks. The push uses them, every row lands, and every slot is free again
    # afterwards: no slot granted twice, none stranded.
    push = _fetch_ahead(made, "ahead", 70)
    mine, theirs = push.publish()
    assert isinstance(mine, Delivered) and isinstance(theirs, Delivered) and theirs.all_delivered, (mine, theirs)
    assert push.pub.path_of(push.sending) == "packed" and push.fet.path_of(push.waiting) == "packed"
    sent, landed = push.pub.stats(), push.fet.stats()
    assert landed.credits_ahead == 4 and landed.credits_granted == sent.chunks_sent == landed.chunks_scattered
    assert not push.pub._early_credits and settle(lambda: _landing_slots_free(push.fet))


def test_slots_granted_ahead_come_back_when_the_push_goes_unpacked(made: list[NixlBackend]) -> None:
    # The publisher has an arena, so the fetcher grants ahead; its rows are contiguous, so it
    # goes unpacked: the fetcher concludes on the record and takes its slots back.
    push = _fetch_ahead(made, "back", 73, contiguous=True)
    _, theirs = push.publish()
    assert isinstance(theirs, Delivered) and theirs.all_delivered, theirs
    assert push.pub.path_of(push.sending) == "unpacked" and push.fet.path_of(push.waiting) == "unpacked"
    assert push.fet.stats().packed_received == 0 and not push.pub._early_credits
    assert settle(lambda: _landing_slots_free(push.fet))


def test_slots_granted_ahead_but_lost_by_the_sender_are_granted_again(made: list[NixlBackend]) -> None:
    # The sender's table of early grants is bounded; one it dropped must not leave its push
    # waiting for slots the receiver thinks it has: the request says how many it holds.
    push = _fetch_ahead(made, "lost", 76)
    push.pub._early_credits.clear()  # as if evicted
    mine, theirs = push.publish()
    assert isinstance(mine, Delivered) and isinstance(theirs, Delivered) and theirs.all_delivered, (mine, theirs)
    assert settle(lambda: _landing_slots_free(push.fet))


def test_slots_granted_ahead_hold_at_most_half_the_landing_slots(made: list[NixlBackend]) -> None:
    # Three fetches wait for one publisher: the first takes 4 of the 8 landing slots ahead, the
    # others none. All three pushes then land byte for byte on credits asked for as usual.
    pub, pmem = _backend(made, "P", packed_min_descriptors=8)
    fet, fmem = _backend(made, "F", packed_min_descriptors=8)
    _introduce(pub, pmem, fet, fmem)
    pairs, waits, hints = [], [], []
    for i in range(3):
        pview, fview = _view(pmem, f"half{i}", 60, 80, part=i), _view(fmem, f"half{i}", 60, 90, part=i)
        pairs.append((pview, fview, _fill(pmem, pview, 100 + i)))
        hints.append(fet.describe(fview))
        waits.append(fet.fetch(fview, pub.describe(pview)))
    assert settle(lambda: fet.stats().credits_ahead == 4)
    time.sleep(0.05)  # a negative: nothing signals "granted no more", so give a wrong grant a moment
    assert fet.stats().credits_ahead == 4, "more than half the landing slots were granted ahead"
    sends = [pub.publish(pview, hint) for (pview, _, _), hint in zip(pairs, hints)]
    for sending, waiting, (pview, fview, payload) in zip(sends, waits, pairs):
        assert sending.wait(10.0) and waiting.wait(10.0)
        assert isinstance(waiting.poll(), Delivered) and isinstance(sending.poll(), Delivered)
        for pg, fg in zip(pview.groups, fview.groups):
            assert fmem.read(fg.region.name, fg.slots) == payload[pg.layer_group]
    assert settle(lambda: _landing_slots_free(fet))


def test_no_slots_ahead_for_a_sender_never_heard_from_and_its_withdrawal_is_asked_again(
        made: list[NixlBackend]) -> None:
    # First contact: the publisher has never notified the fetcher (it never loaded its
    # metadata), so it could not answer a withdrawal. The fetch is granted nothing ahead, so a
    # wait that ends unasked strands no landing slot. The withdrawal is sent again until it
    # is answered: once the publisher has pushed something else to the fetcher, it answers
    # and the cancelled wait quiesces.
    pub, pmem = _backend(made, "P", packed_min_descriptors=8)
    fet, fmem = _backend(made, "F", packed_min_descriptors=8, heartbeat_s=0.05)
    pview, fview = _view(pmem, "gone", 100, 1), _view(fmem, "gone", 100, 2)
    fhint = fet.describe(fview)
    waiting = fet.fetch(fview, pub.describe(pview))
    time.sleep(0.3)  # a negative: nothing signals "granted nothing ahead", so give a wrong grant time
    assert fet.stats().credits_ahead == 0 and _landing_slots_free(fet)
    waiting.cancel()
    assert settle(lambda: waiting.poll() is not None)
    assert isinstance(waiting.poll(), Cancelled) and _landing_slots_free(fet)
    assert not waiting.quiesced(), "quiesced before the publisher said it will not write"
    # The publisher pushes another transfer: now it knows the fetcher, and the next ask is answered.
    _introduce(pub, pmem, fet, fmem)
    assert settle(waiting.quiesced), "the withdrawal was not asked again, or not answered"
    with pytest.raises(InvalidSubmission, match="withdrew"):  # the publisher will not write it later either
        pub.publish(pview, fhint)
    assert settle(lambda: _landing_slots_free(fet))


def test_malformed_chunk_note_fails_the_wait_by_name_and_frees_every_slot(made: list[NixlBackend]) -> None:
    # A buggy or hostile sender's chunk note whose runs wrap around int64 comes in the same
    # batch as a good one. The wait fails naming the bad chunk; no row is scattered into it
    # after that (its masks are final: none), both landing slots are free again, and the
    # progress thread goes on: a later push lands byte for byte.
    pub, pmem = _backend(made, "P", packed_min_descriptors=8)
    fet, fmem = _backend(made, "F", packed_min_descriptors=8)
    _introduce(pub, pmem, fet, fmem)
    pview, fview = _view(pmem, "bad", 100, 3), _view(fmem, "bad", 100, 4)
    _sentinel(fmem, fview)
    fhint = fet.describe(fview)
    waiting = fet.fetch(fview, pub.describe(pview))
    assert settle(lambda: fet.stats().credits_ahead == 4 and pub._early_credits)
    grant = list(pub._early_credits.values())[0]
    good_s, good_l = runs_of(np.arange(0, 4, dtype=np.int64))
    bad_s, bad_l = np.array([2**63 - 1], dtype=np.int64).tobytes(), np.array([1], dtype=np.int64).tobytes()
    # Both notes reach the fetcher's next step together: its agent hands over what arrived
    # only once both chunk notes are in, whenever each arrives.
    notifications, together = fet._agent.notifications, threading.Event()
    kept: dict[str, list[bytes]] = {}

    def both_or_none() -> dict[str, list[bytes]]:
        if together.is_set():
            return notifications()
        for sender, messages in notifications().items():
            kept.setdefault(sender, []).extend(messages)
        if sum(m.startswith(NOTE_PREFIX) and decode_note(m)["k"] == "chunk" for m in kept.get(pub.name, [])) < 2:
            return {}
        together.set()
        return dict(kept)

    fet._agent.notifications = both_or_none  # type: ignore[method-assign]
    pub._agent.notify(fet.name, encode_note("chunk", t=fhint.transfer_id, c=0, s=grant[1], g=0, rs=good_s, rl=good_l))
    pub._agent.notify(fet.name, encode_note("chunk", t=fhint.transfer_id, c=1, s=grant[0], g=0, rs=bad_s, rl=bad_l))
    assert together.wait(10.0), "the two chunk notes did not both arrive"
    assert settle(lambda: waiting.poll() is not None)
    outcome = waiting.poll()
    assert isinstance(outcome, Failed) and "packed chunk 1" in outcome.reason, outcome
    assert not any(m.any() for m in outcome.masks) and fet.stats().chunks_scattered == 0
    assert fmem.read("F0", fview.groups[0].slots) == bytes([SENTINEL]) * (100 * ROW)
    assert grant[0] in fet._arena.free_in and grant[1] in fet._arena.free_in  # type: ignore[union-attr]
    later = _view(pmem, "after", 100, 5, part=1), _view(fmem, "after", 100, 6, part=1)
    payload = _fill(pmem, later[0], 7)
    _, _, mine, theirs = _push(pub, later[0], fet, later[1])
    assert isinstance(mine, Delivered) and isinstance(theirs, Delivered), (mine, theirs)
    assert fmem.read("F0", later[1].groups[0].slots) == payload["g0"]
    pub.shutdown()  # the bad transfer is never published: the publisher's end ends the withdrawal
    assert settle(waiting.quiesced, 10.0) and settle(lambda: _landing_slots_free(fet))


def test_never_and_peer_without_arena_stay_unpacked(made: list[NixlBackend]) -> None:
    pub, pmem = _backend(made, "P", packed="never")
    fet, fmem = _backend(made, "F", arena_bytes=0)
    other, omem = _backend(made, "O", packed="always")
    for sender, smem, request in ((pub, pmem, "never"), (other, omem, "no-arena")):
        sview, fview = _view(smem, request, 50, 50), _view(fmem, request, 50, 51)
        sending, _, _, theirs = _push(sender, sview, fet, fview)
        assert isinstance(theirs, Delivered) and sender.path_of(sending) == "unpacked"  # type: ignore[arg-type]
    assert fet.stats().packed_received == 0


def test_malformed_arena_extra_refused(made: list[NixlBackend]) -> None:
    pub, pmem = _backend(made, "P", packed="always")
    fet, fmem = _backend(made, "F")
    pview, fview = _view(pmem, "bad", 8, 60), _view(fmem, "bad", 8, 61)
    good = fet.describe(fview)
    pub.describe(pview)
    bad = dataclasses.replace(good, extras=((ARENA_EXTRA, b"short"),))
    with pytest.raises(InvalidSubmission, match="nixl.arena"):
        pub.publish(pview, bad)


def test_arena_options_checked() -> None:
    with pytest.raises(ValueError, match="packed must be"):
        NixlBackend(packed="sometimes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="at least 2 slots"):
        NixlBackend(arena_bytes=4 << 20, packed_chunk_bytes=4 << 20)


def test_runs_round_trip_and_refusals() -> None:
    rng = np.random.default_rng(0)
    for rows in (np.arange(5, 40), np.sort(rng.choice(1000, 300, replace=False)), rng.permutation(64)):
        rows = rows.astype(np.int64)
        starts, lengths = runs_of(rows)
        assert np.array_equal(rows_from_runs(starts, lengths, 1000), rows)
    assert len(runs_of(np.arange(100, dtype=np.int64))[0]) == 8  # one run for consecutive rows
    starts, lengths = runs_of(np.arange(10, 20, dtype=np.int64))
    with pytest.raises(ValueError, match="outside"):
        rows_from_runs(starts, lengths, 15)
    with pytest.raises(ValueError, match="malformed"):
        rows_from_runs(starts, lengths[:4], 100)
    with pytest.raises(ValueError, match="outside"):
        rows_from_runs(np.array([-1], dtype=np.int64).tobytes(), np.array([2], dtype=np.int64).tobytes(), 100)
    with pytest.raises(ValueError, match="outside"):  # start + length wraps around int64
        rows_from_runs(np.array([2**63 - 1], dtype=np.int64).tobytes(), np.array([1], dtype=np.int64).tobytes(), 100)


def test_auto_default_on_host_packs_only_very_small_descriptors(made: list[NixlBackend]) -> None:
    # Host default (MIN_DESCRIPTORS): 2,048 descriptors per chunk. Chunks of 2,048 rows of 256
    # bytes at even slots (nothing coalesces): a full chunk goes packed, half a chunk does not.
    ends = []
    for name in ("P", "F"):
        memory = host_rows(((name, 256, 4096),))
        backend = NixlBackend(mode=TransferMode.PUSH, chunk_bytes=2048 * 256, arena_bytes=1 << 20,
                              packed_chunk_bytes=64 << 10)
        backend.register(memory.regions)
        made.append(backend)
        ends.append((backend, memory))
    (pub, pmem), (fet, fmem) = ends
    rng = np.random.default_rng(70)
    for rows, path in ((2048, "packed"), (1024, "unpacked")):
        views = [View(f"host-{rows}", TokenRange(0, rows * 16), (LayerGroupRows(
            "g", CacheKind.PAGED, m.regions[0], (2 * rng.permutation(2048)[:rows]).astype(np.int64),
            np.arange(rows, dtype=np.int64)),), b"L") for m in (pmem, fmem)]
        payload = _fill(pmem, views[0], rows)
        sending, _, _, theirs = _push(pub, views[0], fet, views[1])
        assert isinstance(theirs, Delivered) and pub.path_of(sending) == path  # type: ignore[arg-type]
        g = views[1].groups[0]
        assert fmem.read(g.region.name, g.slots) == payload["g"]


def test_notes_decode_within_bounds() -> None:
    # A credit note round-trips; a note of nested arrays (8 wide, 6 deep: 300 KB of one-byte
    # empty arrays, some 19 MB as Python lists) is refused by name before it is built.
    note = decode_note(encode_note("credit", t="x", grant=[1, 2], ok=[0], no=[]))
    assert note == {"k": "credit", "t": "x", "grant": [1, 2], "ok": [0], "no": []}
    bomb = b"\x90"
    for _ in range(6):
        bomb = b"\x98" + bomb * 8
    with pytest.raises(ValueError, match="more than 4 arrays and maps"):
        decode_note(NOTE_PREFIX + b"\x82\xa1k\xa6credit\xa1t" + bomb)


def test_a_credit_note_that_could_not_be_sent_stays_owed_and_goes_with_the_next(
        made: list[NixlBackend], monkeypatch: pytest.MonkeyPatch) -> None:
    # With etcd a fetcher may owe a note to a sender whose metadata its agent does not hold
    # (PeerUnknown). What the note said (its grant here) must go with the next one: a note
    # cleared before a failed send lost the grant, and the sender waited for slots until its
    # deadline. The fetcher's agent refuses its first two credit notes.
    pub, pmem = _backend(made, "P", packed="always", deadline_s=3.0)
    fet, fmem = _backend(made, "F", packed="always")
    refused: list[dict[str, Any]] = []
    notify = fet._agent.notify

    def flaky(peer: str, message: bytes) -> None:
        if message.startswith(NOTE_PREFIX) and decode_note(message)["k"] == "credit" and len(refused) < 2:
            refused.append(decode_note(message))
            raise PeerUnknown(f"agent {peer!r} is not loaded")
        notify(peer, message)

    monkeypatch.setattr(fet._agent, "notify", flaky)
    pview, fview = _view(pmem, "owed", 60, 120), _view(fmem, "owed", 60, 121)
    payload = _fill(pmem, pview, 122)
    _sentinel(fmem, fview)
    _, _, mine, theirs = _push(pub, pview, fet, fview)
    assert isinstance(mine, Delivered) and isinstance(theirs, Delivered) and theirs.all_delivered, (mine, theirs)
    assert len(refused) == 2 and refused[0]["grant"], refused
    assert refused[1]["grant"] == refused[0]["grant"], "the refused note was not sent again"
    for pg, fg in zip(pview.groups, fview.groups):
        assert fmem.read(fg.region.name, fg.slots) == payload[pg.layer_group]
    assert settle(lambda: _landing_slots_free(fet))


def test_a_bad_grant_does_not_drop_the_acknowledgements_of_its_note() -> None:
    # A credit note whose grant names a slot outside the peer's arena fails the push, but its
    # ok and no still count: the chunk the peer scattered is proven, and the job finishes now
    # instead of waiting until its deadline for acknowledgements it already received.
    remote = ArenaInfo(1 << 20, 4 * 4096, 4096, MemoryKind.HOST, 0)  # 4 slots
    hint = SimpleNamespace(agent="peer", transfer_id="t")
    job = PackedJob(TrackedAttempt(label="bad-grant"), None, hint, "WRITE", [None] * 3,  # type: ignore[arg-type]
                    time.monotonic() + 60, remote=remote, requested=True)
    job.next_chunk, job.written = 2, {0, 1}
    job.on_credit([2, 4], [0], [1])
    assert job.failure is not None and "outside its arena" in job.failure, job.failure
    assert job.done == [0] and not job.written and not job.credits
    assert job.finished


def test_a_withdrawn_transfer_forgets_the_slots_granted_to_it_ahead(made: list[NixlBackend]) -> None:
    # The fetcher grants 4 slots ahead, then its wait is cancelled before the publisher
    # publishes. Asked to withdraw, the publisher forgets those credits (they are the
    # fetcher's again once it answers): kept, they would sit in its table until evicted.
    push = _fetch_ahead(made, "withdrawn", 130)
    key = (push.fet.name, push.fhint.transfer_id)
    assert key in push.pub._early_credits
    push.waiting.cancel()
    assert settle(push.waiting.quiesced), "the withdrawal was not answered"
    assert isinstance(push.waiting.poll(), Cancelled)
    assert key not in push.pub._early_credits, "the withdrawn transfer's early credits were kept"
    assert settle(lambda: _landing_slots_free(push.fet))
    with pytest.raises(InvalidSubmission, match="withdrew"):
        push.pub.publish(push.pview, push.fhint)


def test_a_packed_push_failing_with_writes_in_flight_quiesces_only_once_they_ended(
        made: list[NixlBackend], monkeypatch: pytest.MonkeyPatch) -> None:
    # As the unpacked rule (test_nixl_backend's in-flight deadline test): UCX over TCP, and a
    # fetcher whose worker stops progressing once it granted slots, so the publisher's packed
    # WRITEs stay in flight past its deadline. The push fails at the deadline but quiesces only
    # once NIXL ended them (a released WRITE still lands).
    monkeypatch.setenv("UCX_TLS", "tcp")
    row, rows, slot = 64 << 10, 256, 1 << 20
    ends = []
    for name, deadline in (("P", 0.5), ("F", 30.0)):
        memory = host_rows(((name, row, rows),))
        backend = NixlBackend(mode=TransferMode.PUSH, packed="always", arena_bytes=8 * slot,
                              packed_chunk_bytes=slot, deadline_s=deadline)
        backend.register(memory.regions)
        made.append(backend)
        ends.append((backend, memory))
    (pub, pmem), (fet, fmem) = ends
    pview, fview = _view(pmem, "inflight", rows, 140), _view(fmem, "inflight", rows, 141)
    gate = threading.Event()
    step = fet._step

    def stalled() -> bool:
        if fet.stats().credits_granted:
            gate.wait()
        return step()

    monkeypatch.setattr(fet, "_step", stalled)
    try:
        fhint = fet.describe(fview)
        waiting = fet.fetch(fview, pub.describe(pview))
        sending = pub.publish(pview, fhint)
        assert settle(lambda: sending.poll() is not None, 10.0)
        outcome = sending.poll()
        assert isinstance(outcome, Failed) and "timeout" in outcome.reason, outcome
        assert pub.path_of(sending) == "packed"
        time.sleep(0.3)  # a negative: nothing signals "did not quiesce", so give a wrong quiescence time
        assert not sending.quiesced(), "quiesced while its WRITEs were still in flight"
    finally:
        gate.set()
    assert sending.wait(20.0), "never quiesced once the fetcher progressed"
    assert waiting.wait(20.0)
