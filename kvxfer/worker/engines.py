"""The engine a worker serves with, behind one seam: what the worker's roles ask of it.

The roles (``kvxfer.worker.prefill``, ``kvxfer.worker.decode``) own the transport: hints,
publish and fetch, settling, quarantine. What computes and holds KV is a ``ServingEngine``:

- prefill end: ``prefill`` a prompt to its first token, ``lend_read`` its KV, ``free`` it
  once published (its blocks come back when no attempt may touch them); under layer-wise
  streaming ``prefill`` calls ``ready(group)`` as its forward writes each of
  ``stream_groups()``, and ``lend_read(rid, n, (group,))`` lends that group then;
- decode end: ``reserve`` room for a prompt (the tokens already held by prefix sharing come
  back), ``lend_write`` the rest, ``usable`` after arrival, then ``first`` (the first token,
  computed here from a position: a recompute) and ``tokens`` (the completion after the first
  token, the request adopted at its position), ``finish`` at the end; ``allocate_local``
  for a request decoded here from its prompt.

Two implement it: ``ReferenceEngine`` (kvxfer's own ``LlamaModel`` and its pool, one token
per call) and ``kvxfer.worker.hf_engine.TransformersServing`` (Hugging Face transformers'
continuous batching, imported only for ``kvxfer serve --engine transformers``). Sync methods
run on the engine thread; the async ones wait there.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from kvxfer.engine import tokens_needed
from kvxfer.engine.sampling import Pick, SamplingParams
from kvxfer.lender import Lender
from kvxfer.pool import PagedKVPool

if TYPE_CHECKING:
    from kvxfer.engine import LlamaModel
    from kvxfer.worker.state import WorkerState

REFERENCE = "kvxfer reference"
"""What /health names as the reference engine (``ServingEngine.name``); the router refuses
a pair whose two ends name different engines."""


@dataclass(eq=False)
class Stream:
    """One /generate stream's request in the engine: ``name`` is the request id, or
    ``rid#local`` once it recomputes in fresh blocks; ``owned``: it is ours to finish;
    ``suspect``: the delivered rows proved wrong (or a peer may still write them: the client left
    mid-transfer), so they are freed, not kept for prefix reuse."""

    rid: str
    prompt: list[int]
    max_new: int
    name: str
    owned: bool
    sampling: SamplingParams
    generated: int = 0  # the prompt's last tokens that are the completion's (a recompute going on)
    logprobs: int | None = None  # each token's logprob and this many likeliest tokens' go with it
    suspect: bool = False

    @property
    def origin(self) -> list[int]:
        """The request's prompt proper: what precedes the completion."""
        return self.prompt[: len(self.prompt) - self.generated]

    @property
    def earlier(self) -> list[int]:
        """The completion's tokens before this stream's first."""
        return self.prompt[len(self.prompt) - self.generated:]


class ServingEngine(Protocol):
    name: str  # /health's "engine": both ends of a pair must name the same

    def check(self, sampling: SamplingParams, logprobs: int | None) -> None: ...

    async def prefill(self, rid: str, prompt: list[int], sampling: SamplingParams, logprobs: int | None,
                      ready: Callable[[str], None] | None = None) -> Pick: ...

    def stream_groups(self) -> tuple[str, ...]: ...

    def lend_read(self, rid: str, n: int, groups: tuple[str, ...] | None = None) -> Any: ...

    def free(self, rid: str) -> None: ...

    def has(self, rid: str) -> bool: ...

    def reserve(self, rid: str, prompt: list[int], max_new: int) -> int: ...

    def lend_write(self, rid: str, n: int) -> Any: ...

    def usable(self, name: str, n: int) -> int: ...

    def allocate_local(self, name: str, prompt: list[int], max_new: int) -> None: ...

    async def first(self, stream: Stream, position: int) -> Pick: ...

    def tokens(self, stream: Stream, first: int) -> AsyncGenerator[Pick, None]: ...

    def finish(self, name: str, prompt: list[int], shareable: bool = True) -> None: ...

    def reclaim(self) -> None: ...

    def block_stats(self) -> dict[str, dict[str, int]]: ...


