"""Layer-wise streaming (``kvxfer serve --layerwise GROUPS``): a request's KV moves as one
transfer per layer group, each under a hint of its own, so that the prefill worker can
publish a group as soon as the forward has written it, while later layers compute.

The pool holds the model's layers as that many groups (``ModelConfig.make_pool(groups=)``),
and each group is a view of one group (``group_views``). A hint is used at most once
(contract rule 6), so the decode end describes one hint D per group and fetches with one
hint P per group; ``LayerAttempt`` makes the group attempts one attempt whose masks are the
request view's, one per group, so ``Lease.mark_arrived`` and the resume bound
(``ResumeBounds.usable_until``, the intersection over groups) see the request as before.
It concludes only once every group's attempt has: the decode worker starts decoding only
when every group has landed (or failed, and then resumes from the bound).

``GroupStream`` is the prefill end's: called by the forward on the engine thread (the
owner thread of the backend) as each group is ready, it lends that group's rows (the lease
starts then, after the engine wrote and committed them), describes hint P and submits the
group's publish with its hint D.

A hybrid cache (``kvxfer serve --engine transformers`` with a model whose sliding-window
layers sit beside full-attention ones) moves the same way, all groups at once: each group is
an engine geometry of its own, lent by a lease of its own named ``rid/group``
(``kvxfer.adapters.transformers``), and ``LayerLeases`` makes those leases one, whose
group views (each with its geometry) ``LayerSubmitter`` submits.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from kvxfer import wire
from kvxfer.contract import (
    Attempt,
    Backend,
    Cancelled,
    Delivered,
    Failed,
    Hint,
    InvalidSubmission,
    Outcome,
    Peer,
    SubmissionRejected,
    TokenRange,
    View,
)


def group_view(view: View) -> View:
    """A view of one layer group as its own transfer: named ``rid/group`` (as a TP group's
    rank pairs are ``rid/kv{q}-{s}``), since a backend knows a described view by its request
    and tokens, and every group of a request covers the same tokens."""
    (group,) = view.groups
    return View(f"{view.request}/{group.layer_group}", view.tokens, (group,), view.layout)


def group_views(view: View) -> list[View]:
    """``view`` as one view per layer group, in its group order (``group_view``)."""
    return [group_view(View(view.request, view.tokens, (g,), view.layout)) for g in view.groups]


class LayerLeases:
    """One request's leases, one per layer group of a cache whose groups are geometries of
    their own (a hybrid cache: ``ExternalLender.for_groups``), with the interface of one
    lease. Each lease's view is its group's transfer (named ``rid/group``, its own tokens: a
    sliding group's ring); ``view()`` lists every group's rows as one view, for counting rows
    and for the masks, one per group in this order."""

    def __init__(self, request: str, leases: dict[str, Any]) -> None:
        if not leases:
            raise InvalidSubmission(f"request {request!r}: no layer group to move")
        self.request = request
        self.leases = leases

    def group_views(self) -> list[View]:
        """Each group's own view (its geometry), in this order."""
        return [lease.view() for lease in self.leases.values()]

    def view(self) -> View:
        views = self.group_views()
        tokens = TokenRange(min(v.tokens.start for v in views), max(v.tokens.end for v in views))
        return View(self.request, tokens, tuple(v.groups[0] for v in views), b"layer-groups")

    def track(self, attempt: Attempt) -> None:
        for lease in self.leases.values():
            lease.track(attempt)

    def unquiesced(self) -> int:
        return max(lease.unquiesced() for lease in self.leases.values())

    def mark_arrived(self, masks: Sequence[Any]) -> None:
        """``masks`` aligned with ``view()``'s groups: each group's lease gets its own."""
        if len(masks) != len(self.leases):
            raise InvalidSubmission(f"request {self.request!r}: {len(masks)} masks for {len(self.leases)} layer groups")
        for lease, mask in zip(self.leases.values(), masks):
            lease.mark_arrived([mask])

    def release(self) -> None:
        for lease in self.leases.values():
            lease.release()


def transfer_views(lease: Any, view: View) -> list[View]:
    """The transfers of one request: the group views of an engine's ``LayerLeases`` (a hybrid
    cache's, or one cut by --layerwise), or a pool's groups."""
    return lease.group_views() if isinstance(lease, LayerLeases) else group_views(view)


def geometry_views(lease: Any) -> tuple[View, ...]:
    """A hybrid cache's group views (each with its geometry: what a row weighs), or none."""
    return tuple(lease.group_views()) if isinstance(lease, LayerLeases) else ()



def hints_by_group(names: Sequence[str], hints: Sequence[Hint], rid: str) -> list[Hint]:
    """The peer's hints in the order of ``names`` (this end's groups): one hint of one group
    each. InvalidSubmission names both ends' groups when they differ (the two ends were
    started with a different --layerwise, or serve models whose caches differ in groups)."""
    by_group: dict[str, Hint] = {}
    for hint in hints:
        if len(hint.groups) != 1:
            raise InvalidSubmission(f"request {rid!r}: the peer sent a hint of {len(hint.groups)} groups; layer-wise "
                                    "streaming moves one group per hint: start both ends with the same --layerwise "
                                    "and model")
        by_group[hint.groups[0].layer_group] = hint
    if sorted(by_group) != sorted(names) or len(by_group) != len(hints):
        raise InvalidSubmission(f"request {rid!r}: the peer's layer groups {sorted(by_group)} are not this end's "
                                f"{sorted(names)}: start both ends with the same --layerwise and model (a "
                                "hybrid model's groups are its cache's)")
    return [by_group[name] for name in names]


class LayerAttempt(Attempt):
    """The group attempts of one request as one: concluded when all are (an attempt for a
    group not submitted, None, counts as nothing delivered), quiesced when all are; one
    mask per group, in the request view's order."""

    def __init__(self, attempts: Sequence[Attempt | None], groups: Sequence[str], rows: Sequence[int]) -> None:
        self.attempts = list(attempts)
        self._groups = tuple(groups)
        self._rows = tuple(rows)
        self._outcome: Outcome | None = None

    def poll(self) -> Outcome | None:
        if self._outcome is not None:
            return self._outcome
        outcomes = [None if a is None else a.poll() for a in self.attempts]
        if any(o is None for o, a in zip(outcomes, self.attempts) if a is not None):
            return None
        self._outcome = self._combine(outcomes)
        return self._outcome

    def _combine(self, outcomes: list[Outcome | None]) -> Outcome:
        masks = [np.asarray(o.masks[0], dtype=np.bool_) if o is not None else np.zeros(n, dtype=np.bool_)
                 for o, n in zip(outcomes, self._rows)]
        failed = [(g, o) for g, o in zip(self._groups, outcomes) if isinstance(o, Failed)]
        if failed:
            group, first = failed[0]
            return Failed(f"{len(failed)} of {len(outcomes)} layer groups failed; group {group!r}: {first.reason}",
                          masks)
        missing = [g for g, o in zip(self._groups, outcomes) if o is None]
        if missing:
            return Failed(f"layer groups {missing} were never submitted", masks)
        cancelled = [o for o in outcomes if isinstance(o, Cancelled)]
        if cancelled:
            return Cancelled(any(o.by_peer for o in cancelled), masks)
        return Delivered(tuple(masks))

    def quiesced(self) -> bool:
        return all(a is None or a.quiesced() for a in self.attempts)

    def cancel(self) -> None:
        for attempt in self.attempts:
            if attempt is not None:
                attempt.cancel()


def _submit(lease: Any, view: View, hints: tuple[Hint, ...], submit: Callable[..., Attempt],
            wake: Callable[[], None]) -> LayerAttempt:
    """One submission per group. When a later group is refused, the earlier ones are
    cancelled and tracked by the lease (their rows wait for them to quiesce) before the
    refusal is raised: a refused submission, as the contract says, leaves nothing running
    that the caller does not know of."""
    views = transfer_views(lease, view)
    theirs = hints_by_group([v.groups[0].layer_group for v in views], hints, view.request)
    attempts: list[Attempt] = []
    try:
        for part, hint in zip(views, theirs):
            attempts.append(submit(part, hint, wake))
    except (InvalidSubmission, SubmissionRejected):
        if attempts:
            for attempt in attempts:
                attempt.cancel()
            lease.track(_attempt(view, attempts))
        raise
    return _attempt(view, attempts)


def _attempt(view: View, attempts: Sequence[Attempt | None]) -> LayerAttempt:
    padded = list(attempts) + [None] * (len(view.groups) - len(attempts))
    return LayerAttempt(padded, [g.layer_group for g in view.groups], [len(g) for g in view.groups])


class LayerSubmitter:
    """The worker's submitter (``kvxfer.worker.lease_transfers.Submitter``) under --layerwise > 1,
    and for a hybrid cache's ``LayerLeases``: one transfer per layer group, each with its own hint, all
    at once. The prefill worker's streamed publish (``GroupStream``) submits the same per
    group, as the groups get ready."""

    def describe_write(self, backend: Backend, lease: Any, view: View, publisher: Peer) -> bytes:
        return wire.encode_hints([backend.describe(v, publisher) for v in transfer_views(lease, view)])

    def fetch(self, backend: Backend, lease: Any, view: View, hints: tuple[Hint, ...],
              wake: Callable[[], None]) -> Attempt:
        return _submit(lease, view, hints, backend.fetch, wake)

    def describe_read(self, backend: Backend, lease: Any, view: View, hints: tuple[Hint, ...]) -> bytes:
        views = transfer_views(lease, view)
        theirs = hints_by_group([v.groups[0].layer_group for v in views], hints, view.request)
        return wire.encode_hints([backend.describe(v, h.peer) for v, h in zip(views, theirs)])

    def publish(self, backend: Backend, lease: Any, view: View, hints: tuple[Hint, ...],
                wake: Callable[[], None]) -> Attempt:
        return _submit(lease, view, hints, backend.publish, wake)
