"""The ucx backend: rows move between processes as UCX tag messages, through ucxx.

Whatever the mode, the publisher sends and the fetcher receives: one tag message per run of
rows contiguous at both ends (``runs``), straight from the publisher's slots into the
fetcher's, tagged with the transfer and the run's number. The fetcher takes each message
out of UCX's queue when it arrives and receives it into its rows only while its transfer is
live; a message for a transfer that ended, or that nobody described, is received into
scratch and dropped. So no peer can write into memory the fetcher has given back, and the
fetcher's masks are exactly the receives that completed.

PUSH: publish() starts sending at once. PULL: fetch() asks the publisher (a ``G`` control
message, with the fetcher's injected fault if any); the publisher sends once asked.

Control messages share one tag (``CONTROL_TAG``): ``R`` + a completion record (signed when
a key is set), ``G`` + a pull request, ``H`` (a heartbeat). Records name the receiver's
transfer id. The fetcher acknowledges every transfer when it concludes (DELIVERED, FAILED
or CANCELLED, with the rows it received, as masks over the publisher's hint groups): the
publisher's outcome is that acknowledgement, so both ends report the same rows. A publisher
that stops early (an injected fault, cancel, its deadline) first tells the fetcher which
rows it did send; the fetcher waits for those, then concludes and acknowledges.

A dead peer is seen when a send to it fails: sends of data, records and the heartbeats each
end sends while it waits (``heartbeat_s``). Memory: HOST, and DEVICE where ucxx was built
with CUDA and a device is present (tested on the GPU machine only, where the wheels are
carried as NIXL's are).

Options: ``error_handling`` (see Transport) False trades dead-peer detection for shared
memory. ``pack_bytes``: small host runs this end fetches come packed in messages of about this
size (0, the default: a message per run); its hints say so to the publisher. Off by default:
on the CPU machine it did not pay (bench/results/2026-12-01-cpu-ucx, run d), and it never
applies to device memory. ``integrity``: rows fetched here are checked against the
publisher's digests (``sums``); ``corrupt_landed`` is the integrity tests' fault hook.
"""

from __future__ import annotations

import functools
import logging
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

import numpy as np

from kvxfer.backends.common.attempt import TrackedAttempt
from kvxfer.backends.common.devices import cuda_present, unique_agent_name
from kvxfer.backends.common.engine import BackendEngine, ProgressThread
from kvxfer.backends.common.integrity import CorruptFn, RowCheck
from kvxfer.backends.common.matching import match_rows
from kvxfer.backends.common.transfers import DEFAULT_HINT_TTL_S, put_bounded
from kvxfer.backends.ucx.control import PullRequest, RunSums, decode_pull, decode_sums, encode_pull
from kvxfer.backends.ucx.early import EarlyMessages
from kvxfer.backends.ucx.jobs import (
    Receiving,
    Sending,
    acknowledged,
    acknowledgement,
    end_idle,
    ending,
    fits,
    stop_record,
    take_received,
    transfer_tag,
)
from kvxfer.backends.ucx.packing import gather, run_memory, split
from kvxfer.backends.ucx.runs import plan_runs
from kvxfer.backends.ucx.sums import SumsDesk
from kvxfer.backends.ucx.transport import (
    CONTROL_TAG,
    DATA_MASK,
    RUN_BITS,
    RUN_MASK,
    Transport,
    UcxPeerGone,
)
from kvxfer.contract import (
    Cancelled,
    CompletionRecord,
    Failed,
    Hint,
    InvalidSubmission,
    MemoryKind,
    Peer,
    SlotRegion,
    TransferMode,
    View,
    WakeFn,
)
from kvxfer.wire import WireError, decode_completion, encode_completion
from kvxfer.wire.auth import resolve_key

log = logging.getLogger(__name__)

BACKEND_KIND = "ucx"
EXTRA_PACK = "ucx.pack"  # in a fetcher's hint: the pack_bytes its messages are grouped by
IDLE_POLL_S = 0.005
KEPT = 4096  # pull requests before their publish(), described transfers awaiting their fetch()


