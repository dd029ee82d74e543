"""A prefill worker's role (DESIGN.md section 5):

- ``prefill``: allocate, run the prompt, keep its K/V, answer the first token (greedy, or
  sampled as the call says: index 0 of the completion's stream), with its logprobs when asked.
- ``publish``: ``lend_read``, ``describe`` -> hint P (streamed at once), then
  ``publish(view_P, hint_D)``, stream the outcome, release, free.
"""

from __future__ import annotations

import asyncio
import base64
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from typing import Any

from kvxfer.contract import Attempt, InvalidSubmission, SubmissionRejected, View
from kvxfer.lender import Lease
from kvxfer.worker.calls import PrefillCall, PublishCall, pick_json
from kvxfer.worker.errors import Aborted, Refused
from kvxfer.worker.state import WorkerState


@dataclass(eq=False)
class Held:
    """A prefill request whose K/V waits for a publish."""

    prompt: list[int]
    first: int
    since: float
    busy: bool = False


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
        start = time.perf_counter()
        s.calls.starting[rid] = "prefill"
        try:
            first = await s.serving.prefill(rid, prompt, call.sampling, call.logprobs)
        finally:
            aborted = s.calls.end_start(rid)
        if aborted:
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
        self.held[rid] = Held(prompt, first.token, time.monotonic())
        return {"request": rid, **pick_json(first), "compute_s": seconds, "prompt_tokens": len(prompt),
                "publisher": s.publisher()}

    async def publish(self, call: PublishCall) -> AsyncGenerator[dict[str, Any], None]:
        s = self._s
        s.need("prefill")
        rid = call.request
        held = self.held.get(rid)
        if held is None or held.busy:
            raise Refused(f"request {rid!r} is not held here (never prefilled, already published, or expired)")
        decode_hint = call.decode_hint
        held.busy = True
        event, wake = s.engine.waker()
        try:
            lease, view, prefill_hint, attempt, submitted = await s.engine.run(self._publish_sync, rid,
                                                                               len(held.prompt), decode_hint, wake)
        except BaseException:
            self.held.pop(rid, None)
            await s.engine.cleanup(s.free, rid)
            raise
        return self._publish_events(rid, lease, view, prefill_hint, attempt, submitted, event)

    def _publish_sync(self, rid: str, n: int, decode_hint: Any, wake: Callable[[], None]
                      ) -> tuple[Lease, View, bytes, Attempt, float]:
        backend, mover = self._s.backend, self._s.mover
        assert backend is not None
        lease = self._s.serving.lend_read(rid, n)
        try:
            view = lease.view()
            if view is None:
                raise RuntimeError(f"read lease of {rid!r} is not ready (staging copy pending)")
            # Bound to the decode end that sent hint D: in pull mode hint P lets it READ these rows.
            prefill_hint = mover.describe_read(backend, lease, view, decode_hint)
            submitted = time.perf_counter()
        except BaseException:
            lease.release()
            raise
        try:
            attempt = mover.publish(backend, lease, view, decode_hint, wake)
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

    async def _publish_events(self, rid: str, lease: Lease, view: View, prefill_hint: bytes, attempt: Attempt,
                              submitted: float, event: asyncio.Event) -> AsyncGenerator[dict[str, Any], None]:
        s = self._s
        s.calls.streams += 1
        try:
            yield {"event": "published", "hint": base64.b64encode(prefill_hint).decode(), "rows": view.rows}
            outcome = await s.engine.settle(attempt, event, s.config.transfer_timeout_s)
            figures = s.meters.count_transfer(view, outcome, time.perf_counter() - submitted)
            yield {"event": "transfer", "final": True, **figures}
        finally:
            try:
                self.held.pop(rid, None)
                if attempt.poll() is None:  # the router went away mid-transfer
                    await s.engine.run(attempt.cancel)
                await s.engine.run(s.release_and_free, lease, rid)
            finally:
                s.calls.streams -= 1  # last: "no active stream" means its clean-up is done

    async def drop(self, rid: str) -> bool:
        """An /abort: drop ``rid`` if it is held here (whether it was). Without it nothing is
        awaited, so the caller's tables stay as it saw them."""
        if self.held.pop(rid, None) is None:
            return False
        await self._s.engine.run(self._s.free, rid)
        return True

    async def expire(self, now: float) -> None:
        """Drop the prefills never published within hold_s."""
        for rid, held in list(self.held.items()):
            if not held.busy and now - held.since > self._s.config.hold_s:
                self.held.pop(rid, None)
                await self._s.engine.run(self._s.free, rid)
