"""The embeddable router: pairs a prefill and a decode worker per request and streams tokens.

    async with Router(prefill=["http://127.0.0.1:8001"], decode=["http://127.0.0.1:8002"],
                      selection="least_outstanding", on_failure="recompute") as router:
        async for item in router.stream(prompt_ids, max_new_tokens=32, stop_ids={2}):
            if isinstance(item, Token): ...       # index, token, seconds since the request began
            else: completion = item               # the last item: a Completion (tokens, finish_reason, error)
        completion = await router.generate(prompt_ids, 32)   # the same, collected
        completion = await router.generate(prompt_ids, 32, sampling=SamplingParams(temperature=0.8, top_p=0.9))
        router.add_worker("decode", "http://10.0.0.7:8002")  # or remove_worker(url), while it serves
    # leaving the block closes it (or await router.close()): lets its background aborts land,
    # closes its HTTP session

Greedy unless ``sampling`` says otherwise (``kvxfer.engine.sampling``); a sampled request
without a seed gets a random one here, sent to both workers, so the prefill worker's first
token and the decode worker's later ones come from one stream (``Completion.seed`` names it).

A request the workers' model cannot serve raises ``InvalidRequest`` (``validate``), in this
process as over HTTP. ``health()`` asks every worker and says whether a pair is usable.
``kvxfer.router.openai`` puts text, chat and OpenAI's protocol on top.

``cluster_key`` (a ``kvxfer.serving.keys.BearerKey``) goes to the workers on every call, for
workers that want one.

A ``request`` id given to ``stream``/``generate`` is the client's: it comes back as
``Completion.request`` and goes to no worker. The workers see an id the router makes per
request, so clients that choose the same id (or one the router made) never meet there.

Per request (DESIGN.md section 5): reserve on the decode worker *while* the prefill worker
runs the prompt (two concurrent calls); the first token streams as soon as prefill answers.
Then publish on the prefill worker with the decode hint; as soon as it answers with its
own hint, generate on the decode worker with it; the decode worker fetches, resumes and
streams the rest. The router never looks inside hints: they are opaque bytes.

Failure policy: ``fail`` reports the failure in the Completion (``error``), naming the
worker and what happened. ``recompute`` finishes the request anyway: a failed transfer is
resumed by the decode worker from what arrived (it prefills the rest itself); a dead
prefill worker means the decode worker prefills from scratch; a dead decode worker means
another decode worker continues from the prompt plus the tokens already streamed. A worker
that refuses connections is skipped for ``probe_interval_s`` and then tried again.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Collection, Sequence
from typing import Any

from kvxfer.engine.sampling import GREEDY, InvalidSampling, SamplingParams
from kvxfer.router.cleanup import Cleanup
from kvxfer.router.constants import POLICIES
from kvxfer.router.inputs import InvalidRequest, MixedEngines, check_limits, check_logprobs, check_shape
from kvxfer.router.meters import RouterMeters
from kvxfer.router.results import Completion, Token, TransferFigures
from kvxfer.router.run import Failure, Run, generated, rows_safe_after, sampled, settled
from kvxfer.router.workers import (
    REFERENCE_ENGINE,
    ModelLimits,
    RouterHealth,
    WorkerEndpoint,
    WorkerSet,
    judge,
    mixed_engines,
)
from kvxfer.serving.http import HttpClient, HttpError
from kvxfer.serving.keys import BearerKey
from kvxfer.serving.keys import headers as key_headers
from kvxfer.serving.metrics import Registry

log = logging.getLogger("kvxfer.router")

WORKER_SETTLE_S = 15.0
"""A decode worker's waits after a fetch's deadline: cancel grace (5 s) plus quiescence (10 s)."""




class Router:
    def __init__(self, prefill: Sequence[str], decode: Sequence[str], *, selection: str = "round_robin",
                 on_failure: str = "fail", timeout_s: float = 30.0, connect_timeout_s: float = 2.0,
                 probe_interval_s: float = 1.0, cluster_key: BearerKey | None = None) -> None:
        # No decode worker yet is allowed (workers discovered later, add_worker): until one is
        # added, requests are answered "unavailable".
        if not 0 < timeout_s < float("inf"):
            raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
        if on_failure not in POLICIES:
            raise ValueError(f"on_failure must be one of {POLICIES}, got {on_failure!r}")
        self.workers = WorkerSet(prefill, decode, selection)  # ValueError for a URL without a port
        self.on_failure = on_failure
        self.timeout_s = timeout_s
        self._limits: ModelLimits | None = None  # the workers' model, from the first /health that says it
        self.connect_timeout_s = connect_timeout_s
        self.probe_interval_s = probe_interval_s
        self._ids = itertools.count()
        # Workers key everything by request id, and several routers may share a worker: the
        # tag keeps this router's keys apart from another's, the counter apart from its own.
        self._tag = uuid.uuid4().hex[:12]
        # One pooled session for every worker call, closed by close(); it sends the workers'
        # cluster key, if any, on each (kvxfer.serving.keys).
        self._http = HttpClient(headers=key_headers(cluster_key))
        self._cleanup = Cleanup(self._http, timeout_s, connect_timeout_s)
        self.served_model: str | None = None
        """The model name clients use, when not the workers' (``OpenAIFrontend``'s ``model``):
        the ``model_name`` label of the vllm: series."""
        self._runs: set[Run] = set()  # the requests in flight, for the vllm: gauges
        self.meters = RouterMeters(lambda: self.workers, lambda: tuple(self._runs), self._model_name)

    def _model_name(self) -> str:
        if self.served_model is not None:
            return self.served_model
        return self._limits.name if self._limits is not None else ""

    async def __aenter__(self) -> Router:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def prefill(self) -> list[WorkerEndpoint]:
        return self.workers.prefill

    @property
    def decode(self) -> list[WorkerEndpoint]:
        return self.workers.decode

    @property
    def selection(self) -> str:
        return self.workers.selection

    def add_worker(self, role: str, url: str) -> None:
        """Serve the next requests with this worker too. ValueError for a bad role, a URL
        without host and port, or one the router has already."""
        self.workers.add(role, url)
        log.info("%s worker %s added", role, url)

    def remove_worker(self, url: str) -> None:
        """Give this worker no new request; the ones it has run to their end (a decode worker
        finishes its streams). KeyError when the router does not have it. The last decode
        worker may go too: requests are then answered "unavailable" until one is added."""
        e = self.workers.remove(url)
        log.info("%s worker %s removed (%d requests of it still in flight)", e.role, e.url, e.outstanding)

    # --- selection ---------------------------------------------------------------------------
    def _pick(self, role: str, exclude: frozenset[str] = frozenset()) -> WorkerEndpoint | None:
        return self.workers.pick(role, exclude)

    def _down(self, endpoint: WorkerEndpoint, exc: BaseException) -> None:
        if isinstance(exc, HttpError) and exc.status == 400:
            return  # the worker is fine: it named what is wrong with the request
        log.warning("%s worker %s failed: %s", endpoint.role, endpoint.url, exc)
        endpoint.failures += 1
        self.meters.worker_failures.inc(role=endpoint.role, worker=endpoint.url)
        if isinstance(exc, HttpError) and exc.unreachable:
            endpoint.down_until = time.monotonic() + self.probe_interval_s
            endpoint.publisher = None  # it may come back as another run: ask again
            endpoint.engine = None

    # --- the public surface -------------------------------------------------------------------
    async def generate(self, prompt: Sequence[int], max_new_tokens: int, request: str | None = None, *,
                       stop_ids: Collection[int] = (), until: Callable[[Token], bool] | None = None,
                       sampling: SamplingParams = GREEDY) -> Completion:
        async for item in self.stream(prompt, max_new_tokens, request, stop_ids=stop_ids, until=until,
                                      sampling=sampling):
            if isinstance(item, Completion):
                return item
        raise AssertionError("stream ended without a Completion")

    async def stream(self, prompt: Sequence[int], max_new_tokens: int, request: str | None = None, *,
                     stop_ids: Collection[int] = (), until: Callable[[Token], bool] | None = None,
                     sampling: SamplingParams = GREEDY,
                     logprobs: int | None = None) -> AsyncGenerator[Token | Completion, None]:
        """Tokens as they come, then the Completion. The request ends, with finish_reason
        "stop", after a token of ``stop_ids`` or one for which ``until`` (asked once the
        caller has taken the token: a stop string) is true. InvalidRequest, before anything
        is sent to a worker, for a request the workers' model cannot serve (``validate``).
        ``sampling`` picks the tokens (greedy by default); without a seed it gets a random one.
        ``logprobs`` k (0 to 20): each Token carries its logprob and the k likeliest tokens'."""
        await self.validate(prompt, max_new_tokens, stop_ids, sampling)
        check_logprobs(logprobs)
        key = self._key()
        run = Run(request or key, key, [int(t) for t in prompt], max_new_tokens, time.perf_counter(),
                  sampling.with_seed(), logprobs)
        stops = frozenset(int(t) for t in stop_ids)
        error: str | None = None
        finish = "length"
        self._runs.add(run)
        try:
            async with contextlib.aclosing(self._serve(run)) as tokens:
                async for item in tokens:
                    yield item
                    if item.token in stops or (until is not None and until(item)):
                        finish = "stop"
                        break  # closing _serve closes the decode stream: the worker stops there
        except Failure as exc:
            error, finish = str(exc), "unavailable" if exc.unavailable else "error"
        except GeneratorExit:
            # The caller closed the stream before its end (a client that left): counted, so
            # that every request sent is in the requests counter.
            self.meters.requests.inc(result="cancelled", path=run.path)
            raise
        finally:
            self._runs.discard(run)
        completion = Completion(
            run.rid, len(run.prompt), tuple(run.emitted), run.ttft, time.perf_counter() - run.start, run.prefill,
            run.decode, run.transfer, run.recomputed, run.path, error, tuple(run.events), finish,
            None if run.sampling.greedy else run.sampling.seed)
        self.meters.count(completion, run.times)
        yield completion

    async def validate(self, prompt: Sequence[int], max_new_tokens: int, stop_ids: Collection[int] = (),
                       sampling: SamplingParams = GREEDY) -> None:
        """InvalidRequest naming what the workers' model cannot serve: a prompt that is not
        token ids, ids past its vocabulary (a ``logit_bias`` too), more tokens than its
        positions. The limits come from the workers' /health; with no worker answering, only
        the shape is checked."""
        check_shape(prompt, max_new_tokens, stop_ids)
        if not isinstance(sampling, SamplingParams):
            raise InvalidRequest(f"'sampling' must be a SamplingParams, got {type(sampling).__name__}")
        await self.check_engines()
        limits = await self.model()
        if limits is not None:
            check_limits(prompt, max_new_tokens, limits)
            try:
                sampling.check_vocab(limits.vocab_size)
            except InvalidSampling as exc:
                raise InvalidRequest(str(exc)) from None

    def _key(self) -> str:
        """A worker-side id no other request of any router gets. A client's own id is never
        sent to a worker: two clients choosing one id (or one a key of ours) would then share
        a worker's held prefill, reservation or abort, and the later call be refused."""
        return f"r{self._tag}-{next(self._ids)}"

    async def health(self) -> RouterHealth:
        """Ask every worker's /health now: who answers, and whether a request can be served."""
        async def one(e: WorkerEndpoint) -> tuple[str, bool]:
            try:
                await self._http.request_json(e.url, "GET", "/health", timeout=self.connect_timeout_s)
                e.down_until = 0.0
                return e.url, True
            except HttpError:
                return e.url, False
        answers = await asyncio.gather(*(one(e) for e in self.prefill + self.decode))
        n = len(self.prefill)
        return judge(answers[:n], answers[n:], self.on_failure)

    async def check_engines(self) -> None:
        """MixedEngines naming both engines when the workers run different ones (kvxfer serve
        --engine); each worker's engine is learnt from its /health once, while it answers."""
        now = time.monotonic()
        unknown = [e for e in self.workers if e.engine is None and e.down_until <= now]
        if unknown:
            async def learn(e: WorkerEndpoint) -> None:
                try:
                    health = await self._http.request_json(e.url, "GET", "/health", timeout=self.connect_timeout_s)
                except HttpError:
                    return
                named = health.get("engine") if isinstance(health, dict) else None
                e.engine = named if isinstance(named, str) and named else REFERENCE_ENGINE
            await asyncio.gather(*(learn(e) for e in unknown))
        problem = mixed_engines(list(self.workers))
        if problem is not None:
            raise MixedEngines(problem)

    async def model(self) -> ModelLimits | None:
        """The workers' model as their /health states it (learnt once), or None while no
        worker answers."""
        if self._limits is None:
            for e in self.decode + self.prefill:
                try:
                    health = await self._http.request_json(e.url, "GET", "/health", timeout=self.connect_timeout_s)
                except HttpError:
                    continue
                limits = health.get("limits") if isinstance(health, dict) else None
                if isinstance(limits, dict) and all(isinstance(limits.get(k), int)
                                                    for k in ("vocab_size", "max_positions")):
                    name = health.get("model")
                    self._limits = ModelLimits(name if isinstance(name, str) else "", limits["vocab_size"],
                                               limits["max_positions"])
                    break
        return self._limits

    async def _identify(self, p: WorkerEndpoint) -> str | None:
        """Learn a prefill worker's {agent, run}, which hint D is bound to; what went wrong, or None."""
        try:
            health = await self._http.request_json(p.url, "GET", "/health", timeout=self.connect_timeout_s)
        except HttpError as exc:
            self._down(p, exc)
            return f"prefill worker {p.url}: {exc}"
        p.publisher = health.get("publisher") if isinstance(health, dict) else None
        layerwise = health.get("layerwise", 1) if isinstance(health, dict) else 1
        p.layerwise = layerwise if isinstance(layerwise, int) and not isinstance(layerwise, bool) else 1
        return None if p.publisher is not None else f"prefill worker {p.url}: its /health names no publisher"

    # --- one request ---------------------------------------------------------------------------
    async def _serve(self, run: Run) -> AsyncGenerator[Token, None]:
        d = self._pick("decode")
        if d is None:
            raise Failure("no decode worker is reachable", dead=True, unavailable=True)
        p = self._pick("prefill")
        unknown = await self._identify(p) if p is not None and p.publisher is None else None
        if unknown is not None:
            # Nothing of this request is held anywhere yet: go on as without a prefill worker.
            if self.on_failure == "fail":
                raise Failure(unknown, dead=True, unavailable=True)
            run.events.append(unknown)
            p = None
        if p is None:
            if self.on_failure == "fail":
                raise Failure("no prefill worker is reachable (policy fail)", dead=True, unavailable=True)
            run.events.append("no prefill worker reachable: decode prefills")
            try:
                async for t in self._local(run, d):
                    yield t
            except Failure as exc:
                if not exc.dead:
                    raise
                async for t in self._after_decode_loss(run, d, str(exc)):  # another decode worker goes on
                    yield t
            return
        run.prefill, run.decode = p.url, d.url
        p.outstanding += 1
        d.outstanding += 1
        try:
            async for t in self._disaggregated(run, p, d):
                yield t
        finally:
            p.outstanding -= 1
            d.outstanding -= 1

    async def _disaggregated(self, run: Run, p: WorkerEndpoint, d: WorkerEndpoint) -> AsyncIterator[Token]:
        t = self.timeout_s
        # Hint D is bound to the prefill worker's run: no other worker, nor a restart of it,
        # may write into the reservation's rows with it.
        ask = {"request": run.key, "prompt": run.prompt, "max_new_tokens": run.max_new, "publisher": p.publisher}
        # Layer-wise streaming: hint D goes with /prefill, so the prefill worker publishes
        # each layer group as its forward computes it; the reservation comes first.
        early = p.layerwise > 1
        reserved, prefilled = await self._reserve_and_prefill(run, p, d, ask, early)
        sent = early and not isinstance(reserved, BaseException)  # hint D reached the prefill worker
        doomed = isinstance(reserved, BaseException) and self.on_failure == "fail"
        if not isinstance(prefilled, BaseException) and not doomed:
            # (Under policy fail a failed reservation ends the request: it ends before its
            # first token, which a caller can then tell from a failure midway.)
            tok = run.token(0, int(prefilled["token"]), prefilled)
            if tok is not None:
                try:
                    yield tok
                except GeneratorExit:
                    # The client left before hint D went to the prefill worker: nothing can
                    # write into the reservation, so both ends drop it now (rows reusable)
                    # rather than the decode end quarantining it when it expires. (Sent
                    # with /prefill, it may be in use: the decode end sets the rows aside.)
                    self._abandon(run.key, p, d, rows_safe=not sent)
                    raise
            reserved = await self._rebound(run, p, d, ask, reserved, prefilled)
        if isinstance(reserved, BaseException):
            await self._reserve_failed(run, p, d, reserved, prefilled)
            async for tok in self._after_decode_loss(run, d, f"reserve on {d.url} failed: {reserved}"):
                yield tok
            return
        if isinstance(prefilled, BaseException):
            # The prefill worker never saw hint D (unless it went with /prefill: then ask it
            # to take hint D back, as after a failed publish): nothing can write into the reservation.
            safe = not sent or await self._cleanup.withdrawn_or_later(p, d, run.key, reserved["hint"])
            async for tok in self._after_prefill_loss(run, p, d, f"prefill on {p.url} failed: {prefilled}", safe):
                yield tok
            return
        # Publish: the prefill worker answers with its hint as soon as the transfer is posted.
        publish = self._http.stream_json(p.url, "/publish", {"request": run.key, "hint": reserved["hint"]}, t, t)
        try:
            published = await publish.__anext__()
            if published.get("event") != "published":
                raise HttpError(f"{p.url}/publish: {published.get('error', published)}")
        except (HttpError, StopAsyncIteration) as exc:
            safe = await self._publish_failed(run, p, d, publish, reserved["hint"], exc)
            async for tok in self._after_prefill_loss(run, p, d, f"publish on {p.url} failed: {exc}", safe):
                yield tok
            return
        outcome = asyncio.create_task(self._publish_outcome(publish))
        try:
            body = sampled(run, {"request": run.key, "hint": published["hint"], "first_token": run.emitted[0],
                                  "on_failure": self.on_failure, "timeout_s": t})
            async for tok in self._generate(run, d, body):
                yield tok
        except Failure as exc:
            if not exc.dead:
                raise
            async for tok in self._after_decode_loss(run, d, str(exc)):
                yield tok
        finally:
            figures = await settled(outcome, t)
            if figures is not None:
                run.transfer = figures  # the publisher's view: submission to its outcome

    async def _reserve_and_prefill(self, run: Run, p: WorkerEndpoint, d: WorkerEndpoint, ask: dict[str, Any],
                                   early: bool = False) -> tuple[Any, Any]:
        """Reserve on ``d`` while ``p`` runs the prompt: each answer, or what its call raised.
        ``early`` (layer-wise streaming): reserve first, then prefill with hint D."""
        t = self.timeout_s
        if early:
            return await self._reserve_then_prefill(run, p, d, ask)
        reserve = asyncio.create_task(self._http.request_json(d.url, "POST", "/reserve", ask, t))
        prefill = asyncio.create_task(self._http.request_json(p.url, "POST", "/prefill", sampled(
            run, {"request": run.key, "prompt": run.prompt}), t))
        reserved: Any
        prefilled: Any
        try:
            reserved, prefilled = await asyncio.gather(reserve, prefill, return_exceptions=True)
        except asyncio.CancelledError:
            # The caller gave up (cancelled, or a server closing its streams): both calls may
            # still complete at their workers, whose handlers run on; hint D never left.
            reserve.cancel()
            prefill.cancel()
            self._abandon(run.key, p, d)
            raise
        return self._prefill_answered(run, p, reserved, prefilled)

    async def _reserve_then_prefill(self, run: Run, p: WorkerEndpoint, d: WorkerEndpoint, ask: dict[str, Any]
                                    ) -> tuple[Any, Any]:
        body = sampled(run, {"request": run.key, "prompt": run.prompt})
        try:
            (reserved,) = await asyncio.gather(self._http.request_json(d.url, "POST", "/reserve", ask, self.timeout_s),
                                               return_exceptions=True)
            if not isinstance(reserved, BaseException):  # else prefill without it: _reserve_failed goes on
                body["hint"] = reserved["hint"]
            (prefilled,) = await asyncio.gather(self._http.request_json(p.url, "POST", "/prefill", body,
                                                                        self.timeout_s), return_exceptions=True)
        except asyncio.CancelledError:
            # Hint D may have gone with /prefill, whose handler runs on: the decode end sets
            # the rows aside until no peer can write them.
            self._abandon(run.key, p, d, rows_safe="hint" not in body)
            raise
        return self._prefill_answered(run, p, reserved, prefilled)

    def _prefill_answered(self, run: Run, p: WorkerEndpoint, reserved: Any, prefilled: Any) -> tuple[Any, Any]:
        if isinstance(prefilled, BaseException):
            self._down(p, prefilled)
            # A worker's handler runs on after its client gave up (a timeout here), so the
            # prefill may still be made there: drop it then, not when it expires (hold_s).
            self._cleanup.abort_later(p, {"request": run.key})
        return reserved, prefilled

    async def _rebound(self, run: Run, p: WorkerEndpoint, d: WorkerEndpoint, ask: dict[str, Any], reserved: Any,
                       prefilled: dict[str, Any]) -> Any:
        """The reservation to publish into: ``reserved``, or one made again for the prefill
        worker's run when /prefill names another than the one ``ask`` bound hint D to."""
        if isinstance(reserved, BaseException) or prefilled.get("publisher") == ask["publisher"]:
            return reserved
        # The prefill worker restarted since we learnt who it is: hint D, bound to its old
        # run, would be refused. Hint D went nowhere, so the rows are safe to drop.
        p.publisher = prefilled.get("publisher")
        run.events.append(f"prefill worker {p.url} is another run now: reserved again for it")
        await self._cleanup.abort(d, {"request": run.key, "rows_safe": True})
        try:
            return await self._http.request_json(d.url, "POST", "/reserve", {**ask, "publisher": p.publisher}, self.timeout_s)
        except HttpError as exc:
            return exc

    async def _reserve_failed(self, run: Run, p: WorkerEndpoint, d: WorkerEndpoint, exc: BaseException, prefilled: Any) -> None:
        self._down(d, exc)
        # The reservation may still be made after our timer fired, as the prefill above.
        # Hint D never reached us, so no prefill worker can write into its rows: they
        # are reusable. In the background: this worker just failed to answer in time.
        self._cleanup.abort_later(d, {"request": run.key, "rows_safe": True})
        if not isinstance(prefilled, BaseException):
            await self._cleanup.abort(p, {"request": run.key})

    async def _publish_failed(self, run: Run, p: WorkerEndpoint, d: WorkerEndpoint,
                              publish: AsyncGenerator[dict[str, Any], None], hint: str, exc: BaseException) -> bool:
        """After /publish failed before its hint: whether the reservation's rows are safe to reuse."""
        await publish.aclose()
        self._down(p, exc)
        # Unless the error says: nothing says whether the publisher wrote: ask it to take
        # hint D back, and keep asking in the background until the decode worker may reuse the rows.
        return rows_safe_after(exc) or await self._cleanup.withdrawn_or_later(p, d, run.key, hint)

    async def _publish_outcome(self, publish: AsyncGenerator[dict[str, Any], None]) -> TransferFigures | None:
        try:
            async for event in publish:
                if event.get("event") == "transfer":
                    return TransferFigures.from_event(event)
        except HttpError:
            return None
        finally:
            await publish.aclose()
        return None

    async def _generate(self, run: Run, d: WorkerEndpoint, body: dict[str, Any]) -> AsyncIterator[Token]:
        """Run /generate on ``d``; a cut stream raises Failure(dead=True).

        The decode worker gives its fetch ``timeout_s``, then a cancel grace and a quiescence
        wait, before its first event says how it resumes: the router waits that long too, or
        its own timer would fire first and policy recompute could never resume there."""
        idle = self.timeout_s + WORKER_SETTLE_S
        events = self._http.stream_json(d.url, "/generate", body, self.timeout_s, idle)
        try:
            async for event in events:
                tok = generated(run, d, event)
                if tok is not None:
                    yield tok
        except HttpError as exc:
            if exc.status == 400:  # the worker is fine: it named what is wrong with the request
                raise Failure(f"decode {d.url} refused the request: {exc}", dead=False) from None
            self._down(d, exc)
            raise Failure(f"decode {d.url} failed: {exc}", dead=True) from None
        finally:
            await events.aclose()  # now, not at garbage collection: the worker sees the router leave

    async def _after_prefill_loss(self, run: Run, p: WorkerEndpoint, d: WorkerEndpoint, what: str,
                                  rows_safe: bool) -> AsyncIterator[Token]:
        run.events.append(what)
        if self.on_failure == "fail":
            await self._cleanup.abort(d, {"request": run.key, "rows_safe": rows_safe})
            raise Failure(f"{what} (policy fail)", dead=False, unavailable=not run.emitted)
        run.path = "local"
        body = sampled(run, {"request": run.key, "on_failure": "recompute", "rows_safe": rows_safe,
                              "timeout_s": self.timeout_s})
        try:
            async for tok in self._generate(run, d, body):
                yield tok
        except Failure as exc:
            if not exc.dead:
                raise
            async for tok in self._after_decode_loss(run, d, str(exc)):
                yield tok
        run.recomputed = max(run.recomputed, len(run.prompt))

    async def _after_decode_loss(self, run: Run, d: WorkerEndpoint, what: str) -> AsyncIterator[Token]:
        run.events.append(what)
        # Nothing streamed yet: the caller may try again later, as with no worker at all.
        unavailable = not run.emitted
        if self.on_failure == "fail":
            raise Failure(f"{what} (policy fail)", dead=False, unavailable=unavailable)
        other = self._pick("decode", exclude=frozenset({d.url}))
        if other is None:
            raise Failure(f"{what}; no other decode worker to recompute on", dead=False, unavailable=unavailable)
        async for tok in self._local(run, other):
            yield tok

    async def _local(self, run: Run, d: WorkerEndpoint) -> AsyncIterator[Token]:
        """The decode worker prefills the prompt plus every token streamed so far, then goes on."""
        done = len(run.emitted)
        if done >= run.max_new:
            return  # the lost worker had streamed every token asked for: nothing is left to do
        run.path, run.decode = "local", d.url
        context = run.prompt + run.emitted
        run.recomputed += len(context)
        # The emitted tokens are the completion's: penalties count them and the next draw is index ``done``.
        body = sampled(run, {"request": f"{run.key}-local{done}", "prompt": context, "max_new_tokens": run.max_new - done,
                              "on_failure": "recompute", "timeout_s": self.timeout_s, "generated": done})
        d.outstanding += 1
        try:
            shifted = Run(run.rid, run.key, context, run.max_new - done, run.start, logprobs=run.logprobs)
            async for event in self._generate(shifted, d, body):
                tok = run.token(done + event.index, event.token, {"logprob": event.logprob,
                                                                   "top_logprobs": event.top_logprobs})
                if tok is not None:
                    yield tok
        finally:
            d.outstanding -= 1

    def _abandon(self, key: str, p: WorkerEndpoint, d: WorkerEndpoint, rows_safe: bool = True) -> None:
        """Drop a request's prefill and reservation in the background: called where the
        request's own task is being closed and can await nothing more. ``rows_safe``: no
        prefill worker holds hint D (else the decode end sets the rows aside)."""
        self._cleanup.abort_later(p, {"request": key})
        self._cleanup.abort_later(d, {"request": key, "rows_safe": rows_safe})

    async def close(self) -> None:
        """Give the background aborts ``connect_timeout_s`` to land, then cancel the rest
        (a worker's sweeper drops what they did not reach), and close the HTTP session. The
        router stays usable."""
        await self._cleanup.close()
        await self._http.close()  # its connections; the next call opens a new session

    # --- metrics --------------------------------------------------------------------------------
    @property
    def metrics(self) -> Registry:
        """This router's metrics: a prometheus_client CollectorRegistry of its own, which an
        embedder may register in theirs (``REGISTRY.register(router.metrics)``)."""
        return self.meters.registry

    def metrics_text(self) -> str:
        return self.metrics.render()

    async def worker_metrics(self) -> dict[str, str]:
        """Each worker's /metrics text (unreachable ones are left out)."""
        out = {}
        for e in self.prefill + self.decode:
            with contextlib.suppress(HttpError):
                out[e.url] = await self._http.request_text(e.url, "/metrics", self.connect_timeout_s)
        return out