class UcxBackend(BackendEngine):
    """A ucxx worker moving rows as tag messages, with a progress thread."""

    KIND = BACKEND_KIND
    TITLE = "ucx"

    def __init__(self, name: str | None = None, mode: TransferMode = TransferMode.PUSH, *, deadline_s: float = 30.0,
                 hint_ttl_s: float = DEFAULT_HINT_TTL_S, window: int = 64, heartbeat_s: float = 0.25,
                 fail_after_rows: int | None = None, poll_s: float = 0.0001, key: bytes | None = None,
                 error_handling: bool = True, pack_bytes: int = 0, integrity: bool = True,
                 corrupt_landed: CorruptFn | None = None) -> None:
        self.integrity = RowCheck(integrity, corrupt_landed)
        self._sums = SumsDesk(self.integrity, KEPT)
        if window <= 0 or deadline_s <= 0 or heartbeat_s <= 0 or poll_s < 0 or pack_bytes < 0:
            raise ValueError("window, deadline_s and heartbeat_s must be positive, poll_s and pack_bytes not negative")
        self.pack_bytes = pack_bytes
        self._transport = Transport(error_handling)
        kinds = {MemoryKind.HOST} | ({MemoryKind.DEVICE} if self._transport.cuda and cuda_present() else set())
        self._start_engine(name or unique_agent_name("kvxfer-ucx"), mode,
                           frozenset(kinds), hint_ttl_s)
        self.deadline_s, self.window, self.heartbeat_s = deadline_s, window, heartbeat_s
        self.fail_after_rows, self.poll_s = fail_after_rows, poll_s
        self._key = resolve_key(key) or b""
        self._sending: dict[str, Sending] = {}        # by our transfer id
        self._receiving: dict[int, Receiving] = {}    # by data tag
        self._early = EarlyMessages()  # data messages before their fetch()
        self._asked: OrderedDict[str, PullRequest] = OrderedDict()  # pull requests before their publish()
        self._replay: list[CompletionRecord] = []  # stashed records of submissions made since
        self._next_sweep = 0.0
        self._drains: list[tuple[Any, np.ndarray]] = []  # receives into scratch, and their buffers
        self._heartbeats: list[tuple[str, bytes, Any, np.ndarray]] = []  # control sends (to, address), buffers
        self._kick = threading.Event()
        self._progress = ProgressThread(f"kvxfer-ucx-{self.name}", lambda: self._step(), self._pause,
                                        functools.partial(log.exception, "ucx backend %s: progress step failed",
                                                          self.name))
        self._progress.start()

    # --- the contract -----------------------------------------------------------------
    def register(self, regions: Iterable[SlotRegion]) -> tuple[SlotRegion, ...]:
        batch, skipped = self._reachable(regions)
        self._regions.add(batch)
        return skipped

    def describe(self, view: View, audience: Peer | None = None) -> Hint:
        transfer_id = self._describe_checked(view)
        with self._jobs_lock:
            self._early.described(transfer_tag(transfer_id), time.monotonic() + self._own.ttl_ms / 1000)
        return self._hint(view, transfer_id, audience, endpoint=self._transport.address,
                          extras=((EXTRA_PACK, struct.pack("<q", self.pack_bytes)),) + self._sums.extras(view))

    def shutdown(self) -> frozenset[TrackedAttempt]:
        """Stop taking work, cancel what runs, return the attempts not proven quiesced. Called
        again, it first makes a progress step on the caller's thread (ours has exited), so
        that sends and receives that ended since are seen."""
        again = not self._close_and_cancel(self._all_attempts, self._kick.set)
        if not self._progress.stop(self._kick.set, 10.0):
            with self._jobs_lock:
                return frozenset(a for a in self._all_attempts() if not a.quiesced())
        if again and not self._transport.closed:
            try:
                self._step()
            except Exception:
                log.exception("ucx backend %s: a progress step after shutdown failed", self.name)
        end_idle(list(self._sending.values()), list(self._receiving.values()))
        left = frozenset(a for a in self._all_attempts() if not a.quiesced())
        if not left and not self._transport.closed:
            # Control messages still going (a cancel's record, a heartbeat) are let finish.
            self._transport.drain_everything([self._early.everything()], [h[2] for h in self._heartbeats])
            self._transport.close()
        return left

    def _all_attempts(self) -> list[TrackedAttempt]:
        return [j.attempt for j in self._sending.values()] + [w.attempt for w in self._receiving.values()]

    # --- submission -------------------------------------------------------------------
    def _check_peer_hint(self, hint: Hint) -> None:
        if hint.agent == self.name:
            raise InvalidSubmission(f"hint names this backend's own agent {self.name!r}")
        if not hint.endpoint:
            raise InvalidSubmission("the peer's hint has no endpoint (UCX worker address)")

    def _submit(self, view: View, hint: Hint, wake: WakeFn | None, *, fetching: bool) -> TrackedAttempt:
        admitted = self._admit(view, hint, fetching=fetching)
        attempt = TrackedAttempt(wake, self._on_cancel, admitted.label)
        plan = plan_runs(view, hint, match_rows(view, hint), max_runs=RUN_MASK + 1,  # numbered in a tag's low bits
                         pack_bytes=self.pack_bytes if fetching else _peer_pack_bytes(hint))
        deadline = time.monotonic() + self.deadline_s
        limit = self.fail_after_rows
        with self._jobs_lock:
            if admitted.active:
                self._claim(hint, attempt)
            else:
                self._refuse_if_closed()
            if fetching:
                tag = transfer_tag(admitted.own_id)
                own_limit = limit if admitted.active and limit is not None and limit < plan.rows else None
                wait = Receiving(attempt, view, hint, admitted.own_id, plan, tag, deadline,
                                 expected=plan.limited(own_limit), limit=own_limit,
                                 asked=self.mode is TransferMode.PUSH, received=np.zeros(plan.runs, np.int64),
                                 sums=self._sums.expected(view, plan), held_sums=self._sums.take(tag))
                self._receiving[tag] = wait
                wait.held = self._early.take(tag)
                self._replay_stashed(admitted.own_id, hint, view)  # the publisher may have stopped already
            else:
                injected = admitted.active and limit is not None and limit < plan.rows
                job = Sending(attempt, view, hint, admitted.own_id, plan, plan.limited(limit if injected else None),
                              transfer_tag(hint.transfer_id), deadline, go=self.mode is TransferMode.PUSH,
                              injected=f"injected fault after {limit} rows" if injected else None,
                              sent=np.zeros(plan.runs, np.int64), sums=self._sums.wanted(hint))
                asked = self._asked.pop(admitted.own_id, None)
                if asked is not None and asked.sender == hint.agent:
                    job.to_send = np.minimum(job.to_send, plan.limited(asked.limit))
                    job.go = True
                self._sending[admitted.own_id] = job
                if self._replay_stashed(admitted.own_id, hint, view):  # the fetcher gave up before we started
                    job.go = False
        self._own.consume(view, admitted.own_id)
        self._kick.set()
        return attempt

    def _replay_stashed(self, own_id: str, hint: Hint, view: View) -> bool:
        """Under the jobs lock: a record that came before this submission, from its peer, goes
        to the progress thread (not concluded here: wake would run inside fetch()/publish())."""
        record = self._stashed.pop(own_id, None)
        if record is None or record.sender != hint.agent or record.request != view.request:
            return False
        self._replay.append(record)
        return True

    def _on_cancel(self, attempt: TrackedAttempt) -> None:
        self._kick.set()

    # --- the progress thread ----------------------------------------------------------
    def _pause(self, busy: bool) -> None:
        self._kick.wait(timeout=self.poll_s if busy else IDLE_POLL_S)
        self._kick.clear()

    def _step(self) -> bool:
        self._transport.progress()
        for message in self._transport.take_control():
            self._on_control(message)
        with self._jobs_lock:
            replay, self._replay = self._replay, []
        for record in replay:
            self._on_record(record)
        self._take_data()
        self._sweep_described()
        with self._jobs_lock:
            sending, receiving = list(self._sending.values()), list(self._receiving.values())
        now = time.monotonic()
        for wait in receiving:
            self._advance_receiving(wait, now)
        for job in sending:
            self._advance_sending(job, now)
        self._drains = [d for d in self._drains if not d[0].completed]
        self._heartbeats = [h for h in self._heartbeats if not self._heartbeat_done(h[0], h[1], h[2])]
        with self._jobs_lock:
            return bool(self._sending or self._receiving or self._drains)

    # --- control messages -------------------------------------------------------------
    def _on_control(self, message: bytes) -> None:
        kind, body = message[:1], message[1:]
        if kind == b"S":
            self._on_sums(decode_sums(body, self._key))
        elif kind == b"G":
            self._on_pull_request(decode_pull(body, self._key))
        elif kind == b"R":
            try:
                self._on_record(decode_completion(body, self._key))
            except WireError as exc:
                log.warning("ucx backend %s: dropped a completion record: %s", self.name, exc)
        elif kind != b"H":
            log.warning("ucx backend %s: dropped a control message of kind %r", self.name, kind)

    def _on_record(self, record: CompletionRecord) -> None:
        with self._jobs_lock:
            job = self._sending.get(record.transfer_id)
            wait = self._receiving.get(transfer_tag(record.transfer_id))
            if job is None and wait is None:
                self._stash(record)
                return
        if job is not None and record.sender == job.hint.agent:
            self._on_ack(job, record)
        elif wait is not None and record.sender == wait.hint.agent and record.request == wait.view.request:
            self._on_stop(wait, record)

    def _on_pull_request(self, request: PullRequest | None) -> None:
        if request is None:
            log.warning("ucx backend %s: dropped a pull request malformed or not signed by our key", self.name)
            return
        with self._jobs_lock:
            job = self._sending.get(request.transfer_id)
            if job is None:
                if not self._own.is_retired(request.transfer_id):
                    put_bounded(self._asked, request.transfer_id, request, KEPT)
                return
        if request.sender == job.hint.agent:  # only the fetcher the hint came from may start it
            job.to_send = np.minimum(job.to_send, job.plan.limited(request.limit))
            job.go = True

    def _on_sums(self, sums: RunSums | None) -> None:
        if sums is None:
            log.warning("ucx backend %s: dropped row digests malformed or not signed by our key", self.name)
            return
        with self._jobs_lock:
            if (wait := self._receiving.get(tag := transfer_tag(sums.transfer_id))) is None:
                return self._sums.hold(tag, sums)
        self._keep_sums(wait, sums)

    def _keep_sums(self, wait: Receiving, sums: RunSums) -> None:
        bad = wait.sums.keep(wait.plan, sums, wait.hint.agent, wait.own_id) if wait.sums is not None else None
        if bad is not None and wait.attempt.poll() is None:
            wait.attempt.conclude(Failed(bad, wait.masks()))

    def _send_control(self, agent: str, address: bytes, message: bytes) -> bool:
        try:
            buffer = np.frombuffer(message, np.uint8)
            self._heartbeats.append((agent, address, self._transport.send(agent, address, buffer, CONTROL_TAG), buffer))
            return True
        except UcxPeerGone as exc:
            log.info("ucx backend %s: %s", self.name, exc)
            self._peer_lost(agent, address)
            return False

    def _beat(self, peer: Hint) -> None:
        """A heartbeat to the peer we wait on: only a send shows that it died."""
        if self._transport.alive(peer.agent, peer.endpoint):
            self._send_control(peer.agent, peer.endpoint, b"H")
        else:
            self._peer_lost(peer.agent, peer.endpoint)

    def _send_record(self, agent: str, address: bytes, record: CompletionRecord) -> bool:
        return self._send_control(agent, address, b"R" + encode_completion(record, self._key))

    def _heartbeat_done(self, agent: str, address: bytes, request: Any) -> bool:
        state = self._transport.state(request)
        if state == "GONE":
            self._peer_lost(agent, address)
        return state != "PROC"

    def _peer_lost(self, agent: str, address: bytes) -> None:
        """The peer process at ``address`` is gone (a peer restarted under the same name, at a
        new address, is another peer)."""
        with self._jobs_lock:
            jobs = [j for j in self._sending.values() if (j.hint.agent, j.hint.endpoint) == (agent, address)]
            waits = [w for w in self._receiving.values() if (w.hint.agent, w.hint.endpoint) == (agent, address)]
        for job in jobs:
            job.peer_gone = True
            job.failure = job.failure or f"ucx peer {agent!r} disconnected"
        for wait in waits:
            wait.peer_gone = True

    # --- the fetcher's side -----------------------------------------------------------
    def _sweep_described(self) -> None:
        now = time.monotonic()
        if now >= self._next_sweep:
            self._next_sweep = now + 1.0
            with self._jobs_lock:
                dropped = self._early.expired(now, self._receiving)
            self._drains += [self._transport.drain(probe) for probe in dropped]

    def _take_data(self) -> None:
        while (probe := self._transport.probe(0, DATA_MASK)) is not None:
            tag, run = probe.sender_tag.value >> RUN_BITS, probe.sender_tag.value & RUN_MASK
            with self._jobs_lock:
                wait = self._receiving.get(tag)
                early = wait is None and self._early.hold(tag, probe)
            if wait is not None:
                self._land(wait, run, probe)
            elif not early:
                self._drains.append(self._transport.drain(probe))

    def _land(self, wait: Receiving, run: int, probe: Any) -> None:
        """Receive one message into our rows (a packed one into a buffer, copied into the rows
        once it is in), if the transfer is live and the message holds whole rows from the
        start of its runs; else drop it (and fail the wait)."""
        plan, length = wait.plan, int(probe.length)
        end = int(plan.chunk_end[run]) if run < plan.runs else -1
        counts = split(plan, run, end, length) if end > run and run not in wait.posted else None
        live = wait.attempt.poll() is None and not wait.attempt.cancel_requested
        if not live or counts is None or np.any(wait.received[run:end] > 0):
            self._drains.append(self._transport.drain(probe))
            if live:
                wait.attempt.conclude(Failed(f"peer sent {length} bytes as run {run}, which does not fit it",
                                             wait.masks()))
            return
        buffer = np.empty(length, np.uint8) if end - run > 1 else run_memory(wait.view, plan, run, length)
        wait.posted[run] = (self._transport.receive(probe, buffer), counts, buffer)

    def _advance_receiving(self, wait: Receiving, now: float) -> None:
        (held, wait.held), (sums, wait.held_sums) = (wait.held, []), (wait.held_sums, [])  # before fetch()
        for probe in held:
            self._land(wait, probe.sender_tag.value & RUN_MASK, probe)
        for early in sums:
            self._keep_sums(wait, early)
        if (run := take_received(wait, self._transport.state)) is not None:
            wait.attempt.conclude(Failed(f"UCX failed the receive of run {run} from {wait.hint.agent!r}", wait.masks()))
        if not wait.asked and wait.attempt.poll() is None and self._send_control(
                wait.hint.agent, wait.hint.endpoint,
                encode_pull(PullRequest(wait.hint.transfer_id, self.name, wait.limit), self._key)):
            wait.asked = True
        if wait.attempt.poll() is None and (outcome := ending(wait, now, self.deadline_s)) is not None:
            if wait.sums is not None:
                outcome = wait.sums.check(self.integrity, wait.view, wait.plan, outcome)
            wait.attempt.conclude(outcome)
        if now >= wait.next_heartbeat and wait.attempt.poll() is None:
            wait.next_heartbeat = now + self.heartbeat_s
            self._beat(wait.hint)
        if wait.attempt.poll() is not None and not wait.posted:
            self._end_receiving(wait)

    def _on_stop(self, wait: Receiving, record: CompletionRecord) -> None:
        """The publisher stopped early: wait for the rows it says it sent, no more."""
        if not fits(record, wait.view):
            wait.attempt.conclude(Failed("peer sent a completion record of the wrong shape",
                                         wait.masks()))
            return
        wait.expected = np.minimum(wait.expected, wait.plan.rows_per_run(wait.view, record.masks))
        wait.stopped, wait.reason = record.status, record.reason

    def _end_receiving(self, wait: Receiving) -> None:
        outcome = wait.attempt.poll()
        if not wait.acked and not wait.peer_gone and outcome is not None:
            wait.acked = True
            self._send_record(wait.hint.agent, wait.hint.endpoint, acknowledgement(wait, outcome, self.name))
        with self._jobs_lock:
            self._receiving.pop(wait.tag, None)
        self._own.retire(wait.own_id)
        wait.attempt.mark_quiesced()

    # --- the publisher's side ---------------------------------------------------------
    def _advance_sending(self, job: Sending, now: float) -> None:
        self._reap_sends(job)
        if job.attempt.poll() is None:
            # Ended by us: at once, with no row proven (only the fetcher's acknowledgement proves
            # rows), though sends still in flight keep the attempt unquiesced until they end.
            if now > job.deadline:
                job.failure = job.failure or f"timeout after {self.deadline_s:g}s moving rows with peer {job.hint.agent!r}"
                job.attempt.conclude(Failed(job.failure, job.view.row_masks()))
            elif job.attempt.cancel_requested:
                job.attempt.conclude(Cancelled(False, job.view.row_masks()))
        if job.go and not job.stopping:
            self._post_sends(job)
            self._send_sums(job)
        if job.attempt.poll() is None and now >= job.ask_again and (job.all_posted or job.told or not job.go):
            job.ask_again = now + self.heartbeat_s
            self._beat(job.hint)
        if not job.inflight:
            self._settle(job)

    def _reap_sends(self, job: Sending) -> None:
        for run, (request, end, _buffer) in list(job.inflight.items()):
            state = self._transport.state(request)
            if state == "PROC":
                continue
            del job.inflight[run]
            if state == "DONE":
                job.sent[run:end] = job.to_send[run:end]
            elif state == "GONE":
                self._peer_lost(job.hint.agent, job.hint.endpoint)
            else:
                job.failure = job.failure or f"UCX failed to send run {run} to {job.hint.agent!r}"

    def _settle(self, job: Sending) -> None:
        """Nothing of ours is in flight: tell the fetcher which rows we sent if we stopped
        early (it waits for those, then acknowledges), and end once concluded."""
        stopped = job.injected is not None and job.all_posted or job.stopping
        if job.peer_gone and job.attempt.poll() is None:
            job.attempt.conclude(Failed(job.failure or "peer gone", job.view.row_masks()))
        elif stopped and not job.told and not job.acked and not job.peer_gone:
            self._tell_stop(job)
        if job.attempt.poll() is not None:
            self._end_sending(job)

    def _post_sends(self, job: Sending) -> None:
        """Post the next messages, up to ``window`` in flight: a packed one from a buffer the
        runs' rows were copied into, any other straight from its rows."""
        plan = job.plan
        while len(job.inflight) < self.window and job.next_run < plan.runs:
            run = job.next_run
            end = job.next_run = int(plan.chunk_end[run])
            counts = job.to_send[run:end]
            if not counts.any():
                continue
            buffer = (gather(job.view, plan, run, end, counts) if end - run > 1 else
                      run_memory(job.view, plan, run, int(counts[0] * plan.row_bytes[run])))
            try:
                request = self._transport.send(job.hint.agent, job.hint.endpoint, buffer, (job.tag << RUN_BITS) | run)
            except UcxPeerGone as exc:
                job.failure = job.failure or str(exc)
                self._peer_lost(job.hint.agent, job.hint.endpoint)
                return
            job.inflight[run] = (request, end, buffer)

    def _send_sums(self, job: Sending) -> None:
        """The digests of the runs posted since we last sent some, while their sends move."""
        if job.sums and job.summed_to < job.next_run:
            message, job.summed_to = self._sums.message(job.view, job.plan, job.hint.transfer_id, self.name,
                                                         self._key, job.summed_to, job.next_run)
            self._send_control(job.hint.agent, job.hint.endpoint, message)

    def _tell_stop(self, job: Sending) -> None:
        """We stop early (a fault, cancel, a failure): tell the fetcher which rows we sent."""
        job.told = True
        self._send_record(job.hint.agent, job.hint.endpoint, stop_record(job, self.name))

    def _on_ack(self, job: Sending, record: CompletionRecord) -> None:
        """The fetcher concluded: our outcome is what it received; nothing more goes to it."""
        job.attempt.conclude(acknowledged(job, record))
        job.go, job.acked = False, True

    def _end_sending(self, job: Sending) -> None:
        with self._jobs_lock:
            self._sending.pop(job.own_id, None)
        self._own.retire(job.own_id)
        job.attempt.mark_quiesced()


def _peer_pack_bytes(hint: Hint) -> int:
    """The fetcher's pack_bytes, from its hint (none said: a message per run)."""
    data = hint.extra(EXTRA_PACK)
    if data is None:
        return 0
    if len(data) != 8 or struct.unpack("<q", data)[0] < 0:
        raise InvalidSubmission(f"the peer's hint has a malformed {EXTRA_PACK!r}")
    return int(struct.unpack("<q", data)[0])
