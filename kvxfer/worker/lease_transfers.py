"""How a worker's leases become transfers: one view and one hint per request (a single pool),
or one per rank pair (a TP group of engine geometries, ``kvxfer.worker.ranks``).

Both keep the submission rules of the contract for the worker: a refused submission
(InvalidSubmission, SubmissionRejected) touched nothing, so the caller may release its
lease. When a TP group's later pair is refused after earlier pairs were submitted, those
are cancelled and tracked by the lease (so its rows wait for them to quiesce) before the
refusal is raised.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from kvxfer import wire
from kvxfer.contract import Attempt, Backend, Hint, InvalidSubmission, Peer, SubmissionRejected, View
from kvxfer.worker.ranks import GroupAttempt, GroupLease, GroupLender, RankPair, hints_for, rank_pairs


class Submitter(Protocol):
    """Describes and submits a lease's transfers on the worker's backend: the decode end's
    hint and fetch, the prefill end's hint and publish. (A "mover" elsewhere is a backend.)"""

    def describe_write(self, backend: Backend, lease: Any, view: View, publisher: Peer) -> bytes: ...

    def fetch(self, backend: Backend, lease: Any, view: View, hints: tuple[Hint, ...],
              wake: Callable[[], None]) -> Attempt: ...

    def describe_read(self, backend: Backend, lease: Any, view: View, hints: tuple[Hint, ...]) -> bytes: ...

    def publish(self, backend: Backend, lease: Any, view: View, hints: tuple[Hint, ...],
                wake: Callable[[], None]) -> Attempt: ...


class PoolSubmitter:
    """One pool: the lease's view is the transfer's view, one hint each way."""

    def describe_write(self, backend: Backend, lease: Any, view: View, publisher: Peer) -> bytes:
        return wire.encode_hint(backend.describe(view, publisher))

    def fetch(self, backend: Backend, lease: Any, view: View, hints: tuple[Hint, ...],
              wake: Callable[[], None]) -> Attempt:
        return backend.fetch(view, _one(hints), wake)

    def describe_read(self, backend: Backend, lease: Any, view: View, hints: tuple[Hint, ...]) -> bytes:
        return wire.encode_hint(backend.describe(view, _one(hints).peer))

    def publish(self, backend: Backend, lease: Any, view: View, hints: tuple[Hint, ...],
                wake: Callable[[], None]) -> Attempt:
        return backend.publish(view, _one(hints), wake)


class GroupSubmitter:
    """A TP group: one transfer per rank pair. ``peer_tp`` is the other group's TP (decode:
    the prefill workers'; prefill: read from the hints it gets)."""

    def __init__(self, lender: GroupLender, kv_heads: int, peer_tp: int) -> None:
        self.lender = lender
        self.kv_heads = kv_heads
        self.peer_tp = peer_tp

    def _decode_pairs(self) -> tuple[RankPair, ...]:
        return rank_pairs(self.kv_heads, self.lender.cache.tp, self.peer_tp)

    # --- decode --------------------------------------------------------------------------------
    def describe_write(self, backend: Backend, lease: GroupLease, view: View, publisher: Peer) -> bytes:
        pairs = self._decode_pairs()
        return wire.encode_hints([backend.describe(self.lender.pair_view(lease, p, p.rank), publisher) for p in pairs])

    def fetch(self, backend: Backend, lease: GroupLease, view: View, hints: tuple[Hint, ...],
              wake: Callable[[], None]) -> Attempt:
        pairs = self._decode_pairs()
        theirs = hints_for(hints, pairs, lease.request)
        return self._submit(lease, pairs, [(self.lender.pair_view(lease, p, p.rank), h) for p, h in zip(pairs, theirs)],
                            backend.fetch, wake, fetching=True)

    # --- prefill -------------------------------------------------------------------------------
    def _prefill_pairs(self, lease: GroupLease, hints: tuple[Hint, ...]) -> list[tuple[RankPair, Hint]]:
        """Each decode hint names its pair (``rid/kv{q}-{s}``) and heads; the source rank is
        this group's first rank holding them."""
        out = []
        for hint in hints:
            if hint.geometry is None:
                raise InvalidSubmission("the decode end sent a pool hint to a TP group: both ends must move "
                                        "engine geometries (--engine-kv, --tp, --kv-block-tokens, --kv-layout on both)")
            rank_text = hint.request.rpartition("/kv")[2].split("-")[0]
            if not hint.request.startswith(lease.request + "/kv") or not rank_text.isdigit():
                raise InvalidSubmission(f"hint for {hint.request!r} names no rank pair of request {lease.request!r}")
            source = self.lender.source_rank(hint.geometry.heads)
            out.append((RankPair(int(rank_text), source, hint.geometry.heads), hint))
        return out

    def describe_read(self, backend: Backend, lease: GroupLease, view: View, hints: tuple[Hint, ...]) -> bytes:
        pairs = self._prefill_pairs(lease, hints)
        return wire.encode_hints([backend.describe(self.lender.pair_view(lease, p, p.source), hints[0].peer)
                                  for p, _ in pairs])

    def publish(self, backend: Backend, lease: GroupLease, view: View, hints: tuple[Hint, ...],
                wake: Callable[[], None]) -> Attempt:
        pairs = self._prefill_pairs(lease, hints)
        jobs = [(self.lender.pair_view(lease, p, p.source), h) for p, h in pairs]
        return self._submit(lease, [p for p, _ in pairs], jobs, backend.publish, wake, fetching=False)

    def _submit(self, lease: GroupLease, pairs: list[RankPair] | tuple[RankPair, ...],
                jobs: list[tuple[View, Hint]], submit: Callable[..., Attempt], wake: Callable[[], None], *,
                fetching: bool) -> Attempt:
        attempts: list[Attempt] = []
        try:
            for view, hint in jobs:
                attempts.append(submit(view, hint, wake))
        except (InvalidSubmission, SubmissionRejected):
            if attempts:
                for attempt in attempts:
                    attempt.cancel()
                lease.track(self._group(lease, pairs[: len(attempts)], attempts, fetching))
            raise
        return self._group(lease, pairs, attempts, fetching)

    def _group(self, lease: GroupLease, pairs: Any, attempts: list[Attempt], fetching: bool) -> GroupAttempt:
        views = lease.rank_views()
        return GroupAttempt(attempts, pairs, [len(v.groups) for v in views], [len(v.groups[0]) for v in views],
                            fetching)


def _one(hints: tuple[Hint, ...]) -> Hint:
    if len(hints) != 1:
        raise InvalidSubmission(f"the peer sent {len(hints)} hints (a TP group's) to a single-pool worker: "
                                "both ends must move engine geometries (--engine-kv, --tp, --kv-block-tokens, --kv-layout on both)")
    return hints[0]
