"""The transformers adapter on hybrid caches: sliding-window layers in an allocator of their
own beside full-attention ones (a tiny random Qwen2-style model, window 10, 4-token pages, so
the ring's last block is partial), and a sliding-only Mistral. Each layer group is its own
geometry over the one cache tensor and moves by its own lease; the sliding group moves only
its ring. Decoding is token for token transformers' colocated ``generate_batch`` for prompts
shorter than the window, as long and longer (the ring wrapped); a partial transfer resumes
where it is safe, from 0 when a wrapped ring cannot be trusted."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

from kvxfer.adapters.errors import UnsupportedCache
from kvxfer.adapters.transformers import TransformersEngine
from kvxfer.adapters.transformers import _internals as hf
from kvxfer.backends.loopback import LoopbackBackend
from kvxfer.contract import Delivered, Failed, InvalidSubmission, TransferMode
from kvxfer.testing.nixl_geometry import kv_tokens, local_bytes
from kvxfer.testing.transformers_moves import decode_all, move, prefill_all

torch.set_num_threads(1)
PAGE = 4
WINDOW = 10
NEW = 6
LAYERS = (hf.SLIDING, hf.FULL, hf.SLIDING)  # the sliding group's blocks are twice the full group's
PROMPTS = [[(7 * i + 3 + j) % 128 for i in range(n)] for j, n in enumerate([5, 10, 12, 23, 41])]  # <, =, > window
FULL, SLIDING = hf.FULL, hf.SLIDING


def hybrid_model(window: int = WINDOW) -> Any:
    return hf.random_hybrid_model(vocab_size=128, hidden=64, layer_types=LAYERS, window=window, heads=4, kv_heads=2,
                                  intermediate=128, rope_theta=10000.0, rms_eps=1e-6, max_positions=256, seed=3,
                                  dtype=torch.float32, device=torch.device("cpu"))


@pytest.fixture(scope="module")
def model() -> Any:
    return hybrid_model()


@pytest.fixture(scope="module")
def sliding_only() -> Any:
    """Every layer sliding (Mistral: a sliding window and no layer types): one group, a ring."""
    import transformers

    config = transformers.MistralConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                                        num_key_value_heads=2, intermediate_size=128, vocab_size=128,
                                        sliding_window=WINDOW, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(5)
    return transformers.MistralForCausalLM(config).eval()


def oracle_of(model: Any) -> list[list[int]]:
    return hf.colocated(model, PROMPTS, NEW, hf.batching_config(PAGE, 64, 64))


@pytest.fixture(scope="module")
def oracle(model: Any) -> list[list[int]]:
    return oracle_of(model)


@pytest.fixture
def engines() -> Iterator[Any]:
    made: list[TransformersEngine] = []

    def make(model: Any) -> TransformersEngine:
        engine = TransformersEngine(model, page_size=PAGE, num_blocks=64, max_batch_tokens=64, name=f"sw{len(made)}")
        made.append(engine)
        return engine

    yield make
    for engine in made:
        for group in engine.groups.values():
            group.lender.shutdown(force=True)
        engine.batch.close()


def connect(prefill: TransformersEngine, decode: TransformersEngine, make: Any,
            **options: Any) -> tuple[LoopbackBackend, LoopbackBackend]:
    pair = make(**options)
    pair[0].register(prefill.regions)
    pair[1].register(decode.regions)
    return pair


def hand_over(prefill: TransformersEngine, decode: TransformersEngine, request: str, prompt: list[int],
              pairs: dict[str, tuple[LoopbackBackend, LoopbackBackend]]) -> dict[str, Any]:
    """Reserve at decode, move every group's lease over its pair, finish the prefill: outcomes."""
    reservation = decode.reserve(request, prompt)
    assert reservation is not None and set(reservation.leases) == set(decode.groups)
    reads = prefill.lend_prefill_groups(request)
    outcomes = {g: move(pairs[g], reads[g], reservation.leases[g]) for g in decode.groups}
    prefill.finish_prefill(request)
    return outcomes


