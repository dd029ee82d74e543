"""The workers a router knows: who they are, who is down, who gets the next request, and
whether they make a usable pair at all.

Workers come and go while the router runs (``Router.add_worker`` / ``remove_worker``): a
removed worker gets no new request, and the requests it already has run to their end.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from kvxfer.router.constants import SELECTIONS
from kvxfer.serving.urls import check_url

ROLES = ("prefill", "decode")


@dataclass(eq=False)
class WorkerEndpoint:
    url: str
    role: str
    outstanding: int = 0
    down_until: float = 0.0
    failures: int = 0
    publisher: Any = None  # a prefill worker's {agent, run}, from its /health or /prefill
    engine: str | None = None  # what its /health names (kvxfer serve --engine), once learnt
    layerwise: int = 1  # a prefill worker's layer groups (kvxfer serve --layerwise), from its /health


@dataclass(frozen=True)
class ModelLimits:
    """What the workers' /health says of their model: its name (``kvxfer serve --model``),
    the token ids it knows and the positions it holds."""

    name: str
    vocab_size: int
    max_positions: int


@dataclass(frozen=True)
class RouterHealth:
    """Which workers answered /health, and whether a request can be served.

    ``status``: "ok" (a prefill and a decode worker answer), "degraded" (no prefill worker
    answers, and policy recompute lets the decode workers prefill themselves) or
    "unavailable" (no decode worker answers, or no prefill worker under policy fail)."""

    status: str
    reason: str
    prefill: tuple[tuple[str, bool], ...]
    decode: tuple[tuple[str, bool], ...]

    @property
    def usable(self) -> bool:
        return self.status != "unavailable"

    def as_json(self) -> dict[str, Any]:
        return {"status": self.status, "reason": self.reason,
                "workers": {url: up for url, up in self.prefill + self.decode},
                "prefill": dict(self.prefill), "decode": dict(self.decode)}


REFERENCE_ENGINE = "kvxfer reference"
"""The engine of a worker whose /health names none (kvxfer's own, before --engine)."""


def mixed_engines(endpoints: Sequence[WorkerEndpoint]) -> str | None:
    """What is wrong when the workers run different engines (one's KV means nothing to the
    other's), naming each engine and a worker that runs it; None when they agree."""
    runs: dict[str, WorkerEndpoint] = {}
    for e in endpoints:
        if e.engine is not None:
            runs.setdefault(e.engine, e)
    if len(runs) < 2:
        return None
    named = "; ".join(f"{e.role} worker {e.url} runs {engine!r}" for engine, e in sorted(runs.items()))
    return (f"mixed engines: {named}. Both ends of a disaggregated pair must run the same engine "
            "(kvxfer serve --engine): refused before any worker sees the request")


def judge(prefill: Sequence[tuple[str, bool]], decode: Sequence[tuple[str, bool]], on_failure: str) -> RouterHealth:
    """The router's health from each worker's answer (see RouterHealth)."""
    live_p, live_d = sum(up for _, up in prefill), sum(up for _, up in decode)
    if not live_d:
        status, reason = "unavailable", f"none of {len(decode)} decode workers answers"
    elif not live_p and on_failure == "fail":
        status, reason = "unavailable", f"none of {len(prefill)} prefill workers answers (policy fail)"
    elif not live_p:
        status, reason = "degraded", "no prefill worker answers: decode workers prefill (policy recompute)"
    else:
        status, reason = "ok", f"{live_p} prefill and {live_d} decode workers answer"
    return RouterHealth(status, reason, tuple(prefill), tuple(decode))


class WorkerSet:
    """The prefill and decode workers, and the choice of one for the next request."""

    def __init__(self, prefill: Sequence[str], decode: Sequence[str], selection: str) -> None:
        if selection not in SELECTIONS:
            raise ValueError(f"selection must be one of {SELECTIONS}, got {selection!r}")
        self.selection = selection
        self.prefill: list[WorkerEndpoint] = []
        self.decode: list[WorkerEndpoint] = []
        self._turns = {role: itertools.count() for role in ROLES}
        for role, urls in (("prefill", prefill), ("decode", decode)):
            for url in urls:
                self.add(role, url)

    def __iter__(self) -> Iterator[WorkerEndpoint]:
        return iter(self.prefill + self.decode)

    def of(self, role: str) -> list[WorkerEndpoint]:
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        return self.prefill if role == "prefill" else self.decode

    def add(self, role: str, url: str) -> WorkerEndpoint:
        """ValueError for a URL without host and port, or one the router has already."""
        endpoints = self.of(role)
        url = check_url(url)
        if any(e.url == url for e in self):
            raise ValueError(f"worker {url} is already in the router")
        endpoint = WorkerEndpoint(url, role)
        endpoints.append(endpoint)
        return endpoint

    def remove(self, url: str) -> WorkerEndpoint:
        """KeyError naming ``url`` when the router does not have it."""
        url = url.rstrip("/")
        for endpoints in (self.prefill, self.decode):
            for e in endpoints:
                if e.url == url:
                    endpoints.remove(e)
                    return e
        raise KeyError(f"worker {url} is not in the router")

    def pick(self, role: str, exclude: frozenset[str] = frozenset()) -> WorkerEndpoint | None:
        """The next worker of ``role`` not marked down (nor in ``exclude``), or None."""
        now = time.monotonic()
        live = [e for e in self.of(role) if e.down_until <= now and e.url not in exclude]
        if not live:
            return None
        turn = next(self._turns[role]) % len(live)
        ordered = live[turn:] + live[:turn]
        if self.selection == "least_outstanding":
            return min(ordered, key=lambda e: e.outstanding)  # min keeps the round-robin order on ties
        return ordered[0]