class ReferenceEngine:
    """kvxfer's own engine: ``LlamaModel`` over the worker's pool (or TP group), its lender
    lending pool rows; one forward per call on the engine thread."""

    name = REFERENCE

    def __init__(self, state: WorkerState) -> None:
        self._s = state

    @property
    def _model(self) -> LlamaModel:
        model = self._s.model
        assert model is not None  # a worker under another engine never makes a ReferenceEngine its engine
        return model

    def check(self, sampling: SamplingParams, logprobs: int | None) -> None:
        """Every sampling parameter and logprobs are served."""

    async def prefill(self, rid: str, prompt: list[int], sampling: SamplingParams, logprobs: int | None,
                      ready: Callable[[str], None] | None = None) -> Pick:
        """``ready(group)``: called on the engine thread as the forward completes each layer
        group (``LlamaModel.forward``), so the group can be published while later layers run."""
        return await self._s.engine.run_step(self._prefill_sync, rid, prompt, sampling, logprobs, ready)

    def _prefill_sync(self, rid: str, prompt: list[int], sampling: SamplingParams, logprobs: int | None,
                      ready: Callable[[str], None] | None) -> Pick:
        pool = self._s.pool
        assert pool is not None
        pool.allocate(rid, len(prompt))
        try:
            return self._model.next_pick(pool, rid, prompt, 0, sampling, prompt, (), logprobs, ready)
        except BaseException:
            pool.free(rid)
            raise

    def stream_groups(self) -> tuple[str, ...]:
        """The pool's layer groups, which the forward publishes one by one (--layerwise > 1);
        none without layer-wise streaming."""
        pool = self._s.pool
        if self._s.config.layerwise <= 1 or not isinstance(pool, PagedKVPool):
            return ()
        return tuple(g.name for g in pool.groups)

    def lend_read(self, rid: str, n: int, groups: tuple[str, ...] | None = None) -> Any:
        assert self._s.lender is not None
        if groups is None:
            return self._s.lender.lend_read(rid, (0, n))
        lender = self._s.lender
        assert isinstance(lender, Lender)  # layer-wise streaming runs on a single pool's lender
        return lender.lend_read(rid, (0, n), groups)

    def free(self, rid: str) -> None:
        pool = self._s.pool
        assert pool is not None
        if pool.has(rid):
            pool.free(rid)

    def has(self, rid: str) -> bool:
        assert self._s.pool is not None
        return self._s.pool.has(rid)

    def reserve(self, rid: str, prompt: list[int], max_new: int) -> int:
        s = self._s
        assert s.pool is not None
        need = tokens_needed(len(prompt), max_new)
        # Share cached full blocks of the prompt except its last token: at least one row
        # always moves, so every request has a transfer whose outcome says it is complete.
        ids = prompt[:-1] if s.config.prefix_cache else None
        return s.pool.allocate(rid, need, token_ids=ids)

    def lend_write(self, rid: str, n: int) -> Any:
        assert self._s.lender is not None
        return self._s.lender.lend_write(rid, (0, n))

    def usable(self, name: str, n: int) -> int:
        lender = self._s.lender
        assert lender is not None
        bounds = lender.readiness(name)
        return min(bounds.usable_until, n) if bounds is not None else 0

    def allocate_local(self, name: str, prompt: list[int], max_new: int) -> None:
        s = self._s
        assert s.pool is not None
        s.pool.allocate(name, tokens_needed(len(prompt), max_new),
                        token_ids=prompt[:-1] if s.config.prefix_cache else None)

    async def first(self, stream: Stream, position: int) -> Pick:
        s = self._s
        return await s.engine.run_step(self._model.next_pick, s.pool, stream.name, stream.prompt[position:], position,
                                       stream.sampling, stream.origin, stream.earlier, stream.logprobs)

    async def tokens(self, stream: Stream, first: int) -> AsyncGenerator[Pick, None]:
        s, n = self._s, len(stream.prompt)
        token, origin, generated = first, stream.origin, [*stream.earlier, first]
        for index in range(1, stream.max_new):
            pick = await s.engine.run_step(self._model.next_pick, s.pool, stream.name, [token], n + index - 1,
                                           stream.sampling, origin, generated, stream.logprobs)
            token = pick.token
            generated.append(token)
            yield pick

    def finish(self, name: str, prompt: list[int], shareable: bool = True) -> None:
        """Free the request; with the prefix cache on and ``shareable``, its full prompt
        blocks stay named for later requests with that prefix."""
        s = self._s
        assert s.pool is not None
        if not s.pool.has(name):
            return
        if shareable and s.config.prefix_cache and self.usable(name, len(prompt)) >= len(prompt):
            s.pool.commit(name, len(prompt), token_ids=prompt)  # full prompt blocks become shareable
        s.pool.free(name)

    def reclaim(self) -> None:
        """Nothing of its own: the pool's lender gives rows back (the quarantine's reclaim)."""

    def block_stats(self) -> dict[str, dict[str, int]]:
        """The pool's counts per group (``PagedKVPool.stats``)."""
        return self._s.pool.stats() if self._s.pool is not None else {}