def test_each_group_has_its_own_geometry_over_the_one_cache_tensor(engines: Any, model: Any) -> None:
    engine = engines(model)
    assert list(engine.groups) == [FULL, SLIDING] and engine.hybrid
    full, ring = engine.groups[FULL].kv, engine.groups[SLIDING].kv
    assert (full.geometry.layers, ring.geometry.layers) == (1, 2)
    assert ring.geometry.block_bytes == 2 * full.geometry.block_bytes  # each group its own block size
    assert engine.regions == full.regions == ring.regions  # one memory: the cache tensor, registered once
    assert engine.regions[0].address == engine.batch.cache.cache_tensor.data_ptr()
    assert full.layout != ring.layout  # their KV differs in meaning (other layers, a window)
    prefill_all(engine, [PROMPTS[0], PROMPTS[4]])
    memory = local_bytes(full)
    for request, prompt in (("r0", PROMPTS[0]), ("r1", PROMPTS[4])):
        done = engine.prefilled[request]
        assert done.tables[SLIDING].size == -(-min(len(prompt), WINDOW) // PAGE)  # the ring's blocks only
        for group, layers in ((FULL, (1,)), (SLIDING, (0, 2))):
            kv = engine.groups[group].kv
            slots = len(prompt) if group == FULL else min(len(prompt), WINDOW)  # positions, or ring slots
            got = kv_tokens(kv.geometry, memory, done.tables[group], slots)  # [2 * layers, slots, heads, bytes]
            rows = torch.tensor(engine.batch.read_rows(done.tables[group].tolist(), slots, group))
            for i, layer in enumerate(layers):
                for plane, view in zip((2 * i, 2 * i + 1), engine.batch.token_views(layer)):
                    theirs = view.index_select(0, rows).contiguous().view(torch.uint8).numpy()
                    assert np.array_equal(got[plane].reshape(theirs.shape), theirs), f"{group} layer {layer}"


@pytest.mark.parametrize("mode", [TransferMode.PUSH, TransferMode.PULL], ids=["push", "pull"])
def test_decode_adopts_hybrid_requests_token_identical_beside_its_own(
        engines: Any, wire: Any, model: Any, oracle: list[list[int]], mode: TransferMode) -> None:
    prefill, decode = engines(model), engines(model)
    pair = connect(prefill, decode, wire, mode=mode)
    firsts = prefill_all(prefill, PROMPTS[1:])
    decode.generate("c", PROMPTS[0], NEW)  # colocated beside them: the decode end's block ids differ
    decode.step()
    for i, prompt in enumerate(PROMPTS[1:]):
        request = f"r{i}"
        outcomes = hand_over(prefill, decode, request, prompt, {FULL: pair, SLIDING: pair})
        assert all(isinstance(o, Delivered) and o.all_delivered for o in outcomes.values())
        assert outcomes[SLIDING].masks[0].size == -(-min(len(prompt), WINDOW) // PAGE)  # only the ring moved
        assert decode.adopt(request, firsts[request], NEW) == len(prompt)
        decode.step()
    got = decode_all(decode, len(PROMPTS))
    assert [got["c"], *(got[f"r{i}"] for i in range(len(PROMPTS) - 1))] == oracle
    prefill.step()
    assert prefill.idle() and decode.idle()
    assert prefill.batch.free_fraction() == decode.batch.free_fraction() == 1.0  # both groups' blocks went back


def test_a_sliding_only_model_moves_its_ring_token_identical(engines: Any, wire: Any, sliding_only: Any) -> None:
    prefill, decode = engines(sliding_only), engines(sliding_only)
    assert list(decode.groups) == [SLIDING] and not decode.hybrid
    pair = connect(prefill, decode, wire)
    firsts = prefill_all(prefill, PROMPTS)
    for i, prompt in enumerate(PROMPTS):
        reservation = decode.reserve(f"r{i}", prompt)
        assert reservation is not None and reservation.lease is not None  # one group: one lease, as full attention
        assert (reservation.lease.tokens.start, reservation.lease.tokens.end) == (0, min(len(prompt), WINDOW))
        move(pair, prefill.lend_prefill(f"r{i}"), reservation.lease)
        prefill.finish_prefill(f"r{i}")
        assert decode.adopt(f"r{i}", firsts[f"r{i}"], NEW) == len(prompt)
    got = decode_all(decode, len(PROMPTS))
    assert [got[f"r{i}"] for i in range(len(PROMPTS))] == oracle_of(sliding_only)


def test_the_ring_decides_the_tokens(engines: Any, wire: Any, model: Any, oracle: list[list[int]]) -> None:
    """The check above can fail: a ring said to have arrived that holds nothing gives other
    tokens (the full-attention group alone does not make them)."""
    prefill, decode = engines(model), engines(model)
    pair = connect(prefill, decode, wire)
    firsts = prefill_all(prefill, [PROMPTS[4]])
    reservation = decode.reserve("r0", PROMPTS[4])
    assert reservation is not None
    reads = prefill.lend_prefill_groups("r0")
    move(pair, reads[FULL], reservation.leases[FULL])
    ring = reservation.leases[SLIDING]
    ring.mark_arrived([np.ones(len(ring.view().groups[0]), dtype=bool)])  # no byte moved
    ring.release()
    reads[SLIDING].release()
    assert decode.adopt("r0", firsts["r0"], NEW) == len(PROMPTS[4])
    assert decode_all(decode, 1)["r0"] != oracle[4]


@pytest.mark.parametrize(("prompt", "failing", "resumes"), [
    (4, SLIDING, 0),      # the ring wrapped (41 > 10) and one block of it arrived: recomputed from 0
    (4, FULL, 0),         # the ring is whole but the full group has a gap: a wrapped ring holds later tokens
    (1, FULL, PAGE),      # 10 tokens, the ring never wrapped: ring slot = position, resume at the first gap
    (1, SLIDING, PAGE),
], ids=["wrapped-ring-gap", "wrapped-full-gap", "unwrapped-full-gap", "unwrapped-ring-gap"])
def test_a_partial_transfer_resumes_where_it_is_safe(engines: Any, wire: Any, model: Any, oracle: list[list[int]],
                                                     prompt: int, failing: str, resumes: int) -> None:
    prefill, decode = engines(model), engines(model)
    good = connect(prefill, decode, wire)
    bad = connect(prefill, decode, wire, fail_after_rows=1)  # one block of the group arrives
    firsts = prefill_all(prefill, [PROMPTS[prompt]])
    outcomes = hand_over(prefill, decode, "r0", PROMPTS[prompt], {FULL: good, SLIDING: good, failing: bad})
    assert isinstance(outcomes[failing], Failed) and outcomes[failing].masks[0].tolist()[:2] == [True, False]
    assert all(isinstance(o, Delivered) for g, o in outcomes.items() if g != failing)
    assert decode.usable("r0") == resumes
    assert decode.adopt("r0", firsts["r0"], NEW) == resumes  # the rest of the prompt is prefilled again here
    assert decode_all(decode, 1)["r0"] == oracle[prompt]


def test_both_groups_blocks_stay_out_of_reuse_until_every_lease_is_quiet(engines: Any, model: Any) -> None:
    engine = engines(model)
    prefill_all(engine, [PROMPTS[4]])
    tables = engine.prefilled["r0"].tables
    assert {g: t.size for g, t in tables.items()} == {FULL: 11, SLIDING: 3}  # 41 tokens; a 10-token ring
    pinned = {g: engine.batch.reusable_block_count(g) for g in tables}
    leases = engine.lend_prefill_groups("r0")
    assert [lease.request for lease in leases.values()] == ["r0/full_attention", "r0/sliding_attention"]
    engine.finish_prefill("r0")
    leases[FULL].release()
    engine.step()
    assert {g: engine.batch.reusable_block_count(g) for g in tables} == pinned, "blocks went back while the ring is lent"
    assert engine.batch.free_fraction() < 1.0
    leases[SLIDING].release()
    engine.step()
    assert engine.batch.free_fraction() == 1.0
    # A reservation dropped while its leases are open: its blocks go back once they are released.
    reservation = engine.reserve("d", PROMPTS[4])
    assert reservation is not None
    held = {g: engine.batch.reusable_block_count(g) for g in tables}
    engine.drop("d")
    engine.step()
    assert {g: engine.batch.reusable_block_count(g) for g in tables} == held
    for lease in reservation.leases.values():
        lease.release()
    engine.step()
    assert engine.batch.free_fraction() == 1.0


def test_no_prefix_is_shared_beside_a_ring_so_every_group_is_fetched_whole(engines: Any, model: Any) -> None:
    decode = engines(model)
    decode.generate("warm", PROMPTS[3], NEW)  # 23 tokens: with full attention only, a shared prefix
    decode_all(decode, 1)
    assert not decode.batch.prefix_sharing  # transformers turns prefix sharing off while a ring exists
    longer = PROMPTS[3] + [1, 2, 3, 4, 5]
    reservation = decode.reserve("r0", longer)
    assert reservation is not None and reservation.held == 0
    spans = {g: (lease.tokens.start, lease.tokens.end) for g, lease in reservation.leases.items()}
    assert spans == {FULL: (0, 28), SLIDING: (0, WINDOW)}  # the ring whatever the full group holds
    for lease in reservation.leases.values():
        lease.release()
    decode.drop("r0")


def test_single_lease_calls_and_other_windows_are_refused_by_name(engines: Any, wire: Any, model: Any) -> None:
    prefill, decode = engines(model), engines(hybrid_model(window=12))
    prefill_all(prefill, [PROMPTS[2]])
    with pytest.raises(UnsupportedCache, match=r"layer groups \['full_attention', 'sliding_attention'\].*"
                                               r"lend_prefill_groups"):
        prefill.lend_prefill("r0")
    reservation = decode.reserve("r0", PROMPTS[2])
    assert reservation is not None
    with pytest.raises(UnsupportedCache, match=r"Reservation\.leases"):
        reservation.lease  # noqa: B018 - the property refuses
    # Another window: the sliding group's KV identity differs, and a backend refuses the hint.
    assert decode.groups[SLIDING].kv.layout != prefill.groups[SLIDING].kv.layout
    src, dst = connect(prefill, decode, wire)
    reads = prefill.lend_prefill_groups("r0")
    write = reservation.leases[SLIDING]
    with pytest.raises(InvalidSubmission, match="layout mismatch"):
        dst.fetch(write.view(), src.describe(reads[SLIDING].view(), dst.peer))
    for lease in (*reads.values(), *reservation.leases.values()):
        lease.release()


def test_block_counts_refuse_a_hybrid_cache_by_name_and_the_worker_counts_each_group(engines: Any, model: Any,
                                                                                      sliding_only: Any) -> None:
    """Its groups share the cache's sectors and transformers records no sector's owner: no
    group has a block total, so the worker's /metrics counts each group's reusable blocks (it
    serves the model: tests/unit/test_worker_transformers_hybrid.py)."""
    from kvxfer.modelfiles import TOY
    from kvxfer.worker.hf_engine import GroupLenders, TransformersServing

    with pytest.raises(UnsupportedCache, match=r"layer groups \['full_attention', 'sliding_attention'\] share"):
        engines(model).block_counts()
    counts = engines(sliding_only).block_counts()  # one group: every sector is its own
    assert counts["blocks"] > 0 and counts["free"] == counts["blocks"] and counts["cached"] == 0
    serving = TransformersServing(model, None, num_blocks=64, model_name=TOY, name="hybrid")  # type: ignore[arg-type]
    engine = serving.build()
    try:
        assert serving.hybrid and isinstance(serving.lender, GroupLenders)
        assert serving.lender.regions == engine.regions and serving.lender.open_leases == 0
        stats = serving.block_stats()
        assert list(stats) == [FULL, SLIDING]
        assert all(s["reusable"] == engine.batch.reusable_block_count(g) > 0 for g, s in stats.items())
    finally:
        assert not serving.lender.shutdown().retained_anything
        serving.shutdown()
