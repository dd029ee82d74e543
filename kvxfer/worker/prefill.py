"""A prefill worker's role (DESIGN.md section 5):

- ``prefill``: allocate, run the prompt, keep its K/V, answer the first token (greedy, or
  sampled as the call says: index 0 of the completion's stream), with its logprobs when asked.
- ``publish``: ``lend_read``, ``describe`` -> hint P (streamed at once), then
  ``publish(view_P, hint_D)``, stream the outcome, release, free.

Layer-wise streaming (``--layerwise`` > 1, ``kvxfer.worker.layers``): ``prefill`` takes the
decode end's hints D (one per layer group) and publishes each group as soon as the forward
has written it (``GroupStream``: its read lease starts then); ``publish`` then answers the
hints P of every group and streams the outcome of them all.
"""

from __future__ import annotations

import asyncio
import base64
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field
from typing import Any

from kvxfer import wire
from kvxfer.contract import Attempt, Hint, InvalidSubmission, SubmissionRejected, View
from kvxfer.lender import Lease
from kvxfer.worker.calls import PrefillCall, PublishCall, pick_json
from kvxfer.worker.errors import Aborted, Refused
from kvxfer.worker.layers import LayerAttempt, geometry_views, hints_by_group, transfer_views
from kvxfer.worker.state import WorkerState


@dataclass(eq=False)
class GroupStream:
    """One request's layer groups, published as the forward makes them ready. Touched on the
    engine thread only (the forward's ``ready`` calls, publish, clean-up)."""

    rid: str
    tokens: int
    groups: tuple[str, ...]           # the engine's layer groups (the pool's, or its cache's), in order
    hints: dict[str, Hint]            # hint D of each group
    event: asyncio.Event              # set by the attempts' wake
    wake: Callable[[], None]
    leases: dict[str, Any] = field(default_factory=dict)  # a Lease, or an engine's LayerLeases of one group
    views: dict[str, View] = field(default_factory=dict)
    described: dict[str, Hint] = field(default_factory=dict)  # hint P of each group submitted
    attempts: dict[str, Attempt] = field(default_factory=dict)
    refused: BaseException | None = None  # the first group refused: no later group is submitted
    escaped: bool = False                 # a publish raised otherwise (rule 3): its hint D may be in use
    submitted: float = 0.0                # when the first group was submitted (perf_counter)

    def attempt(self) -> LayerAttempt:
        return LayerAttempt([self.attempts.get(g) for g in self.groups], self.groups,
                            [len(self.views[g].groups[0]) if g in self.views else 0 for g in self.groups])

    def view(self) -> View:
        """The request's view over every group (one group per submitted view), for the figures."""
        first = self.views[self.groups[0]]
        return View(self.rid, first.tokens, tuple(self.views[g].groups[0] for g in self.groups), first.layout)

    def geometry_views(self) -> tuple[View, ...]:
        """Each group's view when each carries its geometry (an engine's cache: what a row
        weighs), else none (a pool's rows weigh their region's slots)."""
        views = tuple(self.views[g] for g in self.groups if g in self.views)
        return views if views and all(v.geometry is not None for v in views) else ()

    def release(self) -> None:
        """End every group's lease: rows stay pinned until their tracked attempts quiesce."""
        for lease in self.leases.values():
            lease.release()

    def cancel(self) -> None:
        for attempt in self.attempts.values():
            attempt.cancel()


@dataclass(eq=False)
class Held:
    """A prefill request whose K/V waits for a publish."""

    prompt: list[int]
    first: int
    since: float
    busy: bool = False
    stream: GroupStream | None = None  # layer-wise streaming: the groups published during prefill


