"""One request as the router runs it: its state (``Run``: the tokens streamed, the workers
and the transfer's figures), the failure that ends or diverts it (``Failure``), and the
helpers that read the workers' answers into it. ``kvxfer.router.router`` drives it."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from kvxfer.contract import KvxferError
from kvxfer.engine.sampling import GREEDY, SamplingParams
from kvxfer.router.results import Token, TransferFigures
from kvxfer.router.workers import WorkerEndpoint
from kvxfer.serving.http import HttpError


class Failure(KvxferError):
    def __init__(self, message: str, *, dead: bool, unavailable: bool = False) -> None:
        super().__init__(message)
        self.dead = dead
        self.unavailable = unavailable  # no usable pair: nothing of the request ran anywhere


@dataclass(eq=False)
class Run:
    rid: str  # the client's id, only echoed back in the Completion
    key: str  # the id the workers see: the router's own, unique per request (see Router._key)
    prompt: list[int]
    max_new: int
    start: float
    sampling: SamplingParams = GREEDY
    logprobs: int | None = None  # each token's logprob and this many likeliest tokens' asked of the workers
    emitted: list[int] = field(default_factory=list)
    ttft: float | None = None
    prefill: str | None = None
    decode: str | None = None
    transfer: TransferFigures | None = None
    recomputed: int = 0
    path: str = "disaggregated"
    events: list[str] = field(default_factory=list)
    times: list[float] = field(default_factory=list)  # each emitted token's at_s

    def token(self, index: int, token: int, answer: dict[str, Any] | None = None) -> Token | None:
        """Accept token ``index`` once (a recompute re-sends tokens the router already has)."""
        if index < len(self.emitted):
            if self.emitted[index] != token:
                raise Failure(f"token {index} diverged on recompute: {token} after {self.emitted[index]}", dead=False)
            return None
        if index != len(self.emitted):
            raise Failure(f"token {index} arrived before token {len(self.emitted)}", dead=False)
        self.emitted.append(token)
        now = time.perf_counter() - self.start
        self.times.append(now)
        if self.ttft is None:
            self.ttft = now
        logprob, top = _logprobs(answer) if answer is not None and self.logprobs is not None else (None, ())
        return Token(index, token, now, logprob, top)


def _logprobs(answer: dict[str, Any]) -> tuple[float | None, tuple[tuple[int, float], ...]]:
    """A worker's token answer's logprob and top logprobs ([[id, logprob], ...]), as it sent them."""
    logprob = answer.get("logprob")
    if logprob is None:
        return None, ()
    return float(logprob), tuple((int(t), float(lp)) for t, lp in answer.get("top_logprobs") or ())


def sampled(run: Run, body: dict[str, Any]) -> dict[str, Any]:
    """A worker call's body with the request's sampling, when it is not plain greedy, and the
    logprobs it asks for, if any."""
    sampling = run.sampling.to_json()
    body = {**body, "sampling": sampling} if sampling else body
    return body if run.logprobs is None else {**body, "logprobs": run.logprobs}


def generated(run: Run, d: WorkerEndpoint, event: dict[str, Any]) -> Token | None:
    """One /generate event: a token to stream (None when the router has it already), a
    resume's figures, or the worker's error (Failure)."""
    kind = event.get("event")
    if kind == "token":
        return run.token(int(event["index"]), int(event["token"]), event)
    # Under policy fail the worker's error is where the transfer's figures come.
    if kind in ("resume", "error") and event.get("transfer") and run.transfer is None:
        run.transfer = TransferFigures.from_event(event["transfer"])
    if kind == "resume" and event.get("recompute_tokens"):
        run.recomputed += int(event["recompute_tokens"])
        if run.path == "disaggregated":
            run.path = "resumed"
        run.events.append(f"decode {d.url} resumed at {event['position']} and recomputed "
                          f"{event['recompute_tokens']} prompt tokens")
    elif kind == "error":
        raise Failure(f"decode {d.url}: {event.get('error')}", dead=False)
    return None


def rows_safe_after(exc: BaseException) -> bool:
    """After a failed /publish: can the prefill worker still write into the decode rows?
    Not if it is gone (connection refused or cut), nor if it refused before submitting
    (400, 401: not the cluster key, 409). A timeout or a 500 proves nothing, so the rows are
    quarantined then."""
    return isinstance(exc, HttpError) and (exc.unreachable or exc.status in (400, 401, 409))


async def settled(task: asyncio.Task[TransferFigures | None], timeout: float) -> TransferFigures | None:
    try:
        return await asyncio.wait_for(task, timeout)
    except (asyncio.TimeoutError, asyncio.CancelledError):
        return None
