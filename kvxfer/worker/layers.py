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


def hints_by_group(names: Sequence[str], hints: Sequence[Hint], rid: str) -> list[Hint]:
    """The peer's hints in the order of ``names`` (this end's groups): one hint of one group
    each. InvalidSubmission names both ends' groups when they differ (the two ends were
    started with a different --layerwise)."""
    by_group: dict[str, Hint] = {}
    for hint in hints:
        if len(hint.groups) != 1:
            raise InvalidSubmission(f"request {rid!r}: the peer sent a hint of {len(hint.groups)} groups; layer-wise "
                                    "streaming moves one group per hint: start both ends with the same --layerwise")
        by_group[hint.groups[0].layer_group] = hint
    if sorted(by_group) != sorted(names) or len(by_group) != len(hints):
        raise InvalidSubmission(f"request {rid!r}: the peer's layer groups {sorted(by_group)} are not this end's "
                                f"{sorted(names)}: start both ends with the same --layerwise")
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
    views = group_views(view)
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


class LayerMover:
    """The worker's mover (``kvxfer.worker.movers.Mover``) under --layerwise > 1: one
    transfer per layer group, each with its own hint, all at once. The prefill worker's
    streamed publish (``GroupStream``) submits the same per group, as the groups get ready."""

    def describe_write(self, backend: Backend, lease: Any, view: View, publisher: Peer) -> bytes:
        return wire.encode_hints([backend.describe(v, publisher) for v in group_views(view)])

    def fetch(self, backend: Backend, lease: Any, view: View, hints: tuple[Hint, ...],
              wake: Callable[[], None]) -> Attempt:
        return _submit(lease, view, hints, backend.fetch, wake)

    def describe_read(self, backend: Backend, lease: Any, view: View, hints: tuple[Hint, ...]) -> bytes:
        views = group_views(view)
        theirs = hints_by_group([v.groups[0].layer_group for v in views], hints, view.request)
        return wire.encode_hints([backend.describe(v, h.peer) for v, h in zip(views, theirs)])

    def publish(self, backend: Backend, lease: Any, view: View, hints: tuple[Hint, ...],
                wake: Callable[[], None]) -> Attempt:
        return _submit(lease, view, hints, backend.publish, wake)
