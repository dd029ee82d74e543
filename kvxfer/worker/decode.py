"""A decode worker's role (DESIGN.md section 5):

- ``reserve``: allocate, ``lend_write`` the prompt's rows, ``describe`` -> hint D.
- ``generate``: ``fetch(view_D, hint_P)``, ``mark_arrived(masks)``, release, then
  ``readiness()``: resume at ``usable_until`` and recompute the rest (policy recompute) or
  refuse (policy fail); then decode token by token, streaming, each picked as the call's
  sampling says (the prefill worker picked the first the same way), with its logprobs when
  the call asks for them (computed from the logits that picked it). Without a reservation,
  it decodes a prompt locally.

A reservation whose rows a peer may still write is quarantined (``kvxfer.worker.quarantine``)
until it is proven that none can: the publisher's word, or hint D's expiry and a grace.
"""

from __future__ import annotations

import base64
import contextlib
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from typing import Any

from kvxfer import wire
from kvxfer.contract import Attempt, KvxferError, Outcome, Peer, View
from kvxfer.engine import tokens_needed
from kvxfer.engine.sampling import Pick
from kvxfer.lender import Lease
from kvxfer.worker.calls import GenerateCall, ReserveCall, pick_json
from kvxfer.worker.engines import Stream
from kvxfer.worker.errors import Aborted, Refused
from kvxfer.worker.layers import geometry_views
from kvxfer.worker.meters import reason_label
from kvxfer.worker.state import WorkerState


@dataclass(eq=False)
class Reserved:
    """A decode reservation: its write lease and the view behind hint D."""

    prompt: list[int]
    max_new: int
    lease: Lease
    view: View
    since: float
    busy: bool = False
    expires_ms: int = 0  # when hint D expires (wall clock): after it, and a grace, no peer can write here


