"""Peers the NIXL backend waits on: passive waits that time out or are cancelled ask the
active end to stop until it answers, idle peers get heartbeats (a peer's death is seen only
when something is posted to it, docs/performance.md), and a peer found dead is dropped once
no request of ours to it is alive, failing the waits on it.

Only the backend's progress thread calls this; the tables are the backend's, read under its
jobs lock.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvxfer.backends.common.engine import stop_reason
from kvxfer.backends.nixl.agent import NixlAgent, PeerGone, PeerUnknown
from kvxfer.backends.nixl.jobs import ActiveJob, PassiveWait
from kvxfer.backends.nixl.packed import PackedJob
from kvxfer.contract import CompletionRecord, Failed

log = logging.getLogger(__name__)

HEARTBEAT = b""  # an empty notification: proves the peer is reachable, carries nothing


@dataclass(frozen=True)
class LivenessHooks:
    send: Callable[[str, CompletionRecord], bool]  # False: gone (then marked lost) or not loaded
    stop_request: Callable[[str, str, str], CompletionRecord]  # (our transfer id, request, reason)
    end_passive: Callable[[PassiveWait], None]
    forget_peer: Callable[[str], None]  # the backend's other tables of the peer


class Liveness:
    def __init__(self, name: str, agent: NixlAgent, lock: threading.Lock, active: list[ActiveJob],
                 passive: dict[str, PassiveWait], hooks: LivenessHooks) -> None:
        self.name = name
        self._agent = agent
        self._lock = lock
        self._active = active
        self._passive = passive
        self._hooks = hooks
        self.dead: set[str] = set()  # peers found disconnected, not yet dropped (under the lock)
        self._next_heartbeat = 0.0

    def lost(self, peer: str) -> None:
        """``peer`` is gone: its jobs fail with the chunks proven so far."""
        self._agent.gone(peer)  # no reconnect to it from now on
        with self._lock:
            self.dead.add(peer)
            jobs = [j for j in self._active if j.hint.agent == peer]
        for job in jobs:
            job.failure = job.failure or f"peer {peer!r} disconnected (NIXL_ERR_REMOTE_DISCONNECT)"
            job.peer_gone = True
            if isinstance(job, PackedJob):
                job.abandoned = True  # no acknowledgement will come: its rows stay as proven

    def check_passive(self, deadline_s: float, heartbeat_s: float) -> None:
        now = time.monotonic()
        with self._lock:
            waits = list(self._passive.values())
        for wait in waits:
            reason = stop_reason(wait.attempt, wait.masks, now, wait.deadline, deadline_s, wait.hint.agent)
            if reason:
                wait.stop_reason = reason
            if wait.attempt.poll() is not None and now >= wait.ask_again and self._agent.knows(wait.hint.agent):
                # Stays unquiesced until the peer confirms that it stopped (or is found dead).
                # An etcd peer not loaded yet is asked once it is; an unanswered request is sent
                # again every heartbeat, as a peer that had not loaded our metadata (it never
                # published to us) can answer only once it has (a later push to us loads it).
                stop = self._hooks.stop_request(wait.own_id, wait.view.request, wait.stop_reason or "stopped")
                if self._hooks.send(wait.hint.agent, stop):
                    wait.ask_again = now + heartbeat_s

    def heartbeat(self, heartbeat_s: float) -> None:
        """Peers we wait on (passive waits, packed pushes waiting for credits) get an empty note."""
        now = time.monotonic()
        if now < self._next_heartbeat:
            return
        self._next_heartbeat = now + heartbeat_s
        with self._lock:
            peers = {w.hint.agent: w.hint.endpoint for w in self._passive.values() if w.hint.agent not in self.dead}
            # A packed push waiting for credits or acknowledgements posts nothing that would fail.
            peers.update({j.hint.agent: j.hint.endpoint for j in self._active if isinstance(j, PackedJob)
                          and j.requested and not j.touching and j.hint.agent not in self.dead})
        for peer, endpoint in peers.items():
            try:
                if not self._agent.knows(peer) and not self._agent.ensure_peer(peer, endpoint):
                    continue  # etcd has not delivered its metadata yet
                self._agent.notify(peer, HEARTBEAT)
            except (PeerGone, PeerUnknown, ValueError) as exc:
                log.info("nixl backend %s: heartbeat: %s", self.name, exc)
                self.lost(peer)

    def drop_dead_peers(self) -> None:
        with self._lock:
            dead = [p for p in self.dead if not any(j.hint.agent == p and j.touching for j in self._active)]
            waits = [w for w in self._passive.values() if w.hint.agent in dead]
        for peer in dead:
            # No request of ours to it is alive; dropping its endpoint stops our worker from
            # acting on anything it sent. A restarted peer of that name can now be added.
            self._agent.forget(peer)
            self._hooks.forget_peer(peer)
            with self._lock:
                self.dead.discard(peer)
        for wait in waits:
            wait.attempt.conclude(Failed(f"peer {wait.hint.agent!r} disconnected before completing", wait.masks()))
            self._hooks.end_passive(wait)
