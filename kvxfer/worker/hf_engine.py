"""``kvxfer serve --engine transformers``: Hugging Face transformers' continuous batching as a
worker's ``ServingEngine`` (``kvxfer.worker.engines``), its cache lent in place.

Imported only when that engine is asked for (it imports transformers, through the adapter
``kvxfer.adapters.transformers``). A driver task steps the batch on the worker's engine
thread while it has work, one step per job, so that the transport's jobs (lend, describe,
publish, fetch) run between two steps; after each step it hands out what the step made:
prefills' first tokens, and each decoding request's new tokens. Concurrent requests share
every step, as transformers batches them.

Each request picks its tokens with kvxfer's sampler and its own parameters and logprobs
(``kvxfer.adapters.transformers.sampler``, over ``kvxfer.engine.sampling``), as the reference
engine does: a seeded request makes the same tokens colocated and disaggregated; greedy is
transformers' own argmax, token for token ``generate_batch``'s.

Layer-wise streaming (``--layerwise`` > 1): the cache's full-attention layers are cut into
that many layer groups, each lent and moved by a lease of its own (as a hybrid cache's groups
are), and a prefill's ``ready`` is called by the forward (a hook on the model's decoder
layers, ``TransformersEngine.prefill(ready=)``) as each group is written, inside the step
that ends the prompt, on the engine thread: ``lend_read(rid, n, (group,))`` lends it then.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvxfer.adapters.transformers import RequestSampling, TransformersEngine, checkpoint_scope
from kvxfer.adapters.transformers import _internals as hf
from kvxfer.adapters.transformers.converted import load_converted
from kvxfer.engine.config import ModelConfig
from kvxfer.engine.sampling import InvalidSampling, Pick, SamplingParams
from kvxfer.lender import ShutdownReport
from kvxfer.modelfiles import model_path
from kvxfer.pool import PoolExhausted
from kvxfer.worker.engine_thread import EngineThread
from kvxfer.worker.engines import Stream
from kvxfer.worker.errors import Refused
from kvxfer.worker.layers import LayerLeases

log = logging.getLogger(__name__)
PAGE_SIZE = 16
MAX_BATCH_TOKENS = 256
GPU_MAX_BATCH_TOKENS = 4096


def load_model(path: Path) -> Any:
    """The model transformers loads from the GGUF at ``path`` (float32, eval mode), converted
    once and then read from kvxfer's cache (``adapters.transformers.converted``)."""
    return load_converted(path)


def seeded_model(shape: ModelConfig, device: str, sliding_window: int = 0) -> Any:
    """A Llama-style model of ``shape`` with transformers' random initialization seeded by
    ``shape.seed``, in ``shape.dtype`` on ``device``: the toy model's flags (``--layers``,
    ``--hidden``, ... ``--seed``) give the same weights at both ends and in the oracle.

    ``sliding_window`` > 0 (``--sliding-window``): a hybrid model instead, Gemma-2-like, its
    even layers attending to the last ``sliding_window`` tokens and its odd ones to all (a
    Qwen2-style model, head_dim ``hidden // heads``): transformers keeps each kind of layer in
    a cache group of its own."""
    import torch

    if sliding_window > 0:
        if shape.head_dim * shape.heads != shape.hidden:
            raise ValueError(f"--sliding-window: the hybrid model's head_dim is hidden // heads "
                             f"({shape.hidden} // {shape.heads}), not {shape.head_dim}: set --head-dim to it")
        types = [hf.SLIDING if i % 2 == 0 else hf.FULL for i in range(shape.layers)]
        return hf.random_hybrid_model(vocab_size=shape.vocab_size, hidden=shape.hidden, layer_types=types,
                                      window=sliding_window, heads=shape.heads, kv_heads=shape.kv_heads,
                                      intermediate=shape.intermediate, rope_theta=shape.rope_theta,
                                      rms_eps=shape.rms_eps, max_positions=shape.max_positions, seed=shape.seed,
                                      dtype=shape.torch_dtype, device=torch.device(device))
    return hf.random_model(vocab_size=shape.vocab_size, hidden=shape.hidden, layers=shape.layers, heads=shape.heads,
                           kv_heads=shape.kv_heads, head_dim=shape.head_dim, intermediate=shape.intermediate,
                           rope_theta=shape.rope_theta, rms_eps=shape.rms_eps, max_positions=shape.max_positions,
                           seed=shape.seed, dtype=shape.torch_dtype, device=torch.device(device))


