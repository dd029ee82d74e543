"""The transformers adapter on a tiny random Llama (no GGUF, so it is fast): the EngineKV
geometry of transformers' cache tensor puts every byte where transformers itself reads it,
prefill's blocks stay out of reuse until their lease and attempts end, a decode engine adopts
requests whose KV came over a (loopback) transfer and decodes them beside its own, token for
token as transformers' colocated ``generate_batch``; a prefix it holds is not fetched again, a
partial arrival resumes from the first gap; what cannot work is refused by name."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

from kvxfer.adapters.errors import AdapterError, EngineMismatch, EngineVersionError
from kvxfer.adapters.transformers import ENGINE, TransformersEngine, check_peer_engine
from kvxfer.adapters.transformers import _internals as hf
from kvxfer.contract import Cancelled, Delivered, Failed, InvalidSubmission, TransferMode
from kvxfer.lender.engine_kv import EngineKV
from kvxfer.lender.external import ExternalLender
from kvxfer.pool import LayerGroupSpec, PagedKVPool
from kvxfer.testing.nixl_geometry import kv_tokens, local_bytes
from kvxfer.testing.transformers_moves import decode_all, move, prefill_all

torch.set_num_threads(1)
PAGE = 4
NEW = 6
PROMPTS = [[5, 9, 17, 3, 8, 44, 21, 7, 60, 2, 13], [7, 7, 1], [90, 3, 55, 12, 8, 8, 31, 6],
           [5, 9, 17, 3, 8, 44, 21, 7, 11, 19, 23, 29, 31, 37], [100, 101, 102, 103, 104]]


@pytest.fixture(scope="module")
def model(tiny_hf_llama: Any) -> Any:
    return tiny_hf_llama


@pytest.fixture(scope="module")
def oracle(model: Any) -> list[list[int]]:
    return hf.colocated(model, PROMPTS, NEW, hf.batching_config(PAGE, 64, 64))


@pytest.fixture
def engines(model: Any) -> Iterator[Any]:
    made: list[TransformersEngine] = []

    def make(**options: Any) -> TransformersEngine:
        engine = TransformersEngine(model, page_size=PAGE, num_blocks=64, max_batch_tokens=64,
                                    name=f"tf{len(made)}", **options)
        made.append(engine)
        return engine

    yield make
    for engine in made:
        engine.lender.shutdown(force=True)
        engine.batch.close()


def test_the_geometry_reads_each_byte_where_transformers_reads_it(engines: Any, model: Any) -> None:
    engine = engines()
    prefill_all(engine, PROMPTS[:2])
    geometry = engine.kv.geometry
    assert (geometry.layers, geometry.kv_heads, geometry.head_dim, geometry.block_tokens) == (3, 2, 16, PAGE)
    assert geometry.regions[0].address == engine.batch.cache.cache_tensor.data_ptr()  # no copy, no pool
    memory = local_bytes(engine.kv)
    for request, prompt in (("r0", PROMPTS[0]), ("r1", PROMPTS[1])):
        done = engine.prefilled[request]
        got = kv_tokens(geometry, memory, done.blocks, len(prompt))  # [2 * layers, tokens, heads, bytes]
        reads = torch.tensor(engine.batch.read_rows(done.blocks.tolist(), len(prompt)))
        with torch.no_grad():
            plain = model(torch.tensor([prompt]), use_cache=True).past_key_values
        for layer in range(3):
            k_view, v_view = engine.batch.token_views(layer)  # what transformers' attention reads
            for plane, view in ((2 * layer, k_view), (2 * layer + 1, v_view)):
                theirs = view.index_select(0, reads).contiguous().view(torch.uint8).numpy()
                assert np.array_equal(got[plane].reshape(theirs.shape), theirs), f"layer {layer} plane {plane}"
            ours_k = torch.from_numpy(got[2 * layer].copy()).view(torch.float32)  # [tokens, heads, head_dim]
            ref_k = plain.layers[layer].keys[0].transpose(0, 1)
            assert torch.allclose(ours_k, ref_k, atol=1e-5), "K differs from a plain forward's"


def test_prefill_blocks_stay_out_of_reuse_until_the_lease_and_its_attempts_end(engines: Any) -> None:
    engine = engines()
    prefill_all(engine, PROMPTS[:1])
    blocks = engine.prefilled["r0"].blocks
    free_before = engine.batch.reusable_block_count()
    lease = engine.lend_prefill("r0")
    engine.finish_prefill("r0")
    engine.step()
    assert engine.batch.reusable_block_count() == free_before, "a lent block went back to transformers' pool"
    assert engine.lender.busy(blocks).all()
    lease.release()
    engine.step()
    assert engine.batch.reusable_block_count() == free_before + len(blocks)
    with pytest.raises(AdapterError, match="has not been prefilled"):
        engine.lend_prefill("r0")


@pytest.mark.parametrize("mode", [TransferMode.PUSH, TransferMode.PULL], ids=["push", "pull"])
def test_decode_adopts_transferred_requests_token_identical_beside_its_own(
        engines: Any, wire: Any, oracle: list[list[int]], mode: TransferMode) -> None:
    prefill, decode = engines(), engines()
    wire = wire(mode)
    wire[0].register(prefill.regions)
    wire[1].register(decode.regions)
    firsts = prefill_all(prefill, PROMPTS[1:])
    decode.generate("c", PROMPTS[0], NEW)  # colocated, in the same batch as the adopted ones
    for i, prompt in enumerate(PROMPTS[1:]):
        request = f"r{i}"
        reservation = decode.reserve(request, prompt)
        assert reservation is not None and reservation.lease is not None
        with pytest.raises(AdapterError, match="release its lease"):
            decode.adopt(request, firsts[request], NEW)
        outcome = move(wire, prefill.lend_prefill(request), reservation.lease)
        assert isinstance(outcome, Delivered) and outcome.all_delivered
        prefill.finish_prefill(request)
        assert decode.adopt(request, firsts[request], NEW) == len(prompt)
        decode.step()
    got = decode_all(decode, len(PROMPTS))
    assert [got["c"], *(got[f"r{i}"] for i in range(len(PROMPTS) - 1))] == oracle
    assert prefill.idle() and decode.idle()


def test_a_prefix_the_decode_engine_holds_is_not_fetched_again(engines: Any, wire: Any, oracle: list[list[int]]) -> None:
    prefill, decode = engines(), engines()
    wire = wire()
    wire[0].register(prefill.regions)
    wire[1].register(decode.regions)
    decode.generate("warm", PROMPTS[0], NEW)  # 11 tokens: its first two blocks become a shared prefix
    decode_all(decode, 1)
    firsts = prefill_all(prefill, [PROMPTS[3]])  # shares 8 tokens with PROMPTS[0]
    reservation = decode.reserve("r0", PROMPTS[3])
    assert reservation is not None and reservation.held == 8 and reservation.lease is not None
    view = reservation.lease.view()
    assert (view.tokens.start, view.tokens.end) == (8, 14) and view.groups[0].ordinals.tolist() == [2, 3]
    move(wire, prefill.lend_prefill("r0"), reservation.lease)
    decode.adopt("r0", firsts["r0"], NEW)
    assert decode_all(decode, 1)["r0"] == oracle[3]


def test_a_partial_arrival_resumes_from_the_first_gap(engines: Any, wire: Any, oracle: list[list[int]]) -> None:
    prefill, decode = engines(), engines()
    wire = wire(fail_after_rows=1)  # one 4-token run of the 14-token prompt arrives
    wire[0].register(prefill.regions)
    wire[1].register(decode.regions)
    firsts = prefill_all(prefill, [PROMPTS[3]])
    reservation = decode.reserve("r0", PROMPTS[3])
    assert reservation is not None and reservation.lease is not None
    outcome = move(wire, prefill.lend_prefill("r0"), reservation.lease)
    assert isinstance(outcome, Failed) and outcome.masks[0].tolist() == [True, False, False, False]
    assert decode.adopt("r0", firsts["r0"], NEW) == PAGE  # the rest of the prompt is prefilled again here
    assert decode_all(decode, 1)["r0"] == oracle[3]


def test_a_prompt_longer_than_a_batch_is_prefilled_in_chunks_and_moved_whole(engines: Any, wire: Any,
                                                                            model: Any) -> None:
    prompt = [(7 * i + 3) % 128 for i in range(150)]  # 150 tokens: three steps of 64
    want = hf.colocated(model, [prompt], NEW, hf.batching_config(PAGE, 64, 64))[0]
    prefill, decode = engines(), engines()
    src, dst = wire()
    src.register(prefill.regions)
    dst.register(decode.regions)
    prefill.prefill("long", prompt)
    steps = 0
    while "long" not in prefill.prefilled:
        prefill.step()
        steps += 1
    assert steps == 3
    reservation = decode.reserve("long", prompt)
    assert reservation is not None and reservation.lease is not None
    outcome = move((src, dst), prefill.lend_prefill("long"), reservation.lease)
    assert isinstance(outcome, Delivered) and outcome.masks[0].size == 38
    assert decode.adopt("long", prefill.prefilled["long"].first, NEW) == 150
    assert decode_all(decode, 1)["long"] == want


def test_a_cancelled_transfer_leaves_both_caches_consistent(engines: Any, wire: Any, oracle: list[list[int]]) -> None:
    prefill, decode = engines(), engines()
    src, dst = wire(delay_s=30.0)  # the publisher's submission waits: the cancel comes before a byte moves
    src.register(prefill.regions)
    dst.register(decode.regions)
    firsts = prefill_all(prefill, [PROMPTS[0]])
    pinned = prefill.batch.reusable_block_count()
    reservation = decode.reserve("r0", PROMPTS[0])
    assert reservation is not None and reservation.lease is not None
    read, write = prefill.lend_prefill("r0"), reservation.lease
    hint_d, hint_p = dst.describe(write.view(), src.peer), src.describe(read.view(), dst.peer)
    fetch, publish = dst.fetch(write.view(), hint_p), src.publish(read.view(), hint_d)
    read.track(publish)
    write.track(fetch)
    read.release()
    prefill.finish_prefill("r0")
    prefill.step()
    assert prefill.batch.reusable_block_count() == pinned, "blocks went back while a publish may read them"
    fetch.cancel()
    assert fetch.wait(10) and publish.wait(10)
    assert isinstance(fetch.poll(), Cancelled) and isinstance(publish.poll(), Cancelled)
    write.mark_arrived(fetch.poll().masks)
    write.release()
    prefill.step()
    assert prefill.batch.reusable_block_count() == pinned + 3 and prefill.idle()
    assert decode.adopt("r0", firsts["r0"], NEW) == 0  # nothing arrived: the prompt is prefilled again here
    assert decode_all(decode, 1)["r0"] == oracle[0]


def test_a_dropped_reservation_goes_back_only_once_quiesced(engines: Any) -> None:
    decode = engines()
    free_before = decode.batch.reusable_block_count()
    reservation = decode.reserve("d", PROMPTS[0])
    assert reservation is not None and reservation.lease is not None
    decode.drop("d")
    assert decode.batch.reusable_block_count() == free_before - 3, "blocks a lease may write went back"
    reservation.lease.release()
    decode.step()
    assert decode.batch.reusable_block_count() == free_before
    with pytest.raises(AdapterError, match="no reservation"):
        decode.adopt("d", 1, NEW)


def test_a_first_token_that_ends_the_request_ends_it_at_once(engines: Any) -> None:
    decode = engines()
    reservation = decode.reserve("d", PROMPTS[1])
    assert reservation is not None and reservation.lease is not None
    reservation.lease.mark_arrived([np.ones(1, dtype=bool)])
    reservation.lease.release()
    decode.adopt("d", 42, 1)
    assert decode.results() == {"d": [42]}


def test_another_transformers_version_is_refused_by_name() -> None:
    assert hf.check_version() == "5.24.0" and ENGINE == "transformers 5.24.0"
    with pytest.raises(EngineVersionError, match=r"transformers 5\.17\.0 is installed.*transformers 5\.24\.0 only"):
        hf.check_version("5.17.0")


def test_mixed_engines_are_refused_by_name(engines: Any, wire: Any) -> None:
    with pytest.raises(EngineMismatch, match="mixed engines: this end runs 'transformers 5.24.0', the peer 'kvxfer'"):
        check_peer_engine(ENGINE, "kvxfer")
    check_peer_engine(ENGINE, "transformers 5.24.0")
    wire = wire()
    # The same model's KV shape in kvxfer's own pool: the KV identity names another engine.
    decode = engines()
    pool = PagedKVPool([LayerGroupSpec("full", layers=3, block_tokens=PAGE, kv_heads=2, head_dim=16,
                                       dtype=torch.float32)], 16, scope=b"kvxfer-reference")
    pool.allocate("r", len(PROMPTS[1]))
    pool.commit("r", len(PROMPTS[1]))
    theirs = EngineKV.from_pool(pool)
    assert theirs.layout != decode.kv.layout
    wire[0].register(theirs.regions)
    wire[1].register(decode.regions)
    read = ExternalLender(theirs).lend_read("r", pool.block_table("r", "full"), (0, len(PROMPTS[1])))
    reservation = decode.reserve("r", PROMPTS[1])
    assert reservation is not None and reservation.lease is not None
    with pytest.raises(InvalidSubmission, match="layout mismatch"):
        wire[1].fetch(reservation.lease.view(), wire[0].describe(read.view(), wire[1].peer))
    read.release()
    reservation.lease.release()