class PrefillRole:
    def __init__(self, state: WorkerState) -> None:
        self._s = state
        self.held: dict[str, Held] = {}

    async def prefill(self, call: PrefillCall) -> dict[str, Any]:
        s = self._s
        s.need("prefill")
        rid, prompt = call.request, call.prompt
        if rid in self.held or rid in s.calls.starting:
            raise Refused(f"request {rid!r} is already held here")
        s.calls.refuse_if_aborted_early(rid)
        stream = self._stream(call)
        start = time.perf_counter()
        s.calls.starting[rid] = "prefill"
        ready = None if stream is None else (lambda group: self._group_ready(stream, group))
        try:
            first = await s.serving.prefill(rid, prompt, call.sampling, call.logprobs, ready)
        except BaseException:
            if stream is not None:
                await s.engine.cleanup(self._end_stream, stream)
            raise
        finally:
            aborted = s.calls.end_start(rid)
        if aborted:
            if stream is not None:
                await s.engine.run_move(self._end_stream, stream)
            await s.engine.run(s.free, rid)
            raise Aborted(f"request {rid!r} was aborted while it was prefilled; its blocks are freed")
        seconds = time.perf_counter() - start
        s.meters.prefill.observe(seconds)
        s.meters.tokens.inc()
        if s.store is not None:
            # Before answering: the blocks are read while nothing else can free them, and a
            # decode worker reserving for a later request with this prefix finds them.
            try:
                await s.store.offer(rid, prompt)
            except BaseException:  # cancelled (the server closing): nobody will publish them
                await s.engine.cleanup(s.free, rid)
                raise
        self.held[rid] = Held(prompt, first.token, time.monotonic(), stream=stream)
        return {"request": rid, **pick_json(first), "compute_s": seconds, "prompt_tokens": len(prompt),
                "publisher": s.publisher()}

    # --- layer-wise streaming --------------------------------------------------------------------
    def _stream(self, call: PrefillCall) -> GroupStream | None:
        """The call's group stream when it carries hints D; refused by name, before anything
        is computed, when this worker streams no groups or the hints do not match its groups."""
        s = self._s
        if call.decode_hint is None:
            return None
        groups = s.serving.stream_groups()
        if not groups:
            raise Refused("this worker streams no layer groups (--layerwise 1): send hint D to /publish")
        hints = dict(zip(groups, hints_by_group(groups, call.decode_hint, call.request)))
        event, wake = s.engine.waker()
        return GroupStream(call.request, len(call.prompt), groups, hints, event, wake)

    def _group_ready(self, stream: GroupStream, group: str) -> None:
        """On the engine thread, inside the forward: ``group``'s rows are written and
        committed; lend them and publish them with the group's hint D. A refusal stops the
        stream (no later group is submitted) and never fails the prefill: /publish reports it."""
        s = self._s
        backend = s.backend
        if stream.refused is not None or backend is None:
            return
        hint = stream.hints[group]
        lease = None
        try:
            lease = s.serving.lend_read(stream.rid, stream.tokens, (group,))
            whole = lease.view()
            if whole is None:
                raise RuntimeError(f"read lease of {stream.rid!r}, group {group!r}, is not ready")
            (view,) = transfer_views(lease, whole)  # the group's own transfer, named rid/group
            described = backend.describe(view, hint.peer)
        except Exception as exc:  # noqa: BLE001 - /publish reports it, as its own lend or describe raising
            if lease is not None:
                lease.release()  # nothing was submitted with these rows
            stream.refused = exc
            return
        if not stream.attempts:
            stream.submitted = time.perf_counter()
        try:
            attempt = backend.publish(view, hint, stream.wake)
        except (InvalidSubmission, SubmissionRejected) as exc:
            lease.release()  # the backend promises that nothing escaped
            stream.refused = exc
            return
        except Exception as exc:  # noqa: BLE001 - /publish reports it
            # Rule 3: any other raise means memory access may have escaped: never reuse them.
            s.quarantine.lease(lease, view)
            stream.refused, stream.escaped = exc, True
            return
        lease.track(attempt)
        stream.leases[group], stream.views[group] = lease, view
        stream.described[group], stream.attempts[group] = described, attempt

    def _end_stream(self, stream: GroupStream) -> None:
        """Nobody will publish it (aborted, expired, failed): cancel what was submitted and
        end the leases; the rows come back once the attempts quiesce."""
        stream.cancel()
        stream.release()

    async def publish(self, call: PublishCall) -> AsyncGenerator[dict[str, Any], None]:
        s = self._s
        s.need("prefill")
        rid = call.request
        held = self.held.get(rid)
        if held is None or held.busy:
            raise Refused(f"request {rid!r} is not held here (never prefilled, already published, or expired)")
        decode_hint = call.decode_hint
        held.busy = True
        stream = held.stream
        if stream is not None and (stream.attempts or stream.refused is None or stream.escaped):
            try:
                streamed = await s.engine.run_move(self._streamed, stream)
            except BaseException:
                self.held.pop(rid, None)
                await s.engine.cleanup(self._end_stream, stream)
                await s.engine.cleanup(s.free, rid)
                raise
            return self._publish_events(rid, *streamed)
        # No stream, or one refused before any group went out (hint D bound to an earlier run
        # of this worker, say): publish every group now with the hints this call carries.
        event, wake = s.engine.waker()
        try:
            lease, view, prefill_hint, attempt, submitted = await s.engine.run_move(self._publish_sync, rid,
                                                                               len(held.prompt), decode_hint, wake)
        except BaseException:
            self.held.pop(rid, None)
            await s.engine.cleanup(s.free, rid)
            raise
        return self._publish_events(rid, lease, view, prefill_hint, attempt, submitted, event)

    def _streamed(self, stream: GroupStream) -> tuple[GroupStream, View, bytes, Attempt, float, asyncio.Event]:
        """The streamed groups as one publish: their leases, the request's view, the hints P
        of every group, their attempts as one. A group refused on the way is raised here (the
        caller ends the stream: the groups already out are cancelled, their rows held until
        their attempts quiesce)."""
        if stream.refused is not None:
            # Not a refusal (409, "nothing escaped") for the router: earlier groups went out
            # with their hints D, so it must ask for them back before the rows are reused.
            raise RuntimeError(f"request {stream.rid!r}: layer group {len(stream.attempts) + 1} of "
                               f"{len(stream.groups)} failed after {len(stream.attempts)} went out: "
                               f"{type(stream.refused).__name__}: {stream.refused}") from stream.refused
        missing = [g for g in stream.groups if g not in stream.attempts]
        if missing:
            raise RuntimeError(f"request {stream.rid!r}: layer groups {missing} were never made ready by the forward")
        hints = wire.encode_hints([stream.described[g] for g in stream.groups])
        return stream, stream.view(), hints, stream.attempt(), stream.submitted, stream.event

    def _publish_sync(self, rid: str, n: int, decode_hint: Any, wake: Callable[[], None]
                      ) -> tuple[Lease, View, bytes, Attempt, float]:
        backend, submitter = self._s.backend, self._s.submitter
        assert backend is not None
        lease = self._s.serving.lend_read(rid, n)
        try:
            view = lease.view()
            if view is None:
                raise RuntimeError(f"read lease of {rid!r} is not ready (staging copy pending)")
            # Bound to the decode end that sent hint D: in pull mode hint P lets it READ these rows.
            prefill_hint = submitter.describe_read(backend, lease, view, decode_hint)
            submitted = time.perf_counter()
        except BaseException:
            lease.release()
            raise
        try:
            attempt = submitter.publish(backend, lease, view, decode_hint, wake)
        except (InvalidSubmission, SubmissionRejected):
            lease.release()  # the backend promises that nothing escaped
            raise
        except BaseException:
            # Rule 3: any other raise means memory access may have escaped (a peer may be
            # reading these rows) and no attempt tells when it stops: never reuse them.
            self._s.quarantine.lease(lease, view)
            raise
        lease.track(attempt)
        return lease, view, prefill_hint, attempt, submitted

    async def _publish_events(self, rid: str, lease: Lease | GroupStream, view: View, prefill_hint: bytes, attempt: Attempt,
                              submitted: float, event: asyncio.Event) -> AsyncGenerator[dict[str, Any], None]:
        s = self._s
        s.calls.streams += 1
        try:
            yield {"event": "published", "hint": base64.b64encode(prefill_hint).decode(), "rows": view.rows}
            outcome = await s.engine.settle(attempt, event, s.config.transfer_timeout_s)
            parts = lease.geometry_views() if isinstance(lease, GroupStream) else geometry_views(lease)
            figures = s.meters.count_transfer(view, outcome, time.perf_counter() - submitted, parts=parts)
            yield {"event": "transfer", "final": True, **figures}
        finally:
            try:
                self.held.pop(rid, None)
                if attempt.poll() is None:  # the router went away mid-transfer
                    await s.engine.run_move(attempt.cancel)
                await s.engine.run_move(s.release_and_free, lease, rid)
            finally:
                s.calls.streams -= 1  # last: "no active stream" means its clean-up is done

    async def drop(self, rid: str) -> bool:
        """An /abort: drop ``rid`` if it is held here (whether it was). Without it nothing is
        awaited, so the caller's tables stay as it saw them."""
        held = self.held.pop(rid, None)
        if held is None:
            return False
        await self._s.engine.run_move(self._drop_held, held, rid)
        return True

    def _drop_held(self, held: Held, rid: str) -> None:
        if held.stream is not None:
            self._end_stream(held.stream)
        self._s.free(rid)

    async def expire(self, now: float) -> None:
        """Drop the prefills never published within hold_s."""
        for rid, held in list(self.held.items()):
            if not held.busy and now - held.since > self._s.config.hold_s:
                self.held.pop(rid, None)
                await self._s.engine.run_move(self._drop_held, held, rid)