def load_on(path: Path | None, shape: ModelConfig, device: str, sliding_window: int = 0) -> Any:
    """The transformers model a worker or the oracle runs: the GGUF at ``path`` (on the cpu),
    or, for the toy model (``path`` None), seeded weights of ``shape`` on ``device`` (hybrid
    with a ``sliding_window``: ``seeded_model``)."""
    return load_model(path) if path is not None else seeded_model(shape, device, sliding_window)


def max_batch_tokens(device: str) -> int:
    """Tokens one step of the batch takes: a 2k-token prompt in one step on a GPU; on the cpu,
    chunks small enough that decoding requests are not starved by a long prefill."""
    return MAX_BATCH_TOKENS if device == "cpu" else GPU_MAX_BATCH_TOKENS


class GroupLenders:
    """The lenders of a hybrid cache's layer groups (``ExternalLender.for_groups``) as the
    worker's one lender: their memory (the cache tensor, once), their open leases, reclaim
    and shutdown. Each group lends its own blocks (``TransformersEngine.lend_prefill_groups``)."""

    def __init__(self, engine: TransformersEngine) -> None:
        self._engine = engine
        self.lenders = {name: group.lender for name, group in engine.groups.items()}

    @property
    def regions(self) -> tuple[Any, ...]:
        return self._engine.regions

    @property
    def open_leases(self) -> int:
        return sum(lender.open_leases for lender in self.lenders.values())

    def reclaim(self) -> None:
        for lender in self.lenders.values():
            lender.reclaim()

    def shutdown(self, force: bool = False) -> ShutdownReport:
        reports = [lender.shutdown(force=force) for lender in self.lenders.values()]
        blocks = {g: b for r in reports for g, b in r.retained_blocks.items()}
        return ShutdownReport(sum(r.open_leases for r in reports), sum(r.unquiesced_attempts for r in reports),
                              blocks, {})


@dataclass(eq=False)
class _Watch:
    """A request decoding in the batch: its tokens as steps make them."""

    queue: asyncio.Queue[list[Pick] | None | BaseException] = field(default_factory=asyncio.Queue)
    seen: int = 0      # tokens the driver handed out so far (engine side)
    ended: bool = False
    pending: list[Pick] = field(default_factory=list)  # handed out, not taken yet (stream side)


