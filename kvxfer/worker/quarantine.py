"""Rows a worker sets aside because a peer may still touch them.

A reservation whose rows a peer may still write (no hint P came, and the prefill worker
is not known dead) is quarantined: its lease stays open, so its blocks are not reused,
until the publisher proves it can reach them no more (its /withdraw; the router then aborts
here with rows_safe). Without that proof they stay out of use for good: the only safe
answer when nobody can prove the peer stopped. Rows whose attempt exists come back when it
quiesces; those of a submission that raised, once the backend's shutdown proves nothing can
touch them (rule 3 of the contract).
"""

from __future__ import annotations

from kvxfer.contract import Attempt, View
from kvxfer.lender import Lease, Lender, StagingLender
from kvxfer.worker.meters import Meters


class Quarantine:
    """The set-aside rows, counted into the worker's meters. What calls the lender runs on
    the engine thread."""

    def __init__(self, meters: Meters) -> None:
        self._meters = meters
        # Leases kept open (no attempt can tell when access ends, until the backend's
        # shutdown proves it), and released leases whose attempt has not quiesced yet (the
        # lender reuses their rows once it does).
        self.quarantined: list[tuple[Lease, int]] = []
        # Of those, reservations whose hint D went out, by request id: an /abort with
        # rows_safe (the router's proof, from the publisher's /withdraw) gives them back.
        self.exposed: dict[str, tuple[Lease, int]] = {}
        self.settling: list[tuple[Attempt, int]] = []
        self._staging_seen = (0, 0)  # the staging lender's quarantined and reclaimed totals, counted

    def reservation(self, lease: Lease, view: View, attempt: Attempt | None = None, rid: str | None = None) -> None:
        """A reservation's rows: with ``rid``, its hint D went out to a publisher that may
        still use it, and an /abort of ``rid`` with rows_safe gives them back."""
        self.lease(lease, view, attempt)
        if rid is not None and attempt is None:
            self.exposed[rid] = (lease, view.rows)

    def lease(self, lease: Lease, view: View, attempt: Attempt | None = None) -> None:
        """Set the lease's rows aside: with the ``attempt`` that touches them, until it
        quiesces (the lease is released and tracks it); without one, until the backend's
        shutdown proves that nothing can touch them (rule 3). Engine thread with an attempt
        (the lender is called)."""
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
        lease, rows = found
        self.quarantined = [(q, n) for q, n in self.quarantined if q is not lease]
        lease.release()
        self._meters.reclaimed.inc(rows)
        return True

    def release_proven(self) -> None:
        """The backend's shutdown proved that nothing it submitted can touch memory any more
        (rule 3): release the leases kept open. Not the reservations whose hint D is out: a
        peer may still use that (over IPC a publisher maps our memory itself); they stay
        retained. Engine thread."""
        exposed = {id(lease) for lease, _ in self.exposed.values()}
        for lease, rows in self.quarantined:
            if id(lease) not in exposed:
                lease.release()
                self._meters.reclaimed.inc(rows)
        self.quarantined = [(lease, rows) for lease, rows in self.quarantined if id(lease) in exposed]

    def reclaim(self, lender: Lender | None) -> None:
        """Count the set-aside rows whose attempts quiesced as given back (the lender
        unpins them: ``Lender.reclaim``), and the staging slots a failed copy held until it
        surely ended. Engine thread."""
        if isinstance(lender, StagingLender):
            stats = lender.stats()
            seen = (stats.quarantined_total, stats.reclaimed)
            self._meters.quarantined.inc(seen[0] - self._staging_seen[0])
            self._meters.reclaimed.inc(seen[1] - self._staging_seen[1])
            self._staging_seen = seen
        if not self.settling:
            return
        settled = [(a, n) for a, n in self.settling if a.quiesced()]
        if settled:
            self.settling = [(a, n) for a, n in self.settling if not a.quiesced()]
            self._meters.reclaimed.inc(sum(n for _, n in settled))
            if lender is not None:
                lender.reclaim()

    def rows(self, lender: Lender | None) -> int:
        """Rows set aside now, the staging lender's quarantined slots included. Engine thread."""
        rows = sum(n for _, n in self.quarantined) + sum(n for _, n in self.settling)
        if isinstance(lender, StagingLender):
            rows += sum(s.quarantined for s in lender.stats().regions.values())
        return rows
