"""transformers' continuous batching as a disaggregated engine: its cache lent in place.

::

    engine = TransformersEngine(model, page_size=16, num_blocks=256)   # its own PagedAttentionCache
    backend.register(engine.regions)                                   # the cache tensor, no pool

    # prefill end
    engine.prefill("r1", prompt, RequestSampling(SamplingParams(temperature=0.8, seed=7)))  # default greedy
    while "r1" not in engine.prefilled: engine.step()                 # the batch runs beside others
    first = engine.prefilled["r1"].first                               # its first token (index 0)
    lease = engine.lend_prefill("r1")                                  # its blocks, for reading
    ... publish(lease.view(), hint); lease.track(attempt); lease.release()
    engine.finish_prefill("r1")                                        # blocks go back once quiesced

    # decode end
    reservation = engine.reserve("r1", prompt)                         # blocks in its own cache
    ... fetch(reservation.lease.view(), hint); mark_arrived; release
    engine.adopt("r1", first, max_new_tokens, sampling)                # decodes in the batch
    while not done: engine.step(); done = engine.results()

Each request picks its tokens with kvxfer's sampler and its own parameters (``.sampler``):
a seeded request makes the same completion colocated (``generate``) and disaggregated.

One owner thread calls every method: the engine steps transformers' batch itself, so nothing
else touches its scheduler or cache between two steps. A block stays out of transformers'
reuse while a lease or an unquiesced attempt may touch it: prefill's blocks hold a pin (one
more reference in transformers' own block ledger) until ``finish_prefill`` and quiescence;
decode's reserved blocks belong to a request the scheduler does not see until ``adopt``, which
refuses while they are busy. The lease, not the allocator, decides when a block goes back.

A model with sliding-window layers (Gemma-2/3-, Mistral-, Qwen2-style ``layer_types``) has a
hybrid cache: transformers keeps full-attention and sliding-window layers in two allocators
over the one cache tensor, each with its own block size and block ids. Each group is then
described by its own ``EngineKV`` and lent by its own lender (``ExternalLender.for_groups``),
and a request moves as one lease per group, named ``{request}/{group}``
(``lend_prefill_groups``, ``Reservation.leases``): the full-attention group its tokens, the
sliding group only its ring, the blocks that hold the last ``window`` tokens (ring slot
``position % window``, the same slots at both ends).

Layer-wise streaming (``layer_groups`` > 1, a cache of full-attention layers only): the
model's layers are cut into that many groups of consecutive layers (``layers{first}-{last}``,
as ``kvxfer.engine.layer_groups`` cuts the reference model's), each its own ``EngineKV``
over the same blocks and lent by a lender of its own, as a hybrid cache's groups are. A
prefill given ``ready`` calls ``ready(group)`` on the owner thread as the forward of the
prompt's last step has run each group's last layer (a forward hook on the decoder layers):
``lend_streamed`` then lends that group's blocks while later layers are still to run.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvxfer.adapters.errors import AdapterError, EngineMismatch, UnsupportedCache
from kvxfer.adapters.transformers import _internals as hf
from kvxfer.adapters.transformers.sampler import PLAIN, RequestSampling, Sampler
from kvxfer.contract import BlockOrder, HeadOrder
from kvxfer.engine.config import layer_groups as cut_layers
from kvxfer.engine.sampling import Pick
from kvxfer.lender.engine_kv import EngineKV
from kvxfer.lender.external import ExternalLease, ExternalLender

ENGINE = hf.ENGINE


def check_peer_engine(local: str, peer: str) -> None:
    """Refuse, by name, a peer whose engine is not this one: transformers' cache at one end and
    another engine's (kvxfer's reference engine, another transformers version) at the other."""
    if local != peer:
        raise EngineMismatch(f"mixed engines: this end runs {local!r}, the peer {peer!r}; both ends of a "
                             "disaggregated pair must run the same engine (kvxfer serve --engine)")


@dataclass(frozen=True)
class LayerGroup:
    """One of the cache's layer groups as kvxfer lends it: its geometry over the shared cache
    tensor and its own lender. One transformers allocator's layers, or under layer-wise
    streaming some consecutive ones of them (over the allocator's blocks)."""

    name: str                 # transformers' layer type ("full_attention", "sliding_attention"), or "layers0-3"
    kv: EngineKV
    lender: ExternalLender
    window: int | None        # sliding: the ring's size in tokens; None for full attention
    allocator: str = hf.FULL  # the transformers allocator whose blocks (and block tables) hold it

    def span(self, prompt: int, held: int) -> tuple[int, int]:
        """What this group moves of a ``prompt``-token prompt whose first ``held`` tokens are in
        place: full attention the tokens [held, prompt); a sliding group all its ring's slots
        [0, min(prompt, window)), the last ``window`` tokens (a ring is never shared)."""
        return (held, prompt) if self.window is None else (0, min(prompt, self.window))

    def usable(self, lease: ExternalLease | None, prompt: int) -> int:
        """The position up to which this group's KV of the prompt is in place once ``lease``
        (None: nothing fetched, all held) arrived. A ring that has not wrapped holds position
        p at slot p: as full attention. A wrapped one is of use whole or not at all."""
        if lease is None:
            return prompt
        if self.window is None or prompt <= self.window:
            return lease.usable_until
        return prompt if lease.usable_until == lease.tokens.end else 0


@dataclass(frozen=True)
class Prefilled:
    """A prompt prefill ran: its first token (``pick``: with its logprobs, when asked for) and
    the blocks (held) that hold its KV: ``tables``, per transformers allocator (full attention
    first); ``blocks``, the first one's."""

    request: str
    prompt: tuple[int, ...]
    first: int
    tables: dict[str, np.ndarray]
    pick: Pick

    @property
    def blocks(self) -> np.ndarray:
        return next(iter(self.tables.values()))


@dataclass(frozen=True)
class Reservation:
    """Blocks reserved in the decode engine's cache for a prompt, per transformers allocator
    (``tables``, full attention first). ``held`` tokens from the start are already in place
    (prefix sharing) and are not fetched; ``leases`` write the rest, one per layer group with
    anything to fetch."""

    request: str
    prompt: tuple[int, ...]
    tables: dict[str, np.ndarray]
    held: int
    leases: dict[str, ExternalLease]

    @property
    def blocks(self) -> np.ndarray:
        return next(iter(self.tables.values()))

    @property
    def lease(self) -> ExternalLease | None:
        """The write lease of a cache with one layer group (None when nothing is left to fetch);
        refused for a cache of several (hybrid, or cut for layer-wise streaming), whose groups
        move by a lease each (``leases``)."""
        if len(self.tables) != 1 or len(self.leases) > 1:
            raise UnsupportedCache(f"request {self.request!r}: the cache has layer groups "
                                   f"{sorted(self.leases or self.tables)}; each moves by its own lease "
                                   "(Reservation.leases)")
        return next(iter(self.leases.values()), None)


def checkpoint_scope(path: Any) -> bytes:
    """A KV scope for weights read from ``path``: its bytes' digest."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.digest()


class TransformersEngine:
    """One transformers continuous batch, for either role, with its cache lent in place."""

    def __init__(self, model: Any, *, page_size: int = 16, num_blocks: int = 256, max_batch_tokens: int = 256,
                 max_requests_per_batch: int | None = None, scope: bytes = b"", name: str = "transformers-kv",
                 layer_groups: int = 1) -> None:
        """``layer_groups`` > 1: layer-wise streaming, the full-attention layers cut into that
        many groups (UnsupportedCache for a hybrid cache; ValueError naming ``layerwise`` for a
        count under 1 or over the layers)."""
        self.engine = ENGINE
        self.model = model
        self.eos = hf.model_eos(model)
        self.config = hf.batching_config(page_size, num_blocks, max_batch_tokens, max_requests_per_batch)
        self.batch = hf.Batch(model, self.config, max_new_tokens=1)
        self.sampler = Sampler(self.batch.completion, hf.vocab_size(model))
        self.batch.picker = self.sampler
        layouts = self.batch.layouts()
        self.allocators = tuple(layouts)
        kvs, made = {}, {}
        for group, (layout, positions) in _cut(layouts, layer_groups).items():
            k = [layout.plane(i, value=False) for i in positions]
            v = [layout.plane(i, value=True) for i in positions]
            kvs[group] = EngineKV.from_planes(k, v, tensors=(layout.tensor,), kv_heads=layout.kv_heads, heads=None,
                                              head_order=HeadOrder.NHD, order=BlockOrder.BLOCK_MAJOR,
                                              scope=_group_scope(scope, group, layout, positions,
                                                                 one=list(layouts) == [hf.FULL] and layer_groups == 1),
                                              name=name)
            made[group] = layout
        lenders = {hf.FULL: ExternalLender(kvs[hf.FULL])} if list(kvs) == [hf.FULL] else ExternalLender.for_groups(kvs)
        self.groups = {g: LayerGroup(g, kvs[g], lenders[g], made[g].window, made[g].group) for g in kvs}
        self.layer_groups = layer_groups
        self._ready: dict[str, Callable[[str], None]] = {}  # prefills streamed as the forward makes groups ready
        self._streamed: dict[str, dict[str, list[int]]] = {}  # their blocks pinned when a group was first lent
        if layer_groups > 1:
            ends = {layouts[hf.FULL].layer_indices[positions[-1]]: group
                    for group, (_, positions) in _cut(layouts, layer_groups).items()}
            self.batch.watch_layers(ends, self._ready)
        first = next(iter(self.groups.values()))
        self.kv, self.lender = first.kv, first.lender  # the full-attention group's (or the only group's)
        self.page_size = next(iter(layouts.values())).page_size
        self.prefilled: dict[str, Prefilled] = {}
        self._prefilling: dict[str, tuple[int, ...]] = {}
        self._unpin: dict[str, dict[str, np.ndarray]] = {}    # finished prefills: unpinned once quiesced
        self._reserved: dict[str, Reservation] = {}
        self._dropped: dict[str, dict[str, np.ndarray]] = {}  # abandoned reservations: released once quiesced
        self._adopted: set[str] = set()

    @property
    def regions(self) -> tuple[Any, ...]:
        """The memory to register: the cache tensor, once (every group lies in it)."""
        return tuple(dict.fromkeys(r for group in self.groups.values() for r in group.kv.regions))

    @property
    def hybrid(self) -> bool:
        """Whether the cache has several transformers allocators (sliding-window layers)."""
        return len(self.allocators) > 1

    @property
    def grouped(self) -> bool:
        """Whether the cache has several layer groups (hybrid, or cut for layer-wise
        streaming): each moves by a lease of its own."""
        return len(self.groups) > 1

    def lease_name(self, request: str, group: str) -> str:
        """The request name of ``group``'s lease (and view): the request's own with one group,
        ``{request}/{group}`` with several, so that each group's transfer is its own."""
        return f"{request}/{group}" if self.grouped else request

    # --- the loop ------------------------------------------------------------------------------
    def step(self) -> bool:
        """One step of the batch (False when it had nothing to run); then prompts whose first
        token came are taken out of the batch with their blocks pinned, and blocks nothing may
        touch any more go back to transformers."""
        ran = self.batch.step()
        for request, prompt in list(self._prefilling.items()):
            tokens = self.batch.generated(request)
            if tokens:
                tables = {a: np.asarray(self.batch.block_table(request, a), dtype=np.int64) for a in self.allocators}
                for allocator, blocks in tables.items():
                    self.batch.pin(blocks.tolist(), allocator)
                # The pin a streamed group took inside the forward: the one above holds them now.
                for allocator, early in self._streamed.pop(request, {}).items():
                    self.batch.unpin(early, allocator)
                self._ready.pop(request, None)
                self.batch.detach(request)
                del self._prefilling[request]
                pick = self.sampler.picks(request, tokens[:1])[0]
                self.sampler.forget(request)
                self.prefilled[request] = Prefilled(request, prompt, pick.token, tables, pick)
        self._give_back()
        return ran

    def results(self) -> dict[str, list[int]]:
        """Completions that ended since the last call (adopted or colocated requests): request id
        -> every generated token, the first included."""
        return {request: [p.token for p in picks] for request, picks in self.finished().items()}

    def finished(self) -> dict[str, list[Pick]]:
        """``results``, each token with its logprobs where the request asked for them (an
        adopted request's first token has none here: the prefill end picked it)."""
        out = {}
        for request, tokens, error in self.batch.results():
            if error is not None:
                raise AdapterError(f"transformers failed request {request!r}: {error}")
            self._adopted.discard(request)
            out[request] = self.sampler.picks(request, tokens)
            self.sampler.forget(request)
        return out

    def picks(self, request: str, start: int = 0) -> list[Pick]:
        """The tokens a running request made so far, from index ``start`` of its completion."""
        return self.sampler.picks(request, self.batch.generated(request), start)

    def idle(self) -> bool:
        return self.batch.idle() and not self._prefilling

    # --- colocated -------------------------------------------------------------------------------
    def generate(self, request: str, prompt: Sequence[int], max_new_tokens: int,
                 sampling: RequestSampling = PLAIN) -> None:
        """A whole request in this batch (prefill and decode), as transformers serves it, its
        tokens picked as ``sampling`` says."""
        self._check_new(request)
        self.sampler.add(request, sampling)
        self.batch.submit(request, [int(t) for t in prompt], max_new_tokens, self.eos)
        self._adopted.add(request)  # running in the batch until results() gives it

    # --- prefill ---------------------------------------------------------------------------------
    def prefill(self, request: str, prompt: Sequence[int], sampling: RequestSampling = PLAIN,
                ready: Callable[[str], None] | None = None) -> None:
        """Queue ``prompt``; once a step produced its first token (picked as ``sampling`` says)
        it is in ``prefilled``. The request runs without an end-of-sequence token and two new
        tokens at most, so that the batch never ends it (and frees its blocks) before it is
        taken out. ``ready`` (layer-wise streaming): called on the owner thread, inside the
        step that ends the prompt, with each layer group's name once the forward has written
        that group's K/V of the whole prompt (``lend_streamed`` lends it then)."""
        self._check_new(request)
        prompt = tuple(int(t) for t in prompt)
        if not prompt:
            raise AdapterError(f"request {request!r}: an empty prompt has nothing to prefill")
        if ready is not None and self.layer_groups <= 1:
            raise UnsupportedCache(f"request {request!r}: this engine streams no layer groups (layer_groups=1)")
        self.sampler.add(request, sampling)
        self._prefilling[request] = prompt
        if ready is not None:
            self._ready[request] = ready
        self.batch.submit(request, prompt, 2, None)

    def stop_streaming(self, request: str) -> None:
        """No more ``ready`` calls for ``request`` (nobody will publish it)."""
        self._ready.pop(request, None)

    def lend_streamed(self, request: str, group: str) -> ExternalLease:
        """Inside the forward (from ``ready``): ``group``'s blocks of the prompt lent for
        reading. The request is still the batch's, so its blocks get a pin of their own first
        (dropped once ``step`` has pinned the prefill's): should the step fail after this, a
        peer's transfer still never reads blocks transformers handed out again."""
        prompt = self._prefilling.get(request)
        layer = self.groups.get(group)
        if prompt is None or request not in self._ready or layer is None:
            raise AdapterError(f"request {request!r}, group {group!r}: not a layer group of a prefill streamed now "
                               f"(groups {sorted(self.groups)})")
        table = self.batch.block_table(request, layer.allocator)
        pinned = self._streamed.setdefault(request, {})
        if layer.allocator not in pinned:
            self.batch.pin(table, layer.allocator)
            pinned[layer.allocator] = table
        blocks = np.asarray(table, dtype=np.int64)
        return layer.lender.lend_read(self.lease_name(request, group), blocks, layer.span(len(prompt), 0))

    def lend_prefill(self, request: str) -> ExternalLease:
        """The prompt's blocks lent for reading (tokens [0, len(prompt))), in a cache with one
        layer group; a cache of several lends a lease per group (``lend_prefill_groups``)."""
        if self.grouped:
            raise UnsupportedCache(f"request {request!r}: the cache has layer groups {sorted(self.groups)}; each "
                                   "moves by its own lease (lend_prefill_groups)")
        return self.lend_prefill_groups(request)[next(iter(self.groups))]

    def lend_prefill_groups(self, request: str) -> dict[str, ExternalLease]:
        """Each layer group's blocks of the prompt lent for reading (``LayerGroup.span``: the
        full-attention tokens, a sliding group's ring), named ``lease_name(request, group)``."""
        done = self.prefilled.get(request)
        if done is None:
            raise AdapterError(f"request {request!r} has not been prefilled here")
        leases: dict[str, ExternalLease] = {}
        try:
            for name, group in self.groups.items():
                leases[name] = group.lender.lend_read(self.lease_name(request, name), done.tables[group.allocator],
                                                      group.span(len(done.prompt), 0))
        except BaseException:
            for lease in leases.values():
                lease.release()  # nothing was described yet: nothing can touch them
            raise
        return leases

    def finish_prefill(self, request: str) -> None:
        """The prefill end is done with ``request``: its blocks go back to transformers once no
        lease or attempt may touch them."""
        done = self.prefilled.pop(request, None)
        if done is None:
            raise AdapterError(f"request {request!r} has not been prefilled here")
        self._unpin[request] = done.tables
        self._give_back()

    # --- decode ----------------------------------------------------------------------------------
    def reserve(self, request: str, prompt: Sequence[int]) -> Reservation | None:
        """Blocks for ``prompt`` in this cache, the tokens it already holds by prefix sharing, and
        write leases over the rest (a sliding group's whole ring: prefix sharing never covers
        it); None when the cache has no room now."""
        self._check_new(request)
        prompt = tuple(int(t) for t in prompt)
        got = self.batch.reserve(request, prompt)
        if got is None:
            return None
        found, held = got
        tables = {a: np.asarray(found[a], dtype=np.int64) for a in self.allocators}
        leases: dict[str, ExternalLease] = {}
        try:
            for name, group in self.groups.items():
                start, end = group.span(len(prompt), held)
                if start < end:
                    table = tables[group.allocator]
                    shared = table[: held // self.page_size] if group.window is None else None
                    leases[name] = group.lender.lend_write(self.lease_name(request, name), table, (start, end),
                                                           shared=shared)
        except BaseException:
            for lease in leases.values():
                lease.release()
            self.batch.release(request)
            raise
        reservation = Reservation(request, prompt, tables, held, leases)
        self._reserved[request] = reservation
        return reservation

    def adopt(self, request: str, first: int, max_new_tokens: int, sampling: RequestSampling = PLAIN) -> int:
        """Decode ``request`` in the batch from the KV that arrived, with ``first`` (prefill's
        token, index 0 of the completion) next, its later tokens picked as ``sampling`` says.
        Its lease must be released and its attempts quiesced. Returns the position it resumes
        at: the prompt's length, or less where KV is missing (the rest is prefilled again here,
        its first token picked again). A request whose first token ends it (end-of-sequence, or
        one new token) ends at once: ``results()`` gives it."""
        reservation = self._reserved.get(request)
        if reservation is None:
            raise AdapterError(f"request {request!r} has no reservation here")
        if any(not lease.released for lease in reservation.leases.values()):
            raise AdapterError(f"request {request!r}: release its lease (after mark_arrived) before adopting it")
        if self._busy(reservation.tables):
            raise AdapterError(f"request {request!r}: an attempt on its blocks has not quiesced; adopt it once it has")
        position = self.usable(request)
        if position == len(reservation.prompt) and (first == self.eos or max_new_tokens <= 1):
            del self._reserved[request]
            self.batch.end(request, [int(first)])
            return position
        self.sampler.add(request, sampling)
        del self._reserved[request]
        self.batch.adopt(request, reservation.prompt, int(first), max_new_tokens, self.eos, position)
        self._adopted.add(request)
        return position

    def usable(self, request: str) -> int:
        """The position a reservation resumes at from what arrived (before anything did, the
        prefix it holds): the prompt's length when every group's KV is in place; below, the
        first gap of any group, or 0 where a sliding ring has wrapped (it holds later positions
        than the gap, so the prompt is recomputed from its start)."""
        reservation = self._reserved.get(request)
        if reservation is None:
            raise AdapterError(f"request {request!r} has no reservation here")
        n = len(reservation.prompt)
        position = min(group.usable(reservation.leases.get(name), n) for name, group in self.groups.items())
        if position < n and any(g.window is not None and n > g.window for g in self.groups.values()):
            return 0
        return position

    def drop(self, request: str) -> None:
        """Give up a reservation (its transfer failed or was cancelled): its blocks go back once
        nothing may touch them."""
        reservation = self._reserved.pop(request, None)
        if reservation is None:
            raise AdapterError(f"request {request!r} has no reservation here")
        self._dropped[request] = reservation.tables
        self._give_back()

    # --- what the engine holds --------------------------------------------------------------------
    def known(self, request: str) -> bool:
        """Whether ``request`` holds anything here: queued, prefilling, prefilled, reserved,
        adopted, or blocks waiting to go back."""
        return (request in self._prefilling or request in self.prefilled or request in self._reserved
                or request in self._adopted or request in self._unpin or request in self._dropped)

    def prefilling(self, request: str) -> bool:
        return request in self._prefilling

    def running(self, request: str) -> bool:
        """Adopted or colocated, and not ended yet (``results()`` has not given it)."""
        return request in self._adopted

    def reservation(self, request: str) -> Reservation | None:
        return self._reserved.get(request)

    def cancel(self, request: str) -> None:
        """End an adopted or colocated request before its end (its client left): transformers
        takes it out at the next step and frees its blocks (no attempt touches them: adoption
        waited for quiescence)."""
        self._adopted.discard(request)
        self.sampler.forget(request)
        self.batch.cancel(request)

    def block_counts(self) -> dict[str, int]:
        """transformers' blocks: ``blocks``, ``free``, ``cached`` (reusable), the rest in use.
        Refused (``UnsupportedCache``) for a hybrid cache: its groups share sectors, so none has
        a total of its own (``batch.reusable_block_count(group)`` counts what each may take)."""
        return self.batch.block_counts()

    def reclaim(self) -> None:
        """Give back to transformers the blocks of finished prefills and dropped reservations
        that no lease or attempt may touch any more (``step`` does it too)."""
        self._give_back()

    # --- internals -------------------------------------------------------------------------------
    def _check_new(self, request: str) -> None:
        if self.known(request):
            raise AdapterError(f"request {request!r} is already known to this engine")

    def _busy(self, tables: dict[str, np.ndarray]) -> bool:
        """Whether a lease or an unquiesced attempt may touch any of these blocks (per group)."""
        return any(group.lender.busy(tables[group.allocator]).any() for group in self.groups.values()
                   if group.allocator in tables)

    def _give_back(self) -> None:
        for request, tables in list(self._unpin.items()):
            if not self._busy(tables):
                del self._unpin[request]
                for group, blocks in tables.items():
                    self.batch.unpin(blocks.tolist(), group)
        for request, tables in list(self._dropped.items()):
            if not self._busy(tables):
                del self._dropped[request]
                self.batch.release(request)

    def shutdown(self) -> None:
        """Stop lending (refused while leases hold blocks) and restore the model's attention."""
        for group in self.groups.values():
            group.lender.shutdown()
        self.batch.close()


def _cut(layouts: dict[str, hf.CacheLayout], groups: int) -> dict[str, tuple[hf.CacheLayout, tuple[int, ...]]]:
    """The layer groups kvxfer lends: each allocator's layers (name -> its layout and the
    positions of its layers in a block), or with ``groups`` > 1 the full-attention layers cut
    into that many groups of consecutive layers (``layers{first}-{last}``, model indices)."""
    if groups == 1:
        return {name: (layout, tuple(range(layout.layers))) for name, layout in layouts.items()}
    if list(layouts) != [hf.FULL]:
        raise UnsupportedCache(f"layer-wise streaming ({groups} layer groups) cuts a cache of full-attention layers "
                               f"only; this model's cache has {sorted(layouts)} layers (sliding-window layers "
                               "beside full attention): serve it with --layerwise 1")
    layout = layouts[hf.FULL]
    if layout.layer_indices != tuple(range(layout.layers)):  # pragma: no cover - a full-attention model's own order
        raise UnsupportedCache(f"the cache holds layers {list(layout.layer_indices)} in a block: not the model's "
                               "layers in order, which layer-wise streaming cuts")
    return {name: (layout, tuple(range(first, first + count))) for name, first, count in cut_layers(layout.layers, groups)}


def _group_scope(scope: bytes, group: str, layout: hf.CacheLayout, positions: Sequence[int], *, one: bool) -> bytes:
    """The KV scope of a layer group: the engine and the weights, and when the cache has
    several groups which of the model's layers the group holds and its window, so that two
    ends whose groups differ (another layer pattern, window or cut) are refused as other KV."""
    base = ENGINE.encode() + b"|" + scope
    if one:
        return base
    layers = [layout.layer_indices[i] for i in positions]
    return base + f"|{group}|layers={layers}|window={layout.window}".encode()


def colocated_sampled(model: Any, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                      sampling: Iterable[RequestSampling], **options: Any) -> list[list[int]]:
    """Every prompt generated colocated in one ``TransformersEngine`` batch (``options``: its
    constructor's), each request's tokens picked by kvxfer's sampler as its ``sampling`` says:
    what a sampled request must make disaggregated (transformers' ``generate_batch`` samples
    with a sampler of its own). Greedy requests make ``generate_batch``'s tokens."""
    engine = TransformersEngine(model, **options)
    try:
        names = [f"colocated-{i}" for i in range(len(prompts))]
        for name, prompt, picking in zip(names, prompts, sampling, strict=True):
            engine.generate(name, prompt, max_new_tokens, picking)
        done: dict[str, list[int]] = {}
        while len(done) < len(names):
            if not engine.step() and engine.idle():
                raise AdapterError(f"the batch went idle with {len(names) - len(done)} requests unfinished")
            done.update(engine.results())
        return [done[name] for name in names]
    finally:
        engine.shutdown()