class TransformersServing:
    """The transformers engine behind the worker's seam. ``thread``: the worker's engine thread."""

    def __init__(self, model: Any, thread: EngineThread, *, num_blocks: int, model_name: str, name: str,
                 shape: ModelConfig | None = None, device: str = "cpu", layer_groups: int = 1) -> None:
        """``model_name``: what ``--model`` named; a GGUF's digest scopes the KV (a peer with
        other weights is refused by the transport), or for seeded weights ``shape``'s scope.
        ``layer_groups``: ``--layerwise``."""
        self.name = hf.ENGINE
        self._model = model
        self._thread = thread
        self._num_blocks = num_blocks
        gguf = model_path(model_name)
        self._scope = checkpoint_scope(gguf) if gguf is not None else \
            shape.scope() if shape is not None else model_name.encode()
        self._max_batch_tokens = max_batch_tokens(device)
        self._kv_name = name
        self._layer_groups = layer_groups
        self.engine: TransformersEngine | None = None
        self._prefills: dict[str, asyncio.Future[Pick]] = {}
        self._doomed: set[str] = set()            # prefilled while nobody waits any more: freed at once
        self._announced: set[str] = set()         # prefilled, first token handed out (engine thread)
        self._watch: dict[str, _Watch] = {}
        self._local: set[str] = set()              # allocate_local names not submitted yet
        self._work = asyncio.Event()
        self._driver: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False

    # --- lifecycle (the worker's) ------------------------------------------------------------
    def build(self) -> TransformersEngine:
        """On the engine thread: the batch and its cache (lent in place, no pool). A cache of
        several layer groups (a hybrid one, sliding-window layers beside full attention, or one
        cut by --layerwise) lends each group by a lender of its own: ``lender`` is them all, and
        a request moves as one lease, view and hint per group
        (``kvxfer.worker.layers.LayerLeases``, moved by ``LayerSubmitter``)."""
        self.engine = TransformersEngine(self._model, page_size=PAGE_SIZE, num_blocks=self._num_blocks,
                                         max_batch_tokens=self._max_batch_tokens, scope=self._scope,
                                         name=self._kv_name, layer_groups=self._layer_groups)
        return self.engine

    @property
    def hybrid(self) -> bool:
        return self._engine().hybrid

    @property
    def grouped(self) -> bool:
        """Whether a request moves as a lease per layer group (hybrid, or --layerwise > 1)."""
        return self._engine().grouped

    def stream_groups(self) -> tuple[str, ...]:
        """The layer groups a prefill publishes as the forward writes them (--layerwise > 1), in
        the model's order; none without layer-wise streaming."""
        engine = self._engine()
        return tuple(engine.groups) if engine.layer_groups > 1 else ()

    @property
    def lender(self) -> Any:
        """What the worker counts, reclaims and shuts down: the one group's lender, or every
        group's (``GroupLenders``)."""
        engine = self._engine()
        return GroupLenders(engine) if engine.grouped else engine.lender

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._driver = asyncio.create_task(self._drive())

    async def stop(self) -> None:
        self._closed = True
        self._work.set()
        if self._driver is not None:
            self._driver.cancel()
            await asyncio.gather(self._driver, return_exceptions=True)
        for fut in self._prefills.values():
            if not fut.done():
                fut.set_exception(Refused("worker is shutting down"))
        for watch in self._watch.values():
            watch.queue.put_nowait(Refused("worker is shutting down"))

    def shutdown(self) -> None:
        """On the engine thread, after the lender's forced shutdown: the model's attention back."""
        if self.engine is not None:
            self.engine.batch.close()

    # --- the driver ------------------------------------------------------------------------------
    async def _drive(self) -> None:
        while not self._closed:
            await self._work.wait()
            self._work.clear()
            while not self._closed:
                try:
                    ran, idle, firsts, tokens = await self._thread.run_step(self._step)
                except Exception as exc:  # a step failed: every waiter hears it, the worker serves on
                    log.exception("transformers step failed")
                    self._fail_all(exc)
                    break
                self._deliver(firsts, tokens)
                if idle:
                    break
                if not ran:  # work the batch cannot schedule yet (no room): not a busy loop
                    await asyncio.sleep(0.01)

    def _step(self) -> tuple[bool, bool, dict[str, Pick], dict[str, tuple[list[Pick], bool]]]:
        """Engine thread: one step; the first tokens of prefills that came, and each watched
        request's tokens since those handed out (True: it ended)."""
        engine = self.engine
        assert engine is not None
        ran = engine.step()
        firsts = {}
        for rid in list(engine.prefilled):
            if rid in self._doomed:
                self._doomed.discard(rid)
                engine.finish_prefill(rid)
            elif rid not in self._announced:
                self._announced.add(rid)
                firsts[rid] = engine.prefilled[rid].pick
        ended = engine.finished()
        tokens = {}
        # A snapshot: the asyncio side adds and removes watches, and moves ``seen`` only between steps.
        for name, watch in list(self._watch.items()):
            tokens[name] = (ended[name][watch.seen:], True) if name in ended else (engine.picks(name, watch.seen), False)
        return ran, engine.idle(), firsts, tokens

    def _deliver(self, firsts: dict[str, Pick], tokens: dict[str, tuple[list[Pick], bool]]) -> None:
        for rid, first in firsts.items():
            fut = self._prefills.pop(rid, None)
            if fut is not None and not fut.done():
                fut.set_result(first)
        for name, (got, ended) in tokens.items():
            watch = self._watch.get(name)
            if watch is None or watch.ended:
                continue
            if got:
                watch.queue.put_nowait(got)
                watch.seen += len(got)
            if ended:
                watch.ended = True
                watch.queue.put_nowait(None)

    def _fail_all(self, exc: BaseException) -> None:
        for fut in self._prefills.values():
            if not fut.done():
                fut.set_exception(exc)
        self._prefills.clear()
        for watch in self._watch.values():
            if not watch.ended:
                watch.ended = True
                watch.queue.put_nowait(exc)

    def _kick(self) -> None:
        self._work.set()

    def _kick_from_engine_thread(self) -> None:
        """A step must run (a cancellation takes effect at the next one) though nothing is queued."""
        if self._loop is not None and not self._closed:
            try:
                self._loop.call_soon_threadsafe(self._work.set)
            except RuntimeError:  # the loop closed: the worker is gone
                pass

    # --- the seam: prefill end --------------------------------------------------------------------
    def check(self, sampling: SamplingParams, logprobs: int | None) -> None:
        """Every sampling parameter and logprobs are served; what kvxfer's sampler would refuse
        (sampling without a seed, a bad logprobs count) is refused here, by name."""
        self._sampling(sampling, logprobs)

    @staticmethod
    def _sampling(sampling: SamplingParams, logprobs: int | None, earlier: int = 0) -> RequestSampling:
        try:
            return RequestSampling(sampling, logprobs, earlier)
        except InvalidSampling as exc:
            raise Refused(f"the {hf.ENGINE} engine cannot serve this request: {exc}") from None

    async def prefill(self, rid: str, prompt: list[int], sampling: SamplingParams, logprobs: int | None,
                      ready: Callable[[str], None] | None = None) -> Pick:
        """``ready(group)``: called on the engine thread by the forward hooks as the step that
        ends the prompt has written each layer group (``TransformersEngine.prefill``)."""
        if ready is not None and not self.stream_groups():
            raise Refused(f"the {hf.ENGINE} engine streams no layer groups here (--layerwise 1)")
        picking = self._sampling(sampling, logprobs)
        fut: asyncio.Future[Pick] = asyncio.get_running_loop().create_future()
        self._prefills[rid] = fut
        try:
            await self._thread.run(self._engine().prefill, rid, prompt, picking, ready)
            self._kick()
            return await fut
        except BaseException:
            # Cancelled (its caller left, even as its first token came: the driver has handed
            # it out already) or failed: nobody will publish it, its blocks go back.
            self._prefills.pop(rid, None)
            await self._thread.cleanup(self.free, rid)
            raise

    def lend_read(self, rid: str, n: int, groups: tuple[str, ...] | None = None) -> Any:
        """The prefill's KV lent for reading: one lease, or one per layer group; ``groups``
        (layer-wise streaming, from the forward's ``ready``): those groups only, lent while
        the prompt's last step runs."""
        engine = self._engine()
        if groups is not None:
            return LayerLeases(rid, {g: engine.lend_streamed(rid, g) for g in groups})
        if engine.grouped:
            return LayerLeases(rid, engine.lend_prefill_groups(rid))
        return engine.lend_prefill(rid)

    def free(self, rid: str) -> None:
        """Whatever ``rid`` holds goes back once nothing may touch it: a prefill's pinned
        blocks, a reservation, a request decoding in the batch (ended there)."""
        engine = self._engine()
        self._announced.discard(rid)
        if rid in engine.prefilled:
            engine.finish_prefill(rid)
        elif engine.prefilling(rid):
            engine.stop_streaming(rid)  # its forward lends and publishes no group for nobody
            self._doomed.add(rid)
        elif engine.reservation(rid) is not None:
            engine.drop(rid)
        elif engine.running(rid):
            engine.cancel(rid)
            self._kick_from_engine_thread()
        self._local.discard(rid)

    def has(self, rid: str) -> bool:
        return self._engine().known(rid) or rid in self._local

    # --- the seam: decode end -------------------------------------------------------------------
    def reserve(self, rid: str, prompt: list[int], max_new: int) -> int:
        reservation = self._engine().reserve(rid, prompt)
        if reservation is None:
            raise PoolExhausted(f"the transformers cache has no room for request {rid!r} ({len(prompt)} prompt tokens) "
                                "now")
        if not reservation.leases:  # transformers shares whole blocks before the last token: never
            self._engine().drop(rid)
            raise Refused(f"request {rid!r}: the whole prompt is held here; nothing to fetch")
        return reservation.held

    def lend_write(self, rid: str, n: int) -> Any:
        engine = self._engine()
        reservation = engine.reservation(rid)
        if reservation is None or not reservation.leases:
            raise Refused(f"request {rid!r} has no reservation here")
        if not engine.grouped:
            return reservation.lease
        if list(reservation.leases) != list(engine.groups):  # every group moves (a ring is never shared)
            raise Refused(f"request {rid!r}: layer groups {sorted(engine.groups)}, leases for "
                          f"{sorted(reservation.leases)}")
        return LayerLeases(rid, dict(reservation.leases))

    def usable(self, name: str, n: int) -> int:
        """Where the request resumes from what arrived: every group's KV in place up to there
        (a wrapped sliding ring is of use whole or not at all: ``TransformersEngine.usable``)."""
        engine = self._engine()
        if engine.reservation(name) is None:
            return 0
        return min(engine.usable(name), n)

    def allocate_local(self, name: str, prompt: list[int], max_new: int) -> None:
        self._local.add(name)

    async def first(self, stream: Stream, position: int) -> Pick:
        """The first token computed here: the reservation adopted at ``position`` (the rest of
        the prompt prefilled again), or the whole request run here."""
        picking = self._sampling(stream.sampling, stream.logprobs, stream.generated)
        watch = self._watch[stream.name] = _Watch()
        if stream.name in self._local:
            self._local.discard(stream.name)
            await self._thread.run(self._engine().generate, stream.name, stream.prompt, stream.max_new, picking)
        else:
            await self._thread.run_move(self._engine().adopt, stream.name, 0, stream.max_new, picking)
        self._kick()
        pick = await self._take(watch)
        if pick is None:
            raise Refused(f"request {stream.name!r} ended without a token")
        return pick

    async def tokens(self, stream: Stream, first: int) -> AsyncGenerator[Pick, None]:
        """The completion after ``first``: the request adopted with it as its next input
        (unless ``first`` ran it here), then its tokens as the batch's steps make them; fewer
        than asked when the model's end-of-sequence token ends it."""
        watch = self._watch.get(stream.name)
        if watch is None:
            picking = self._sampling(stream.sampling, stream.logprobs, stream.generated)
            watch = self._watch[stream.name] = _Watch(seen=1)  # the batch's first token is ``first``
            await self._thread.run_move(self._engine().adopt, stream.name, first, stream.max_new, picking)
            self._kick()
        while (pick := await self._take(watch)) is not None:
            yield pick

    async def _take(self, watch: _Watch) -> Pick | None:
        """The request's next token, None once it ended."""
        while not watch.pending:
            item = await watch.queue.get()
            if isinstance(item, BaseException):
                raise item
            if item is None:
                return None
            watch.pending.extend(item)
        return watch.pending.pop(0)

    def finish(self, name: str, prompt: list[int], shareable: bool = True) -> None:
        """The stream ended: a request still in the batch (the client left) ends there; a
        reservation never adopted is dropped once quiet."""
        self._watch.pop(name, None)
        self.free(name)

    def reclaim(self) -> None:
        """Blocks whose attempts quiesced go back to transformers (between steps too)."""
        if self.engine is not None:
            self.engine.reclaim()

    def block_stats(self) -> dict[str, dict[str, int]]:
        """transformers' cache, as the worker's ``kvxfer_pool_blocks`` counts a pool. A hybrid
        cache's groups share its sectors and transformers records no sector's owner, so no
        group has a total: each group's ``reusable`` blocks only (free ones, free sectors' and
        its prefix cache's), once the empty sectors went back to the pool (so that an idle
        cache counts as many in each group as it had at the start). On the engine thread."""
        engine = self.engine
        if engine is None:
            return {}
        if engine.hybrid:
            engine.batch.free_empty_sectors()
            return {group: {"reusable": engine.batch.reusable_block_count(group)} for group in engine.groups}
        return {"kv": engine.block_counts()}

    def _engine(self) -> TransformersEngine:
        if self.engine is None:
            raise Refused("the transformers engine is not built yet")
        return self.engine
