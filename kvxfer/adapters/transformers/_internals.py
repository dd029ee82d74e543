"""Every reach into transformers, for one pinned version: a version change breaks here, loudly.

transformers' continuous batching (``transformers.generation.continuous_batching``) is not a
stable API. The adapter needs more of it than ``generate_batch`` offers, and this module is the
only one of kvxfer that imports transformers (an import-linter contract keeps it so). What it
reaches, and why:

- the step loop: ``ContinuousBatchingManager._create_batch_processor`` and
  ``_generation_loop_body``, run by the adapter's owner thread instead of the manager's own
  background thread, so that between two steps nothing else touches the scheduler or the cache;
- the cache: ``PagedAttentionCache.cache_tensor`` (one flat uint8 tensor) and each allocator's
  layout (``FullAttentionCacheAllocator`` and its subclass ``SlidingAttentionCacheAllocator``:
  a block is ``2 * page_size * layers`` rows of ``[kv_heads, head_dim]``, the group's ``i``-th
  layer's K at row ``2 i page_size`` of the block and its V at ``(2 i + 1) page_size``; block
  ids count from the tensor's start, trash sectors included, in the group's own block size);
- sliding-window layers: the sliding allocator's ring (the token at position ``p`` in slot
  ``p % sliding_window``, ``ceil(min(tokens, window) / page_size)`` blocks per request, no block
  sharing, and no prefix sharing for the whole cache while it exists: ``use_prefix_sharing``);
- block ownership: each allocator's ``block_table`` (a request's block ids), its ``BlockLedger``
  (reference counts: a pin is one more reference, so the pool cannot hand the block out again
  until the pin goes), ``CachePool.free_blocks``;
- requests: ``RequestState`` built at a position (``position_offset``, ``generated_tokens``,
  ``tokens_to_process``, status ``DECODING``) and put into ``Scheduler.active_requests``; the
  same fields the scheduler sets after a prompt's last chunk, and what ``OffloadingManager``
  restores "with exact request state";
- layer-wise streaming: a forward hook (``register_forward_hook``) on the decoder layers
  (``model.get_decoder().layers``) that end a layer group: when it runs, the layer has written
  this step's K/V into the cache (``PagedAttentionCache.update`` runs inside the layer's
  attention); the requests whose prompt ends in this step are those of
  ``ContinuousBatchingIOs.requests_in_batch`` with ``has_new_token`` (set before the forward);
- results: ``OutputRouter.output_queue`` (``get_result`` wants the manager's own thread);
- picking: ``ModelRunner._sample`` (where a step's logits, one row per request with a new token,
  in the order of ``ContinuousBatchingIOs.requests_in_batch``, become tokens) is wrapped so that
  kvxfer's sampler picks the rows of requests that sample or want logprobs; a batch where none
  does keeps transformers' own argmax. A request's completion so far is its ``generated_tokens``
  (after a soft reset, also ``initial_tokens`` past ``_true_initial_tokens``).
"""

from __future__ import annotations

import contextlib
import functools
import json
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvxfer.adapters.errors import EngineVersionError, UnsupportedCache

PINNED = "5.24.0"
ENGINE = f"transformers {PINNED}"


def installed_version() -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("transformers")
    except PackageNotFoundError:
        return None


def check_version(found: str | None = None) -> str:
    """The installed transformers' version if it is the pinned one; EngineVersionError naming
    both otherwise (``found``: a version to check instead of the installed one)."""
    found = installed_version() if found is None else found
    if found is None:  # a missing extra, as any other: an import error naming the package
        raise ModuleNotFoundError(f"transformers is not installed: the transformers adapter needs transformers=="
                                  f"{PINNED} (pip install 'kvxfer[transformers]')", name="transformers")
    if found != PINNED:
        raise EngineVersionError(f"transformers {found} is installed, but the transformers adapter reaches into the "
                                 f"continuous-batching internals of transformers {PINNED} only (kvxfer/adapters/"
                                 f"transformers/_internals.py); install transformers=={PINNED}")
    return found


check_version()

