"""What a backend promises: attempts that conclude by themselves, capabilities, the calls.

Rules every backend keeps (``kvxfer.testing.conformance`` checks them):

1. Rows it does not recognize are refused with InvalidSubmission, never skipped.
2. Conclusion and quiescence advance by themselves; nobody has to call ``poll()``.
3. Any raise other than InvalidSubmission or SubmissionRejected means memory access may
   have escaped, and no attempt will say when it ends: the lease holder keeps the lease
   until ``shutdown()`` has returned an empty set (nothing the backend ever submitted can
   touch memory any more), and only then may release it. An attempt that exists but is not
   quiesced holds its memory through ``Lease.track``: release the lease, and the lender
   reuses the rows once the attempt quiesces (by a late confirmation from the peer, the
   peer proven dead, or its own requests ending), never before.
4. One instance serves one lender's domain. Its methods are called from one call
   sequence (the owner's thread); its own threads only read views.
5. A row is True in a mask only once its bytes are visible at the destination.
6. A hint is used at most once, only by its audience (when it names one) and only before
   it expires; anything else is refused with InvalidSubmission (see ``kvxfer.contract.hint``).
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from kvxfer.contract.hint import Hint, Peer, TransferMode
from kvxfer.contract.memory import MemoryKind, SlotRegion
from kvxfer.contract.outcome import Outcome
from kvxfer.contract.rows import View

WakeFn = Callable[[], None]
"""Called by a backend only after every change it reports is visible through the attempt."""


class Attempt(abc.ABC):
    """One submission to a backend."""

    @abc.abstractmethod
    def poll(self) -> Outcome | None:
        """The outcome once concluded, else None. Never blocks; once set it never changes."""

    @abc.abstractmethod
    def quiesced(self) -> bool:
        """True once no access to the submission's memory can happen, locally or remotely."""

    @abc.abstractmethod
    def cancel(self) -> None:
        """Ask the attempt to stop. It concludes Cancelled unless an outcome was already set."""


@dataclass(frozen=True)
class Capabilities:
    """What a backend can do, so that a lease holder can choose and size its submissions."""

    memory_kinds: frozenset[MemoryKind]
    modes: frozenset[TransferMode]
    fetch: bool = True
    publish: bool = True
    partial_delivery: bool = True
    cancellation: bool = True
    max_rows_per_submission: int | None = None
    max_in_flight: int | None = None


class Backend(abc.ABC):
    """Moves rows between a local view and the peer that a hint describes."""

    @property
    @abc.abstractmethod
    def capabilities(self) -> Capabilities: ...

    @property
    @abc.abstractmethod
    def peer(self) -> Peer:
        """This backend as peers see it: its agent and its run (fresh per instance)."""

    @abc.abstractmethod
    def register(self, regions: Iterable[SlotRegion]) -> tuple[SlotRegion, ...]:
        """Register the regions whose memory kind this backend reaches, and return the ones
        it skipped for their kind (empty when it took them all). InvalidSubmission for a
        region it cannot take for another reason (overlapping one it holds, a name reused
        for another span), and then none of the batch is registered."""

    @abc.abstractmethod
    def describe(self, view: View, audience: Peer | None = None) -> Hint:
        """The local end of ``view``, for the peer, with a fresh transfer id and an expiry.

        ``audience``: the one peer that may use the hint (any other refuses it). Bind every
        hint that exposes rows to a one-sided access, as a decode end's hint in push mode
        does, to the peer it is meant for; an unbound hint may be used once by any peer."""

    @abc.abstractmethod
    def fetch(self, view: View, hint: Hint, wake: WakeFn | None = None) -> Attempt:
        """Bring the peer's rows described by ``hint`` into the rows of ``view``."""

    @abc.abstractmethod
    def publish(self, view: View, hint: Hint, wake: WakeFn | None = None) -> Attempt:
        """Make the rows of ``view`` available to (push: write into) the peer of ``hint``."""

    @abc.abstractmethod
    def withdraw(self, hint: Hint) -> bool:
        """Take back the peer's ``hint`` here: True when nothing of this backend can reach the
        peer's rows through it any more, now or later (it never submitted with it, and from
        now on refuses it as used; or its attempt with it has quiesced), False while an
        attempt with it may still touch them or when that cannot be told (its submission
        raised). On True the peer may reuse the rows it described: the control plane carries
        the answer (a decode worker's reservation whose publish failed in an unknown way)."""

    @abc.abstractmethod
    def shutdown(self) -> frozenset[Attempt]:
        """Stop taking work; return the attempts not proven quiesced."""