class DecodeRole:
    def __init__(self, state: WorkerState) -> None:
        self._s = state
        self.reserved: dict[str, Reserved] = {}

    # --- reserve -------------------------------------------------------------------------------
    async def reserve(self, call: ReserveCall) -> dict[str, Any]:
        s = self._s
        s.need("decode")
        rid, prompt, max_new, publisher = call.request, call.prompt, call.max_new_tokens, call.publisher
        if rid in self.reserved or rid in s.calls.starting:
            raise Refused(f"request {rid!r} is already reserved here")
        s.calls.refuse_if_aborted_early(rid)
        s.calls.starting[rid] = "reserve"
        try:
            hint, lease, view, expires, reused, stored = await self._reserve_rows(rid, prompt, max_new, publisher)
        finally:
            aborted = s.calls.end_start(rid)
        if aborted:
            # Hint D would be in this answer, which a 409 replaces: it is never sent, so no
            # peer can write these rows.
            await s.engine.run_move(s.release_and_free, lease, rid)
            raise Aborted(f"request {rid!r} was aborted while it was reserved; its rows are released")
        self.reserved[rid] = Reserved(prompt, max_new, lease, view, time.monotonic(), expires_ms=expires)
        return {"request": rid, "hint": base64.b64encode(hint).decode(), "rows": view.rows,
                "reused_tokens": reused + stored, "store_tokens": stored}

    async def _reserve_rows(self, rid: str, prompt: list[int], max_new: int, publisher: Peer
                            ) -> tuple[bytes, Lease, View, int, int, int]:
        """Allocate (sharing cached prefix blocks), fetch what follows from the store when this
        worker has one, then lend the rest for writing and describe it: hint D, the lease, its
        view, hint D's expiry, the tokens reused here and those the store gave."""
        s = self._s
        reused = await s.engine.run(self._allocate_reserved, rid, prompt, max_new)
        stored = 0
        try:
            if s.store is not None:
                stored = await s.store.lookup(rid, prompt, reused)
            hint, lease, view, expires = await s.engine.run_move(self._lend_reserved, rid, len(prompt), publisher)
        except BaseException:
            await s.engine.cleanup(s.free, rid)
            raise
        return hint, lease, view, expires, reused, stored

    def _allocate_reserved(self, rid: str, prompt: list[int], max_new: int) -> int:
        s = self._s
        need = tokens_needed(len(prompt), max_new)
        if need > s.config.model.max_positions:
            raise Refused(f"prompt plus completion is {need} tokens, over max_positions "
                             f"{s.config.model.max_positions}")
        return s.serving.reserve(rid, prompt, max_new)

    def _lend_reserved(self, rid: str, n: int, publisher: Peer) -> tuple[bytes, Lease, View, int]:
        s = self._s
        backend = s.backend
        assert backend is not None
        lease = None
        try:
            lease = s.serving.lend_write(rid, n)
            view = lease.view()
            if view is None:
                raise Refused("no staging slots free for this reservation now; retry later")
            # Bound to one publisher: in push mode hint D lets its holder WRITE into these rows,
            # which later hold a cached prefix; no other worker, nor a restart of this one, may.
            hint = s.submitter.describe_write(backend, lease, view, publisher)
            # When hint D expires (of a TP group's set, the last): after it, and a grace, time
            # alone proves that no peer can write these rows.
            expires = max(h.expires_ms for h in wire.decode_hints(hint))
        except BaseException:
            if lease is not None:
                lease.release()  # no hint went out: nothing can touch these rows
            raise
        return hint, lease, view, expires

    # --- dropping reservations -----------------------------------------------------------------
    async def drop(self, rid: str, rows_safe: bool) -> bool:
        """An /abort: drop ``rid``'s reservation if it is here and not generating (whether it
        was). Without it nothing is awaited, so the caller's tables stay as it saw them."""
        reserved = self.reserved.get(rid)
        if reserved is None or reserved.busy:
            return False
        del self.reserved[rid]
        await self._s.engine.run_move(self._drop_reservation, rid, reserved, rows_safe)
        return True

    async def expire(self, now: float) -> None:
        """Drop the reservations never generated within hold_s."""
        for rid, reserved in list(self.reserved.items()):
            if not reserved.busy and now - reserved.since > self._s.config.hold_s:
                self.reserved.pop(rid, None)
                await self._s.engine.run_move(self._drop_reservation, rid, reserved, False)

    def quarantine_all(self) -> None:
        """At shutdown: a peer may hold hint D of any reservation left, so none is reused."""
        for r in list(self.reserved.values()):
            self._quarantine(r)
        self.reserved.clear()

    def _drop_reservation(self, rid: str, reserved: Reserved, rows_safe: bool) -> None:
        if rows_safe:
            reserved.lease.release()
        else:
            self._quarantine(reserved, rid=rid)
        self._s.free(rid)

    def _quarantine(self, reserved: Reserved, attempt: Attempt | None = None, rid: str | None = None) -> None:
        self._s.quarantine.reservation(reserved.lease, reserved.view, attempt, rid, reserved.expires_ms)

    # --- generate ------------------------------------------------------------------------------
    async def generate(self, call: GenerateCall, gone: Callable[[], bool] = lambda: False
                       ) -> AsyncGenerator[dict[str, Any], None]:
        """The call's event stream. ``gone``: whether its client has left (the HTTP request's);
        once it has, a fetch under way is cancelled and nothing is decoded for nobody."""
        s = self._s
        s.need("decode")
        rid, policy, rows_safe = call.request, call.on_failure, call.rows_safe
        s.serving.check(call.sampling, call.logprobs)  # what this engine cannot serve, before anything starts
        timeout = call.timeout_s if call.timeout_s is not None else s.config.transfer_timeout_s
        reserved = self.reserved.get(rid)
        if reserved is not None:
            if reserved.busy:
                raise Refused(f"request {rid!r} is already generating")
            reserved.busy = True  # only once the call is known to be well formed
            stream = Stream(rid, reserved.prompt, reserved.max_new, name=rid, owned=True, sampling=call.sampling,
                             logprobs=call.logprobs)
            return self._decode_events(stream, reserved, call.prefill_hint, call.first_token, policy, timeout,
                                       rows_safe, gone)
        if call.prefill_hint is not None:
            raise Refused(f"request {rid!r} has no reservation here: reserve before generating with a hint")
        if call.prompt is None or call.max_new_tokens is None:
            raise Refused(f"request {rid!r} has no reservation here: generating without one needs 'prompt' and "
                          "'max_new_tokens'")
        prompt, max_new = call.prompt, call.max_new_tokens
        need = tokens_needed(len(prompt), max_new)
        if need > s.config.model.max_positions:
            raise Refused(f"prompt plus completion is {need} tokens, over max_positions "
                          f"{s.config.model.max_positions}")
        if rid in s.calls.starting or s.serving.has(rid):
            raise Refused(f"request {rid!r} is already in use here")
        stream = Stream(rid, prompt, max_new, name=rid, owned=False, sampling=call.sampling,
                         generated=call.generated, logprobs=call.logprobs)
        return self._decode_events(stream, None, None, None, policy, timeout, True, gone)

    async def _decode_events(self, stream: Stream, reserved: Reserved | None, prefill_hint: Any, first: int | None,
                             policy: str, timeout: float, rows_safe: bool, gone: Callable[[], bool]
                             ) -> AsyncGenerator[dict[str, Any], None]:
        s = self._s
        s.calls.streams += 1
        rid, prompt = stream.rid, stream.prompt
        n = len(prompt)
        own = reserved  # the reservation this stream took over; others under this id are not ours
        if reserved is None:
            s.calls.starting[rid] = "generate"
        try:
            transfer, first = await self._take_rows(stream, reserved, prefill_hint, first, policy, timeout,
                                                    rows_safe, gone)
            s.calls.starting.pop(rid, None)
            if gone():
                return  # the client left: no recompute, no token, for nobody (finally frees the rows)
            position = await s.engine.run_move(self._usable, stream.name, n)
            if position < n and transfer is not None and policy == "fail":
                yield {"event": "error", "final": True, "transfer": transfer,
                       "error": f"transfer {transfer['status']}: {transfer['rows_delivered']} of {transfer['rows']} "
                                f"rows arrived ({transfer['reason'] or 'incomplete'}); policy is fail"}
                return
            yield {"event": "resume", "position": position, "recompute_tokens": n - position, "transfer": transfer}
            if position < n or first is None:
                local = await self._recompute(stream, position)
                if first is not None and local.token != first:
                    # The rows that arrived are suspect: never name them for reuse (_finish).
                    stream.suspect = True
                    yield {"event": "error", "final": True,
                           "error": f"recomputed first token {local.token} differs from the prefill worker's {first}"}
                    return
                first = local.token
                yield {"event": "token", "index": 0, **pick_json(local)}
            index, start = 0, time.perf_counter()
            async with contextlib.aclosing(s.serving.tokens(stream, first)) as picks:
                async for pick in picks:
                    index += 1
                    s.meters.step.observe(time.perf_counter() - start)
                    s.meters.tokens.inc()
                    yield {"event": "token", "index": index, **pick_json(pick)}
                    start = time.perf_counter()
            # Fewer than max_new where the engine ends a request at its end-of-sequence token.
            yield {"event": "done", "final": True, "tokens": index + 1}
        finally:
            try:
                if own is None:
                    s.calls.starting.pop(rid, None)
                elif self.reserved.get(rid) is own:
                    del self.reserved[rid]
                if stream.owned:
                    await s.engine.run(self._finish, stream.name, prompt, not stream.suspect)
            finally:
                s.calls.streams -= 1  # last: "no active stream" means its clean-up is done

    async def _take_rows(self, stream: Stream, reserved: Reserved | None, prefill_hint: Any, first: int | None,
                         policy: str, timeout: float, rows_safe: bool, gone: Callable[[], bool]
                         ) -> tuple[dict[str, Any] | None, int | None]:
        """Make the stream's pool request hold the prompt's rows: fetched into its reservation,
        or, without a usable one, fresh blocks under ``rid#local`` to recompute into. Returns
        the transfer's figures (None when none ran) and the first token still to be trusted."""
        s, rid = self._s, stream.rid
        transfer: dict[str, Any] | None = None
        if reserved is not None and prefill_hint is not None:
            try:
                transfer = await self._fetch(stream, reserved, prefill_hint, timeout, gone)
            except (KvxferError, RuntimeError) as exc:
                # The fetch was refused or never settled; its rows stay out of use (see
                # _fetch). Policy recompute: prefill the whole prompt in fresh blocks.
                if policy == "fail":
                    raise
                s.meters.failures.inc(reason=reason_label(None, str(exc)))
                transfer = {"status": "failed", "reason": f"{type(exc).__name__}: {exc}",
                            "rows": reserved.view.rows, "rows_delivered": 0, "bytes": 0, "seconds": 0.0}
                stream.owned = False
                await s.engine.run(s.free, rid)
                stream.name, reserved = f"{rid}#local", None
        elif reserved is not None:
            # No hint P: the prefill side failed before publishing. Unless the router
            # knows it cannot write into our rows, quarantine them and start afresh.
            stream.owned = False
            await s.engine.run_move(self._drop_reservation, rid, reserved, rows_safe)
            stream.name = f"{rid}#local"
            reserved = None
            first = None
        if reserved is None:
            await s.engine.run(self._allocate_local, stream.name, stream.prompt, stream.max_new)
            stream.owned = True
        return transfer, first

    async def _recompute(self, stream: Stream, position: int) -> Pick:
        """Run the prompt from ``position`` on: the first token, as this worker computes it."""
        s = self._s
        start = time.perf_counter()
        local = await s.serving.first(stream, position)
        s.meters.prefill.observe(time.perf_counter() - start)
        s.meters.recomputed.inc(len(stream.prompt) - position)
        s.meters.tokens.inc()
        return local

    async def _fetch(self, stream: Stream, reserved: Reserved, prefill_hint: Any, timeout: float,
                     gone: Callable[[], bool]) -> dict[str, Any]:
        s, rid = self._s, stream.rid
        event, wake = s.engine.waker()
        submitted = time.perf_counter()
        try:
            attempt = await s.engine.run_move(self._fetch_sync, reserved, prefill_hint, wake)
        except BaseException:
            # Refused (e.g. a layout mismatch, a replayed hint): no attempt watches the peer
            # that holds hint D, so, as for a reservation dropped without rows_safe, these rows
            # stay out of use until that peer takes hint D back or hint D has expired and any
            # transfer begun with it has ended (kvxfer.worker.quarantine). On the engine
            # thread, as every change to the quarantine: its reclaim pass there replaces the
            # lists an append from here would go into. (Torn down meanwhile: the lender's
            # forced shutdown retained the rows.)
            await s.engine.cleanup(self._quarantine, reserved, None, rid)
            raise
        try:
            outcome = await s.engine.settle(attempt, event, timeout, gone)
        except RuntimeError:
            # Never concluded: its rows stay out of use until the attempt quiesces (a late
            # confirmation, the peer proven dead); recompute elsewhere in the pool.
            await s.engine.run_move(self._quarantine, reserved, attempt)
            raise
        left = gone()
        figures = s.meters.count_transfer(reserved.view, outcome, time.perf_counter() - submitted, unwanted=left,
                                          parts=geometry_views(reserved.lease))
        await s.engine.run_move(self._arrive, reserved, outcome)
        if left:
            # Nothing will be decoded into these rows, so the stream need not wait for the
            # attempt to quiesce: until it does (a peer may still write), they are set aside,
            # and never named for prefix reuse.
            stream.suspect = await s.engine.run_move(self._set_aside_unless_quiet, reserved, attempt)
            return figures
        # Decoding writes into the prompt's last block, which the lease pins until the
        # attempt is quiesced: wait for that (the backend wakes us) before going on.
        if not await s.engine.wait(attempt, event, 10.0, lambda a: a.quiesced()):
            raise RuntimeError(f"request {rid!r}: the fetch attempt concluded but did not quiesce within 10s")
        return figures

    # --- engine thread -------------------------------------------------------------------------
    def _fetch_sync(self, reserved: Reserved, prefill_hint: Any, wake: Callable[[], None]) -> Attempt:
        backend = self._s.backend
        assert backend is not None
        attempt = self._s.submitter.fetch(backend, reserved.lease, reserved.view, prefill_hint, wake)
        reserved.lease.track(attempt)
        return attempt

    def _arrive(self, reserved: Reserved, outcome: Outcome) -> None:
        reserved.lease.mark_arrived(outcome.masks)
        reserved.lease.release()

    def _set_aside_unless_quiet(self, reserved: Reserved, attempt: Attempt) -> bool:
        """Quarantine the reservation's rows until ``attempt`` quiesces, unless it has: whether
        they were set aside."""
        if attempt.quiesced():
            return False
        self._quarantine(reserved, attempt)
        return True

    def _allocate_local(self, name: str, prompt: list[int], max_new: int) -> None:
        self._s.serving.allocate_local(name, prompt, max_new)

    def _usable(self, name: str, n: int) -> int:
        return self._s.serving.usable(name, n)

    def _finish(self, name: str, prompt: list[int], shareable: bool = True) -> None:
        self._s.serving.finish(name, prompt, shareable)