from transformers import AutoModelForCausalLM, GenerationConfig  # noqa: E402
from transformers.generation.configuration_utils import ContinuousBatchingConfig  # noqa: E402
from transformers.generation.continuous_batching.cache_allocators import (  # noqa: E402
    FULL_ATTENTION,
    SLIDING_ATTENTION,
    FullAttentionCacheAllocator,
    SlidingAttentionCacheAllocator,
)
from transformers.generation.continuous_batching.continuous_api import ContinuousBatchingManager  # noqa: E402
from transformers.generation.continuous_batching.requests import RequestState, RequestStatus  # noqa: E402


# --- the model ---------------------------------------------------------------------------------
@contextlib.contextmanager
def _gguf_parsed_once() -> Iterator[None]:
    """transformers 5.24 parses a GGUF three times (config, weights, tokenizer) and rebuilds gguf's
    tensor-name map for each tensor; both are pure functions of their arguments, so memoizing them
    while one load runs gives the same objects in a third of the time. Its conversion's progress
    bar is off meanwhile."""
    import gguf
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    saved = gguf.GGUFReader, gguf.get_tensor_name_map, gguf_utils.tqdm
    gguf.GGUFReader = functools.lru_cache(maxsize=None)(gguf.GGUFReader)  # type: ignore[misc, assignment]
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(gguf.get_tensor_name_map)  # type: ignore[assignment]
    gguf_utils.tqdm = lambda items, **_: items  # its progress bar (tqdm.auto) would fill a worker's log
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map, gguf_utils.tqdm = saved  # type: ignore[misc]


def load_gguf_model(path: Path, dtype: torch.dtype = torch.float32) -> Any:
    """A causal LM loaded by transformers itself from a GGUF file (``gguf_file=``), eval mode."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # "Loading weights": a worker's log is for what goes wrong
    with _gguf_parsed_once():
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype)
    return model.eval()


def save_model(model: Any, directory: Path) -> None:
    """The model's loaded weights as a checkpoint ``from_pretrained`` reads (``save_pretrained``
    refuses a model loaded from a GGUF): config, generation config, safetensors."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    config = model.config.to_dict()
    config.pop("quantization_config", None)  # the GGUF's; the weights saved are dequantized
    (directory / "config.json").write_text(json.dumps(config))
    model.generation_config.save_pretrained(str(directory))
    tied = {name for name, p in model.named_parameters(remove_duplicate=False)} - {
        name for name, p in model.named_parameters()}  # a tied tensor is saved once
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k not in tied}
    save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})


def load_saved_model(directory: Path, dtype: torch.dtype = torch.float32) -> Any:
    """A model ``save_model`` wrote: the same weights, without parsing a GGUF again."""
    return AutoModelForCausalLM.from_pretrained(str(directory), dtype=dtype).eval()


def random_model(*, vocab_size: int, hidden: int, layers: int, heads: int, kv_heads: int, head_dim: int,
                 intermediate: int, rope_theta: float, rms_eps: float, max_positions: int, seed: int,
                 dtype: torch.dtype, device: torch.device) -> Any:
    """A Llama-style model with transformers' own random initialization, seeded: the same
    weights in every process that builds it with these arguments on the same kind of device.
    Built on ``device`` itself (a 1B model initializes in seconds on a GPU, minutes on a CPU)."""
    from transformers import LlamaConfig

    config = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=intermediate,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         head_dim=head_dim, rope_theta=rope_theta, rms_norm_eps=rms_eps,
                         max_position_embeddings=max_positions, tie_word_embeddings=False,
                         bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


def random_hybrid_model(*, vocab_size: int, hidden: int, layer_types: Sequence[str], window: int, heads: int,
                        kv_heads: int, intermediate: int, rope_theta: float, rms_eps: float,
                        max_positions: int, seed: int, dtype: torch.dtype, device: torch.device) -> Any:
    """A Qwen2-style model (head_dim ``hidden // heads``) whose layers are ``layer_types``
    (``FULL`` or ``SLIDING``, sliding layers attending to the last ``window`` tokens):
    transformers' continuous batching keeps each kind in an allocator of its own. Seeded random
    weights, as ``random_model``."""
    from transformers import Qwen2Config

    config = Qwen2Config(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=intermediate,
                         num_hidden_layers=len(layer_types), num_attention_heads=heads, num_key_value_heads=kv_heads,
                         rope_theta=rope_theta, rms_norm_eps=rms_eps,
                         max_position_embeddings=max_positions, use_sliding_window=True, sliding_window=window,
                         layer_types=list(layer_types), tie_word_embeddings=False, bos_token_id=None,
                         eos_token_id=None, pad_token_id=None)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


