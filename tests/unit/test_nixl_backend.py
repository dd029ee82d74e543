"""NixlBackend behaviour beyond the kit, with two real agents in this process: deadlines,
cancel mid-way, faults across chunk boundaries, early records, refusals and clean shutdown."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest

from kvxfer.backends.common.attempt import TrackedAttempt
from kvxfer.backends.nixl import NixlBackend
from kvxfer.backends.nixl.plan import ChunkBytes
from kvxfer.contract import (
    CacheKind,
    Cancelled,
    Delivered,
    Failed,
    InvalidSubmission,
    LayerGroupRows,
    MemoryKind,
    SlotRegion,
    TokenRange,
    TransferMode,
    View,
)
from kvxfer.testing.memory import HostRows, shut_down_keeping
from kvxfer.testing.nixl_pairs import host_rows
from kvxfer.testing.progress_hold import hold_progress
from kvxfer.testing.waiting import settle

ROW = 2048
ROWS = 24
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
    shut_down_keeping(backends, _KEPT)
    assert not [t for t in threading.enumerate() if t.name.startswith("kvxfer-nixl-")], "a progress thread lives on"


def _proven(backend: NixlBackend) -> bool:
    """Some chunk of the backend's active job is proven delivered (read on its progress thread)."""
    return any(job.done for job in list(backend._active))


def _backend(made: list[NixlBackend], mode: TransferMode, name: str, **options: object) -> tuple[NixlBackend, HostRows]:
    memory = host_rows(((f"{name}0", ROW, 64), (f"{name}1", ROW, 64)))
    backend = NixlBackend(mode=mode, **options)  # type: ignore[arg-type]
    backend.register(memory.regions)
    made.append(backend)
    _KEPT.append(memory)
    return backend, memory


