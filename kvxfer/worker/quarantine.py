"""Rows a worker sets aside because a peer may still touch them.

A reservation whose rows a peer may still write is quarantined: one for which no hint P came
while the router does not know that the prefill worker cannot write (an /abort or a
/generate without rows_safe: the publisher is not known dead, nor to have refused before
submitting), or one whose fetch with hint P was refused (whatever the router knows). Its
lease stays open, so its blocks are not reused, until it is proven that no peer can write
them any more. Either proof gives them back:

- the publisher's answer that it never used hint D, or can no longer (its /withdraw; the
  router then aborts here with rows_safe);
- time: hint D expired (no publisher accepts it after that) and the longest transfer begun
  before could have ended (``WorkerConfig.reclaim_grace_s``: its deadline's settle bound and
  clock skew between hosts).

Rows whose attempt exists come back when it quiesces; those of a submission that raised,
once the backend's shutdown proves nothing can touch them (rule 3 of the contract).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from kvxfer.contract import Attempt, View
from kvxfer.lender import Lease, Lender, StagingLender
from kvxfer.worker.meters import Meters


@dataclass(eq=False)
class Exposed:
    """A set-aside reservation whose hint D went out: given back on the publisher's word, or
    at ``safe_at`` (monotonic seconds; inf when hint D never expires)."""

    rid: str
    lease: Lease
    rows: int
    safe_at: float
    given_back: bool = False


class Quarantine:
    """The set-aside rows, counted into the worker's meters. Engine thread only, every
    method: some call the lender, and a reclaim pass replaces the lists that another thread's
    append would go into. ``grace_s``: how long after hint D expired a set-aside reservation is
    still held (``WorkerConfig.reclaim_grace_s``)."""

    def __init__(self, meters: Meters, grace_s: float = math.inf) -> None:
        self._meters = meters
        self._grace_s = grace_s
        # Leases kept open (no attempt can tell when access ends, until the backend's
        # shutdown proves it), and released leases whose attempt has not quiesced yet (the
        # lender reuses their rows once it does).
        self.quarantined: list[tuple[Lease, int]] = []
        # Of those, reservations whose hint D went out, by request id: an /abort with
        # rows_safe (the router's proof, from the publisher's /withdraw) gives them back.
        self.exposed: dict[str, Exposed] = {}
        # Every exposed reservation that hint D's expiry gives back, even one whose request
        # id was set aside again since (and so is no longer the one ``exposed`` names).
        self._expiring: list[Exposed] = []
        self.settling: list[tuple[Attempt, int]] = []
        self._staging_seen = (0, 0)  # the staging lender's quarantined and reclaimed totals, counted

    def reservation(self, lease: Lease, view: View, attempt: Attempt | None = None, rid: str | None = None,
                    expires_ms: int = 0) -> None:
        """A reservation's rows: with ``rid``, its hint D went out to a publisher that may
        still use it: an /abort of ``rid`` with rows_safe gives them back, and so does time,
        ``grace_s`` after hint D's expiry (``expires_ms``, wall clock; 0: it never expires)."""
        self.lease(lease, view, attempt)
        if rid is None or attempt is not None:
            return
        safe_at = math.inf
        if expires_ms > 0:
            # Counted on the monotonic clock from now: a step of the wall clock later moves nothing.
            safe_at = time.monotonic() + max(0.0, expires_ms / 1000 - time.time()) + self._grace_s
        entry = Exposed(rid, lease, view.rows, safe_at)
        self.exposed[rid] = entry
        if safe_at < math.inf:
            self._expiring.append(entry)

    def lease(self, lease: Lease, view: View, attempt: Attempt | None = None) -> None:
        """Set the lease's rows aside: with the ``attempt`` that touches them, until it
        quiesces (the lease is released and tracks it); without one, until the backend's
        shutdown proves that nothing can touch them (rule 3). Engine thread."""
        self._meters.quarantined.inc(view.rows)
        if attempt is None:
            self.quarantined.append((lease, view.rows))
            return
        lease.release()  # the lease tracks the attempt (submitters track what they submit)
        self.settling.append((attempt, view.rows))

    def release_exposed(self, rid: str) -> bool:
        """The publisher proved that hint D of ``rid`` can reach our rows no more. Engine thread."""
        found = self.exposed.pop(rid, None)
        if found is None:
            return False
        self._give_back([found])
        return True

    def release_expired(self, now: float | None = None) -> int:
        """Give back the reservations whose hint D expired ``grace_s`` ago or more: no
        publisher accepts it now, and none that did can still be writing. Returns how many.
        Engine thread."""
        if not self._expiring:
            return 0
        now = time.monotonic() if now is None else now
        due = [e for e in self._expiring if e.safe_at <= now and not e.given_back]
        self._expiring = [e for e in self._expiring if e.safe_at > now and not e.given_back]
        for entry in due:
            if self.exposed.get(entry.rid) is entry:
                del self.exposed[entry.rid]
        self._give_back(due)
        return len(due)

    def _give_back(self, entries: list[Exposed]) -> None:
        entries = [e for e in entries if not e.given_back]
        if not entries:
            return
        leases = {id(e.lease) for e in entries}
        self.quarantined = [(q, n) for q, n in self.quarantined if id(q) not in leases]
        for entry in entries:
            entry.given_back = True
            entry.lease.release()
            self._meters.reclaimed.inc(entry.rows)

    def release_proven(self) -> None:
        """The backend's shutdown proved that nothing it submitted can touch memory any more
        (rule 3): release the leases kept open. Not the reservations whose hint D is out: a
        peer may still use that (over IPC a publisher maps our memory itself); they stay
        retained. Engine thread."""
        exposed = {id(e.lease) for e in self._expiring + list(self.exposed.values()) if not e.given_back}
        for lease, rows in self.quarantined:
            if id(lease) not in exposed:
                lease.release()
                self._meters.reclaimed.inc(rows)
        self.quarantined = [(lease, rows) for lease, rows in self.quarantined if id(lease) in exposed]

    def reclaim(self, lender: Lender | None) -> None:
        """Count the set-aside rows whose attempts quiesced as given back (the lender
        unpins them: ``Lender.reclaim``), and the staging slots a failed copy held until it
        surely ended, and the reservations whose hint D expired long enough ago. Engine thread."""
        self.release_expired()
        if isinstance(lender, StagingLender):
            stats = lender.stats()
            seen = (stats.quarantined_total, stats.reclaimed)
            self._meters.quarantined.inc(seen[0] - self._staging_seen[0])
            self._meters.reclaimed.inc(seen[1] - self._staging_seen[1])
            self._staging_seen = seen
        if not self.settling:
            return
        # One look per attempt: one that quiesced between two looks would be in neither list.
        quiet = [a.quiesced() for a, _ in self.settling]
        settled = [entry for entry, q in zip(self.settling, quiet) if q]
        if settled:
            self.settling = [entry for entry, q in zip(self.settling, quiet) if not q]
            self._meters.reclaimed.inc(sum(n for _, n in settled))
            if lender is not None:
                lender.reclaim()

    def rows(self, lender: Lender | None) -> int:
        """Rows set aside now, the staging lender's quarantined slots included. Engine thread."""
        rows = sum(n for _, n in self.quarantined) + sum(n for _, n in self.settling)
        if isinstance(lender, StagingLender):
            rows += sum(s.quarantined for s in lender.stats().regions.values())
        return rows