def model_eos(model: Any) -> int | None:
    eos = model.generation_config.eos_token_id
    if eos is None:
        eos = model.config.eos_token_id
    if isinstance(eos, (list, tuple)):
        if len(eos) != 1:
            raise UnsupportedCache(f"the model names {len(eos)} end-of-sequence tokens; the adapter takes one")
        eos = eos[0]
    return None if eos is None else int(eos)


def vocab_size(model: Any) -> int:
    """The length of a row of the model's logits (its output embedding's rows)."""
    return int(model.get_output_embeddings().weight.shape[0])


def batching_config(page_size: int, num_blocks: int, max_batch_tokens: int,
                    max_requests_per_batch: int | None = None) -> Any:
    """A continuous-batching config the adapter can step by hand: no async double buffering, no
    CUDA graphs, no compile, no fast decode path (its block table is not the adapter's concern),
    block sharing on (prefix sharing)."""
    return ContinuousBatchingConfig(page_size=page_size, num_blocks=num_blocks, max_batch_tokens=max_batch_tokens,
                                    max_requests_per_batch=max_requests_per_batch, use_async_batching=False,
                                    use_cuda_graph=False, max_blocks_per_request=0, allow_block_sharing=True,
                                    auto_switch_to_flash=False)


def greedy_config(model: Any, max_new_tokens: int) -> Any:
    eos = model_eos(model)  # none (seeded weights): -1, what continuous batching sets itself, with a warning
    return GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=-1 if eos is None else eos,
                            pad_token_id=model.generation_config.pad_token_id)


def colocated(model: Any, prompts: Sequence[Sequence[int]], max_new_tokens: int, config: Any) -> list[list[int]]:
    """transformers' own colocated continuous batching (``generate_batch``), greedy: the
    generated tokens of each prompt, in order."""
    return [tokens for tokens, _, _ in colocated_timed(model, prompts, max_new_tokens, config)]


def colocated_timed(model: Any, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                    config: Any) -> list[tuple[list[int], float, float]]:
    """``colocated``, with each request's time to its first token and to its last (from its
    creation in the batch, s)."""
    out = model.generate_batch([list(p) for p in prompts], generation_config=greedy_config(model, max_new_tokens),
                               continuous_batching_config=config, warmup=False, record_timestamps=True)
    results = list(out.values())
    if len(results) != len(prompts) or any(r.error for r in results):
        raise RuntimeError(f"generate_batch returned {len(results)} of {len(prompts)} results "
                           f"({[r.error for r in results if r.error]})")
    nan = float("nan")
    return [(list(r.generated_tokens), r.timestamps[0] - r.created_time if r.timestamps else nan,
             r.timestamps[-1] - r.created_time if r.timestamps else nan) for r in results]


# --- the batch, stepped by its owner ----------------------------------------------------------
FULL = FULL_ATTENTION        # the layer groups (allocators) the adapter lends, by transformers' names
SLIDING = SLIDING_ATTENTION

Picker = Callable[[list[str], torch.Tensor], torch.Tensor | None]
"""Picks a step's tokens: given the requests with a new token and their float32 logits (one row
each, in that order), the tokens (an int64 tensor, one per row), or None for transformers' own."""