def _view(memory: HostRows, request: str, seed: int) -> View:
    rng = np.random.default_rng(seed)
    groups = tuple(LayerGroupRows(f"g{i}", CacheKind.PAGED, r, rng.permutation(r.slots)[: ROWS // 2],
                                  np.arange(ROWS // 2)) for i, r in enumerate(memory.regions))
    return View(request, TokenRange(0, ROWS * 16), groups, b"L")


def _fill(memory: HostRows, view: View, seed: int) -> dict[str, bytes]:
    rng = np.random.default_rng(seed)
    out = {}
    for g in view.groups:
        out[g.layer_group] = rng.integers(0, 256, len(g) * ROW, dtype=np.uint8).tobytes()
        memory.write(g.region.name, g.slots, out[g.layer_group])
    return out


def test_passive_deadline_fails_and_stays_unquiesced_until_the_peer_withdraws(made: list[NixlBackend]) -> None:
    fetcher, fmem = _backend(made, TransferMode.PUSH, "F", deadline_s=0.3)
    publisher, pmem = _backend(made, TransferMode.PUSH, "P")
    fview, pview = _view(fmem, "deadline", 1), _view(pmem, "deadline", 2)
    fhint = fetcher.describe(fview)
    attempt = fetcher.fetch(fview, publisher.describe(pview))
    assert settle(lambda: attempt.poll() is not None), "the 0.3 s deadline never ended the wait"
    outcome = attempt.poll()
    assert isinstance(outcome, Failed) and outcome.reason.startswith("timeout after 0.3s"), outcome
    assert outcome.rows_delivered == 0
    # The publisher never had our metadata, so it could not confirm: we must not claim quiescence.
    assert not attempt.quiesced()
    # Our withdrawal reaches the publisher (it needs only our knowing its metadata)...
    assert settle(lambda: (fetcher.name, fhint.transfer_id) in publisher._revoked), "no withdrawal arrived"
    # ...so its publish is refused (and tells us nothing); it loaded our metadata on the way, so
    # the withdrawal we ask again every heartbeat is now answered, and the wait quiesces.
    with pytest.raises(InvalidSubmission, match="withdrew"):
        publisher.publish(pview, fhint)
    assert attempt.wait(5.0), "the withdrawal was not answered once the publisher could"


def test_active_deadline_reports_exactly_the_chunks_done(made: list[NixlBackend]) -> None:
    fetcher, fmem = _backend(made, TransferMode.PULL, "F", deadline_s=0.5, chunk_bytes=5 * ROW,
                             chunk_pause_s=10.0)
    publisher, pmem = _backend(made, TransferMode.PULL, "P")
    fview, pview = _view(fmem, "stall", 3), _view(pmem, "stall", 4)
    payload = _fill(pmem, pview, 5)
    phint, fhint = publisher.describe(pview), fetcher.describe(fview)
    publisher.publish(pview, fhint)
    attempt = fetcher.fetch(fview, phint)
    assert attempt.wait(5.0)
    outcome = attempt.poll()
    assert isinstance(outcome, Failed) and "timeout" in outcome.reason
    assert outcome.masks[0][:5].all() and outcome.rows_delivered == 5  # the one chunk posted before the stall
    g = fview.groups[0]
    assert fmem.read(g.region.name, g.slots[:5]) == payload["g0"][: 5 * ROW]


@pytest.mark.parametrize("mode", list(TransferMode), ids=lambda m: m.value)
def test_cancel_mid_way_stops_new_chunks_and_both_ends_agree(made: list[NixlBackend], mode: TransferMode) -> None:
    active_op = "publish" if mode is TransferMode.PUSH else "fetch"
    a, amem = _backend(made, mode, "A", chunk_bytes=2 * ROW, chunk_pause_s=0.05)
    b, bmem = _backend(made, mode, "B")
    # The active end stops once a chunk is proven: it cannot finish before the cancel lands.
    held, gate = hold_progress(a, gates=_GATES, ready=lambda: _proven(a))
    aview, bview = _view(amem, "cancel", 6), _view(bmem, "cancel", 7)
    ahint, bhint = a.describe(aview), b.describe(bview)
    passive = (b.fetch if active_op == "publish" else b.publish)(bview, ahint)
    active = (a.publish if active_op == "publish" else a.fetch)(aview, bhint)
    assert held.wait(10.0), "no chunk was proven"
    active.cancel()
    gate.set()
    assert active.wait(5.0) and passive.wait(5.0)
    mine, theirs = active.poll(), passive.poll()
    assert isinstance(mine, Cancelled) and not mine.by_peer
    assert isinstance(theirs, Cancelled) and theirs.by_peer
    assert 0 < mine.rows_delivered < ROWS and mine.rows_delivered % 2 == 0
    assert mine.rows_delivered == theirs.rows_delivered


def test_injected_fault_across_chunk_boundaries_is_exact(made: list[NixlBackend]) -> None:
    pub, pmem = _backend(made, TransferMode.PUSH, "P", chunk_bytes=3 * ROW, fail_after_rows=7)
    fet, fmem = _backend(made, TransferMode.PUSH, "F")
    pview, fview = _view(pmem, "fault", 8), _view(fmem, "fault", 9)
    payload = _fill(pmem, pview, 10)
    fhint = fet.describe(fview)
    waiting = fet.fetch(fview, pub.describe(pview))
    attempt = pub.publish(pview, fhint)
    assert attempt.wait(5.0) and waiting.wait(5.0)
    for outcome in (attempt.poll(), waiting.poll()):
        assert isinstance(outcome, Failed) and outcome.rows_delivered == 7, outcome
        assert outcome.masks[0][:7].all() and not outcome.masks[1].any()
    g = fview.groups[0]
    assert fmem.read(g.region.name, g.slots[:7]) == payload["g0"][: 7 * ROW]


def test_record_before_fetch_is_stashed(made: list[NixlBackend]) -> None:
    pub, pmem = _backend(made, TransferMode.PUSH, "P")
    fet, fmem = _backend(made, TransferMode.PUSH, "F")
    pview, fview = _view(pmem, "early", 11), _view(fmem, "early", 12)
    payload = _fill(pmem, pview, 13)
    fhint, phint = fet.describe(fview), pub.describe(pview)
    published = pub.publish(pview, fhint)
    assert published.wait(5.0) and isinstance(published.poll(), Delivered)
    # The record reaches the fetcher before its fetch() exists.
    assert settle(lambda: fhint.transfer_id in fet._stashed, 10.0), "the record was not stashed"
    attempt = fet.fetch(fview, phint)
    assert attempt.wait(2.0) and isinstance(attempt.poll(), Delivered) and attempt.poll().all_delivered
    for g in fview.groups:
        assert fmem.read(g.region.name, g.slots) == payload[g.layer_group]


def test_device_memory_skipped_without_cuda(made: list[NixlBackend]) -> None:
    backend, mem = _backend(made, TransferMode.PUSH, "D")
    if MemoryKind.DEVICE in backend.capabilities.memory_kinds:
        pytest.skip("this machine has CUDA")
    vram = SlotRegion("vram", 1 << 40, 4096, 4, MemoryKind.DEVICE)
    assert backend.register([vram]) == (vram,)
    g = _view(mem, "after-skip", 3).groups[0]
    on_vram = View("after-skip", TokenRange(0, 16), (LayerGroupRows(g.layer_group, g.kind, vram, [0], [0]),), b"")
    with pytest.raises(InvalidSubmission, match="'vram', which is not registered"):
        backend.describe(on_vram)


def test_hint_with_a_known_peers_metadata_under_another_name_leaves_that_peer_loaded(
        made: list[NixlBackend]) -> None:
    pub, pmem = _backend(made, TransferMode.PUSH, "P")
    fet, fmem = _backend(made, TransferMode.PUSH, "F")
    pview, fview = _view(pmem, "known", 21), _view(fmem, "known", 22)
    payload = _fill(pmem, pview, 23)
    fhint, phint = fet.describe(fview), pub.describe(pview)
    assert pub._agent.ensure_peer(fet.name, fhint.endpoint)  # the fetcher is a known peer now
    forged = dataclasses.replace(fhint, agent="someone-else")
    with pytest.raises(InvalidSubmission, match="metadata is agent"):
        pub.publish(pview, forged)
    # The refusal must not have unloaded the real peer: its transfer still goes through.
    attempt = fet.fetch(fview, phint)
    published = pub.publish(pview, fhint)
    assert published.wait(10.0) and isinstance(published.poll(), Delivered), published.poll()
    assert attempt.wait(10.0) and isinstance(attempt.poll(), Delivered) and attempt.poll().all_delivered
    for g in fview.groups:
        assert fmem.read(g.region.name, g.slots) == payload[g.layer_group]


def test_a_stashed_record_concludes_on_the_progress_thread_not_inside_fetch(made: list[NixlBackend]) -> None:
    pub, pmem = _backend(made, TransferMode.PUSH, "P")
    fet, fmem = _backend(made, TransferMode.PUSH, "F")
    pview, fview = _view(pmem, "early-wake", 31), _view(fmem, "early-wake", 32)
    _fill(pmem, pview, 33)
    fhint, phint = fet.describe(fview), pub.describe(pview)
    published = pub.publish(pview, fhint)
    assert published.wait(5.0) and isinstance(published.poll(), Delivered)
    assert settle(lambda: fhint.transfer_id in fet._stashed, 10.0), "the record is not here first"
    woken_on: list[threading.Thread] = []
    attempt = fet.fetch(fview, phint, wake=lambda: woken_on.append(threading.current_thread()))
    assert attempt.wait(5.0) and isinstance(attempt.poll(), Delivered)
    # A wake inside fetch() would reach an owner that has no attempt yet (and may hold its own lock).
    assert woken_on and threading.current_thread() not in woken_on


def test_chunk_sizes_default_by_memory_and_bad_ones_are_refused(made: list[NixlBackend]) -> None:
    """chunk_bytes None: 16 MiB chunks, 256 MiB between device memory on both ends; an int
    applies to both; a size that is not positive, or not a size, is refused by name before an
    agent starts."""
    with pytest.raises(ValueError, match="chunk_bytes must be positive, got 0"):
        NixlBackend(mode=TransferMode.PUSH, chunk_bytes=0)
    with pytest.raises(ValueError, match="chunk sizes must be positive"):
        NixlBackend(mode=TransferMode.PUSH, chunk_bytes=ChunkBytes(host=-1))
    with pytest.raises(TypeError, match="chunk_bytes must be an int, a ChunkBytes or None, got 1.5"):
        NixlBackend(mode=TransferMode.PUSH, chunk_bytes=1.5)  # type: ignore[arg-type]
    assert not [t for t in threading.enumerate() if t.name.startswith("kvxfer-nixl-")]
    default, _ = _backend(made, TransferMode.PUSH, "D")
    assert default.chunk_bytes == ChunkBytes(16 << 20, 256 << 20)
    uniform, _ = _backend(made, TransferMode.PUSH, "U", chunk_bytes=3 * ROW)
    assert uniform.chunk_bytes == ChunkBytes(3 * ROW, 3 * ROW)


def _push(made: list[NixlBackend], request: str, seed: int, **publisher: object
          ) -> tuple[NixlBackend, HostRows, View, dict[str, bytes], TrackedAttempt, TrackedAttempt]:
    """A publisher (``publisher`` options) pushes filled rows to a waiting fetcher: (publisher,
    fetcher's memory, fetcher's view, payload by group, the publish and the fetch attempts)."""
    pub, pmem = _backend(made, TransferMode.PUSH, "P", **publisher)
    fet, fmem = _backend(made, TransferMode.PUSH, "F")
    pview, fview = _view(pmem, request, seed), _view(fmem, request, seed + 1)
    payload = _fill(pmem, pview, seed + 2)
    fhint = fet.describe(fview)
    waiting = fet.fetch(fview, pub.describe(pview))
    return pub, fmem, fview, payload, pub.publish(pview, fhint), waiting


@pytest.mark.parametrize("post_inline", [True, None, False], ids=["inline", "auto-host", "never"])
def test_post_inline_posts_a_push_from_publish_and_moves_the_same_bytes(made: list[NixlBackend],
                                                                        post_inline: bool | None) -> None:
    """post_inline=True: publish() itself posts at least the first ``window`` chunks (counted
    in stats); None posts inline only between device memory, so host rows go through the
    progress thread as with False. Either way both ends conclude Delivered, bytes exact,
    and an injected fault still reports exactly its rows."""
    pub, fmem, fview, payload, attempt, waiting = _push(made, "inline", 11, chunk_bytes=2 * ROW, window=3,
                                                        post_inline=post_inline)
    posted = pub.stats().chunks_posted_inline
    # At least a window's worth; more where a post completed at once (host memory may copy
    # inside NIXL's transfer()), up to all 12 chunks (2 groups of 12 rows, 2 rows a chunk).
    assert 3 <= posted <= 12 if post_inline else posted == 0, posted
    assert attempt.wait(5.0) and waiting.wait(5.0)
    for outcome in (attempt.poll(), waiting.poll()):
        assert isinstance(outcome, Delivered) and outcome.all_delivered, outcome
    for g in fview.groups:
        assert fmem.read(g.region.name, g.slots) == payload[g.layer_group]


def test_post_inline_with_an_injected_fault_and_a_bad_value(made: list[NixlBackend]) -> None:
    with pytest.raises(ValueError, match="post_inline must be None, True or False, got 'yes'"):
        NixlBackend(mode=TransferMode.PUSH, post_inline="yes")  # type: ignore[arg-type]
    pub, fmem, fview, payload, attempt, waiting = _push(made, "inline-fault", 14, chunk_bytes=3 * ROW,
                                                        fail_after_rows=7, post_inline=True)
    assert pub.stats().chunks_posted_inline == 3  # 7 rows in chunks of 3, window 4: all three from publish()
    assert attempt.wait(5.0) and waiting.wait(5.0)
    for outcome in (attempt.poll(), waiting.poll()):
        assert isinstance(outcome, Failed) and outcome.rows_delivered == 7, outcome
    g = fview.groups[0]
    assert fmem.read(g.region.name, g.slots[:7]) == payload["g0"][: 7 * ROW]


def test_a_request_still_in_flight_at_the_deadline_is_waited_for_before_quiescence(
        made: list[NixlBackend], monkeypatch: pytest.MonkeyPatch) -> None:
    # UCX over TCP, and a publisher whose worker does not progress for a while: the pull's
    # READs are still in flight when its deadline passes. NIXL does not abort a released
    # request (its bytes still land), so the fetch fails at the deadline but quiesces only
    # once its READs ended; from then on nothing of it writes the fetcher's rows.
    monkeypatch.setenv("UCX_TLS", "tcp")
    rows, row = 64, 1 << 20
    pub = NixlBackend(mode=TransferMode.PULL)
    fet = NixlBackend(mode=TransferMode.PULL, deadline_s=0.3, chunk_bytes=16 * row, window=2)
    made.extend([pub, fet])
    pmem, fmem = host_rows((("P0", row, rows),)), host_rows((("F0", row, rows),))
    pub.register(pmem.regions)
    fet.register(fmem.regions)
    pmem.buffers["P0"].array.fill(7)
    fmem.buffers["F0"].array.fill(0)

    def whole(memory: HostRows) -> View:
        region = memory.regions[0]
        ordinals = np.arange(rows, dtype=np.int64)
        return View("slow", TokenRange(0, 1), (LayerGroupRows("g0", CacheKind.PAGED, region, ordinals, ordinals),),
                    b"L")

    pv, fv = whole(pmem), whole(fmem)
    hint_p, hint_f = pub.describe(pv), fet.describe(fv)
    _, gate = hold_progress(pub, gates=_GATES, ready=lambda: True)  # a publisher busy elsewhere; the fixture releases it on failure
    publishing = pub.publish(pv, hint_f)
    fetching = fet.fetch(fv, hint_p)
    assert settle(lambda: fetching.poll() is not None, 10.0)
    outcome = fetching.poll()
    assert isinstance(outcome, Failed) and "timeout" in outcome.reason, outcome
    # A negative: nothing signals "did not quiesce", so give a wrong quiescence a moment to show.
    time.sleep(0.3)
    assert not fetching.quiesced(), "quiesced while its READs were still in flight"
    gate.set()
    assert fetching.wait(20.0), "never quiesced once the publisher progressed"
    landed = fmem.buffers["F0"].array.copy()
    time.sleep(0.5)  # a negative again: bytes that would land late are given time to
    assert np.array_equal(fmem.buffers["F0"].array, landed), "bytes landed after the fetch quiesced"
    assert publishing.wait(20.0)


def test_a_confirmation_that_comes_after_shutdown_is_applied_by_a_later_shutdown(made: list[NixlBackend]) -> None:
    # The decode end shuts down while its push wait is withdrawn but unconfirmed (the
    # publisher's progress thread is held): shutdown() reports the wait. Later calls make a
    # progress step each (UCX needs our side progressed to take the publisher's writes) and
    # apply the publisher's answer once it comes: the set becomes empty.
    pub, pmem = _backend(made, TransferMode.PUSH, "P")
    fet, fmem = _backend(made, TransferMode.PUSH, "F")
    pview, fview = _view(pmem, "late-confirm", 41), _view(fmem, "late-confirm", 42)
    _fill(pmem, pview, 43)
    hint_f, hint_p = fet.describe(fview), pub.describe(pview)
    held, gate = hold_progress(pub, gates=_GATES)
    publishing = pub.publish(pview, hint_f)
    assert held.wait(10.0)
    fetching = fet.fetch(fview, hint_p)
    assert fet.shutdown() == frozenset({fetching}) and not fetching.quiesced()
    assert not [t for t in threading.enumerate() if t.name == f"kvxfer-nixl-{fet.name}"]
    gate.set()
    assert settle(lambda: not fet.shutdown(), 20.0), "later shutdown() calls never applied the publisher's answer"
    assert fetching.quiesced() and isinstance(fetching.poll(), Cancelled)
    assert publishing.wait(20.0) and publishing.quiesced()