@dataclass(frozen=True)
class CacheLayout:
    """What the adapter needs of one allocator's layer group: the tensor that owns the memory
    (all groups share it) and where each of the group's layers has its K and V pages in a block."""

    group: str                 # FULL or SLIDING
    tensor: torch.Tensor       # the flat uint8 cache tensor (contiguous, trash sectors first)
    typed: torch.Tensor        # the same memory as rows of [kv_heads, head_dim] in the cache dtype
    page_size: int
    layers: int
    kv_heads: int
    head_dim: int
    blocks: int                # block ids lie in [0, blocks): the tensor's whole blocks of this group
    layer_indices: tuple[int, ...]  # the model's layers the group holds, in page order
    window: int | None         # SLIDING: the ring's size in tokens (slot = position % window)

    def plane(self, layer: int, value: bool) -> torch.Tensor:
        """Layer ``layer``'s K (or V) as ``[blocks, page_size, kv_heads, head_dim]``, a view."""
        p, h, d = self.page_size, self.kv_heads, self.head_dim
        row = h * d
        offset = self.typed.storage_offset() + (2 * layer + int(value)) * p * row
        return self.typed.as_strided((self.blocks, p, h, d), (2 * p * self.layers * row, row, d, 1), offset)


class Batch:
    """A continuous batch (manager, processor, scheduler, cache) stepped by one owner thread."""

    def __init__(self, model: Any, config: Any, max_new_tokens: int) -> None:
        self.model = model
        self.manager = ContinuousBatchingManager(model, greedy_config(model, max_new_tokens), config)
        self.processor = self.manager._create_batch_processor()
        self.manager.batch_processor = self.processor
        self.manager.current_batch = 0
        self.cache = self.processor.cache
        self.scheduler = self.processor.scheduler
        kinds = sorted(self.cache.cache_allocators)
        if not kinds or set(kinds) - {FULL, SLIDING}:
            raise UnsupportedCache(f"the model's cache has {kinds} layers; the transformers adapter lends "
                                   f"{FULL!r} and {SLIDING!r} layers only")
        self.allocators: dict[str, FullAttentionCacheAllocator] = {}
        for kind in (FULL, SLIDING):
            allocator = self.cache.cache_allocators.get(kind)
            if allocator is None:
                continue
            expected = FullAttentionCacheAllocator if kind == FULL else SlidingAttentionCacheAllocator
            if type(allocator) is not expected:  # pragma: no cover - the pinned version
                raise UnsupportedCache(f"unexpected allocator {type(allocator).__name__} for {kind!r} layers")
            self.allocators[kind] = allocator
        # The group whose tokens are positions, when there is one: the full-attention layers.
        self.allocator: FullAttentionCacheAllocator = next(iter(self.allocators.values()))
        self._ended: list[tuple[str, list[int], str | None]] = []
        self.picker: Picker | None = None
        self._hook_sampling()
        self._layer_hooks: list[Any] = []
        self._stepping: int | None = None  # the thread running this batch's forward, while it runs

    def _hook_sampling(self) -> None:
        """Route the step's logits through ``self.picker`` (when set) instead of transformers'
        sampling; the config asks for neither sampling nor logprobs, so its own step is the argmax."""
        runner = self.processor.model_runner
        io: Any = self.processor.inputs_and_outputs  # the synchronous ContinuousBatchingIOs (batching_config)
        if runner.do_sample or runner.return_logprobs or self.manager.logit_processor.do_processing:
            raise UnsupportedCache("transformers' continuous batching would sample or process the logits itself; the "
                                   "adapter's batch must leave picking to kvxfer's sampler")
        own = runner._sample

        def sample(scores: torch.Tensor, output_ids: torch.Tensor) -> None:
            picked = None
            if self.picker is not None:
                requests = [f.state.request_id for f in io.requests_in_batch if f.has_new_token]
                picked = self.picker(requests, scores[0, : len(requests)])
            if picked is None:
                own(scores, output_ids)
            else:
                output_ids[0, : picked.numel()].copy_(picked)

        runner._sample = sample  # type: ignore[method-assign]

    def watch_layers(self, ends: Mapping[int, str], watched: Mapping[str, Callable[[str], None]]) -> None:
        """Layer-wise streaming: after the decoder layer ``i`` of ``ends`` (model layer index ->
        the name of the layer group it ends) has run in one of this batch's steps, call
        ``watched[request](name)`` for each request of ``watched`` whose prompt ends in this
        step: its K/V of that group's layers is in the cache. Only on the thread that steps
        this batch (workers of one process may share the model and its layers, so its hooks fire
        in their forwards too). ``close`` takes the hooks off."""
        layers = getattr(self.model.get_decoder(), "layers", None)
        if layers is None or not isinstance(layers, torch.nn.ModuleList):
            raise UnsupportedCache(f"{type(self.model).__name__}'s decoder has no list of layers to hook: it cannot "
                                   "stream layer groups")
        io: Any = self.processor.inputs_and_outputs

        def hook(group: str) -> Callable[..., None]:
            def after(module: Any, args: Any, output: Any) -> None:
                if self._stepping != threading.get_ident() or not watched:
                    return
                ready = [f.state.request_id for f in io.requests_in_batch
                         if f.has_new_token and f.state.request_id in watched]
                if not ready:
                    return
                first = output[0] if isinstance(output, (tuple, list)) else output
                if isinstance(first, torch.Tensor) and first.is_cuda:
                    # The hook runs on the owner thread once the layer's kernels are queued, not
                    # done: wait for the current stream (which wrote the cache) before the group
                    # is lent and a backend may read it. A stream synchronize, not an event: the
                    # publish that follows is synchronous on this thread anyway.
                    torch.cuda.current_stream(first.device).synchronize()
                for request in ready:
                    watched[request](group)
            return after

        for index, group in sorted(ends.items()):
            if not 0 <= index < len(layers):
                raise UnsupportedCache(f"layer {index} ends layer group {group!r}, but the model has {len(layers)} layers")
            self._layer_hooks.append(layers[index].register_forward_hook(hook(group)))

    def completion(self, request_id: str) -> tuple[list[int], list[int]]:
        """(the tokens before its completion, the completion so far) of a request in the batch,
        as its state holds them (a soft reset moves generated tokens into its prompt)."""
        state = self.scheduler.active_requests[request_id]
        cut = state._true_initial_tokens or len(state.initial_tokens)
        return state.initial_tokens[:cut], state.initial_tokens[cut:] + state.generated_tokens

    def close(self) -> None:
        """Restore the model's attention implementation (the manager switched it) and take the
        layer hooks off."""
        self.manager._generation_thread = None
        for handle in self._layer_hooks:
            handle.remove()
        self._layer_hooks.clear()
        if self.manager._original_attn_impl is not None:
            self.model.set_attn_implementation(self.manager._original_attn_impl)
            self.manager._original_attn_impl = None

    def layouts(self) -> dict[str, CacheLayout]:
        """Each layer group's layout, full attention first."""
        out = {}
        tensor = self.cache.cache_tensor
        for group, a in self.allocators.items():
            if a.layer_indices != sorted(a.layer_indices):
                raise UnsupportedCache(f"{group} layers {a.layer_indices} are not in the model's order")
            pages = tensor.numel() // a.bytes_per_page
            window = a.sliding_window if isinstance(a, SlidingAttentionCacheAllocator) else None
            out[group] = CacheLayout(group=group, tensor=tensor,
                                     typed=a.cache_tensor.view(-1, a.num_key_value_heads, a.head_dim),
                                     page_size=a.tokens_per_page, layers=a.pages_per_block,
                                     kv_heads=a.num_key_value_heads, head_dim=a.head_dim,
                                     blocks=pages // a.pages_per_block, layer_indices=tuple(a.layer_indices),
                                     window=window)
        return out

    @property
    def prefix_sharing(self) -> bool:
        """Whether the cache shares prompt prefixes (off while any group cannot: a sliding ring)."""
        return bool(self.cache.use_prefix_sharing)

    # --- the step loop -------------------------------------------------------------------------
    def submit(self, request_id: str, prompt: Sequence[int], max_new_tokens: int, eos: int | None) -> None:
        """Queue a prompt; the next step takes it. ``eos`` None: no end-of-sequence token."""
        self.manager.add_request(list(prompt), request_id=request_id, max_new_tokens=max_new_tokens,
                                 eos_token_id=-1 if eos is None else eos)

    def step(self) -> bool:
        """One scheduling round and forward pass; False when there was nothing to run."""
        if not self.processor.prepare_next_batch():
            return False
        self._stepping = threading.get_ident()
        try:
            self.manager._generation_step()
        finally:
            self._stepping = None
        self.manager.current_batch += 1
        self.processor.update_batch()
        return True

    def results(self) -> list[tuple[str, list[int], str | None]]:
        """(request id, generated tokens, error) of each request that ended since the last call."""
        out, self._ended = self._ended, []
        q = self.processor.output_router.output_queue
        while not q.empty():
            r = q.get_nowait()
            if r.is_finished():
                out.append((r.request_id, list(r.generated_tokens), r.error))
        return out

    def active(self, request_id: str) -> Any:
        return self.scheduler.active_requests.get(request_id)

    def generated(self, request_id: str) -> list[int]:
        state = self.active(request_id)
        return [] if state is None else list(state.generated_tokens)

    def block_table(self, request_id: str, group: str | None = None) -> list[int]:
        return list(self._group(group).block_table.get(request_id, ()))

    def free_empty_sectors(self) -> None:
        """Give the sectors none of whose blocks is in use back to the pool, as the scheduler
        does before it allocates (between two steps only): an empty sector then counts as
        reusable in every group, not only in the group that used it last."""
        self.cache.pool.try_to_free_sectors()

    def reusable_block_count(self, group: str | None = None) -> int:
        """Blocks of ``group`` transformers may hand out now: free ones, free sectors' and those
        its prefix cache keeps with no reference (evicted under pressure)."""
        pool, a = self.cache.pool, self._group(group)
        free = pool.count_free_blocks(a.index) + pool.num_free_sectors * a.blocks_per_sector
        return free + len(a.ledger.cached_blocks)

    def block_counts(self) -> dict[str, int]:
        """The blocks of a one-group cache as kvxfer counts a pool's: ``blocks`` (all transformers
        may hand out, trash sectors left out), ``free`` (free ones and free sectors'), ``cached``
        (its prefix cache's, no reference: reusable). The rest are in use: by a request, a
        prefill's pin, or a reservation."""
        if len(self.allocators) != 1:
            # Sectors move between groups and transformers records no sector's owner: a group's
            # total (hence its in-use count) is not defined; ``free_fraction`` is the cache's.
            raise UnsupportedCache(f"block counts are per pool; this cache's layer groups {sorted(self.allocators)} "
                                   "share its sectors, so no group has a block total of its own "
                                   "(use free_fraction, or reusable_block_count per group)")
        pool, a = self.cache.pool, self.allocator
        free = pool.count_free_blocks(a.index) + pool.num_free_sectors * a.blocks_per_sector
        return {"blocks": pool.num_sectors * a.blocks_per_sector, "free": free, "cached": len(a.ledger.cached_blocks)}

    def free_fraction(self) -> float:
        """The share of the cache no request, pin or reservation holds (1.0: all of it); free
        blocks of every group count, though a group's sector goes to another only once empty."""
        return float(self.cache.compute_free_capacity())

    def read_rows(self, blocks: Sequence[int], tokens: int, group: str | None = None) -> list[int]:
        """The cache rows transformers' attention reads for tokens [0, tokens) held in ``blocks``
        (for a sliding group, ring slots [0, tokens): the positions before the ring wraps), for
        checking a geometry against the engine."""
        probe = "kvxfer-probe"
        a = self._group(group)
        a.block_table[probe] = [int(b) for b in blocks]
        try:
            if isinstance(a, SlidingAttentionCacheAllocator):
                return list(a._token_indices_to_physical_indices(probe, 0, tokens))
            return list(a.get_read_indices(probe, 0, tokens))
        finally:
            del a.block_table[probe]

    def token_views(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer``'s K and V rows as transformers indexes them when it reads the cache."""
        allocator: FullAttentionCacheAllocator = self.cache.layer_to_allocator[layer]  # type: ignore[assignment]
        k, v = allocator._kv_token_views[layer]
        return k, v

    def _group(self, group: str | None) -> FullAttentionCacheAllocator:
        if group is None:
            return self.allocator
        found = self.allocators.get(group)
        if found is None:
            raise UnsupportedCache(f"the model's cache has no {group!r} layers (it has {sorted(self.allocators)})")
        return found

    def idle(self) -> bool:
        queued = self.processor.input_queue
        return not self.scheduler.has_pending_requests() and (queued is None or queued.empty())

    # --- block ownership -------------------------------------------------------------------------
    def pin(self, blocks: Sequence[int], group: str | None = None) -> None:
        """One more reference to each block of ``group``: the pool cannot hand it out (nor its
        sector to another group) until ``unpin``."""
        a = self._group(group)
        for b in blocks:
            a.ledger.acquire(int(b))

    def unpin(self, blocks: Sequence[int], group: str | None = None) -> None:
        """Drop a pin; a block nobody references goes back to transformers' pool (or its prefix cache)."""
        a = self._group(group)
        freed = [int(b) for b in blocks if a.ledger.release(int(b))]
        self.cache.pool.free_blocks(a.index, freed)

    def detach(self, request_id: str) -> None:
        """End a request in the scheduler without a result (its blocks lose the request's reference)."""
        state = self.scheduler.active_requests.get(request_id)
        if state is not None:
            state.status = RequestStatus.FINISHED
        self.scheduler.finish_request(request_id)

    def cancel(self, request_id: str) -> None:
        """End a request queued or running in the batch, without a result: the next step takes
        it out and its blocks go back (transformers' own cancellation)."""
        self.scheduler.set_request_cancellation(request_id)

    def reserve(self, request_id: str, prompt: Sequence[int]) -> tuple[dict[str, list[int]], int] | None:
        """Blocks for ``prompt`` outside the scheduler: (each group's block table, tokens of the
        prompt already held by prefix sharing), or None when the cache has no room. A sliding
        group gets its whole ring (the last ``window`` tokens' blocks), whatever is held. The
        blocks are the request's until ``release`` or ``adopt``."""
        state = RequestState(request_id=request_id, initial_tokens=list(prompt))
        held = self.cache.search_prefix_match(request_id, list(prompt))
        state.position_offset = held
        self.scheduler._try_to_meet_safety_margin()
        if not self.cache.can_store_request_tokens(state, len(prompt) - held):
            self.cache.free_blocks(request_id)
            return None
        return {group: self.block_table(request_id, group) for group in self.allocators}, held

    def end(self, request_id: str, tokens: list[int]) -> None:
        """End a reserved request without running it (its first token ended it)."""
        self.release(request_id)
        self._ended.append((request_id, tokens, None))

    def release(self, request_id: str) -> None:
        """Give a reservation's blocks back (not kept for prefix sharing: their KV may be partial)."""
        self.cache.free_blocks(request_id, no_cache=True)

    def adopt(self, request_id: str, prompt: Sequence[int], first: int, max_new_tokens: int, eos: int | None,
              position: int) -> None:
        """Make a reserved request decode in the batch: its KV holds ``prompt[:position]``. At
        ``position == len(prompt)`` it resumes with ``first`` (the token prefill produced) as
        the next input, as the scheduler leaves a request after its prompt's last chunk;
        below, the rest of the prompt is prefilled again (its first token recomputed)."""
        n = len(prompt)
        state = RequestState(request_id=request_id, initial_tokens=list(prompt), max_new_tokens=max_new_tokens,
                             eos_token_id=-1 if eos is None else eos)
        state.position_offset = position
        if position == n:
            state.remaining_prefill_tokens = []
            state.generated_tokens = [int(first)]
            state.tokens_to_process = [int(first)]
            state.status = RequestStatus.DECODING
            full = self.allocators.get(FULL)
            if full is not None and self.prefix_sharing:  # as the scheduler: no hashes while prefixes aren't shared
                complete = n // full.tokens_per_page - len(full.ledger.block_to_hash.keys()
                                                           & set(self.block_table(request_id, FULL)))
                if complete > 0:  # the prompt's whole blocks become a prefix other requests may share
                    self.cache.mark_complete_blocks(state, {FULL: complete})
        else:
            state.remaining_prefill_tokens = list(prompt[position:])
            state.status = RequestStatus.PREFILLING
        self.scheduler.active_requests[request_id] = state
