"""Layer-wise streaming with transformers' continuous batching (``--engine transformers
--layerwise GROUPS``): the cache's layers are cut into groups, each lent and moved by a lease,
view and hint of its own, and the prefill worker publishes each group from a hook on the
model's decoder layers, inside the step that ends the prompt, before the later layers have
run. Requests are token-identical to transformers' own ``generate_batch``; the decode worker
decodes nothing before every group has landed; what cannot stream is refused by name. Real
workers behind real HTTP servers in this process, the loopback backend, the tiny seeded
3-layer Llama (``tiny_hf_llama``)."""

from __future__ import annotations

import asyncio
import base64
import re
import threading
import time
from typing import Any

import pytest
import torch

from kvxfer.adapters.errors import UnsupportedCache
from kvxfer.adapters.transformers import TransformersEngine
from kvxfer.adapters.transformers import _internals as hf
from kvxfer.contract import TransferMode
from kvxfer.engine import ModelConfig
from kvxfer.router import Router
from kvxfer.testing.served import refuse_group, served_workers
from kvxfer.worker.core import Worker, WorkerConfig
from kvxfer.worker.hf_engine import MAX_BATCH_TOKENS, PAGE_SIZE, seeded_model

torch.set_num_threads(1)
SHAPE = ModelConfig(vocab_size=128, hidden=64, layers=3, heads=4, kv_heads=2, head_dim=16, intermediate=128,
                    max_positions=256)  # tiny_hf_llama's
BLOCKS = 64
NEW = 5
# Under one block, across blocks, several blocks.
PROMPTS = [[5, 9, 17, 3, 8, 44, 21, 7, 60, 2, 13], list(range(20, 58)), [3] * 33, [11, 12]]


@pytest.fixture(scope="module")
def model(tiny_hf_llama: Any) -> Any:
    return tiny_hf_llama


@pytest.fixture(scope="module")
def oracle(model: Any) -> list[list[int]]:
    return hf.colocated(model, PROMPTS, NEW, hf.batching_config(PAGE_SIZE, BLOCKS, MAX_BATCH_TOKENS))


def served(model: Any, groups: int, mode: TransferMode = TransferMode.PUSH, decode_groups: int | None = None) -> Any:
    cut = {"prefill": groups, "decode": groups if decode_groups is None else decode_groups}
    return served_workers({role: (WorkerConfig(role=role, model=SHAPE, num_blocks=BLOCKS, backend="loopback",
                                               mode=mode, name=role, transfer_timeout_s=10.0, engine="transformers",
                                               layerwise=cut[role]), model)
                           for role in ("prefill", "decode")})


def watch_publishes(worker: Worker, seen: list[tuple[str, int]], delays: dict[str, float] | None = None) -> None:
    """Wrap the prefill worker's (real) loopback backend: record each group's publish with how
    many of the model's decoder layers had begun in the current forward on the publishing
    thread (counted by pre-hooks of the test's own: both workers share the model), and give a
    group's publish a delay."""
    backend: Any = worker.backend
    real = backend.publish
    began: dict[int, int] = {}
    layers = worker._hf.engine.model.get_decoder().layers  # type: ignore[attr-defined]

    def counter(index: int) -> Any:
        def begin(*_: Any) -> None:
            began[threading.get_ident()] = index + 1
        return begin

    handles = [layer.register_forward_pre_hook(counter(i)) for i, layer in enumerate(layers)]
    worker._test_handles = handles  # type: ignore[attr-defined]

    def publish(view: Any, hint: Any, wake: Any = None) -> Any:
        group = view.groups[0].layer_group
        seen.append((group, began[threading.get_ident()]))
        backend.delay_s = (delays or {}).get(group, 0.0)
        return real(view, hint, wake)

    backend.publish = publish


def unwatch(worker: Worker) -> None:
    for handle in worker._test_handles:  # type: ignore[attr-defined]
        handle.remove()


@pytest.mark.parametrize(("groups", "mode"), [(3, TransferMode.PUSH), (2, TransferMode.PULL)], ids=["push3", "pull2"])
def test_layerwise_requests_are_token_identical_and_each_group_goes_out_as_its_layers_ran(
        model: Any, oracle: list[list[int]], groups: int, mode: TransferMode) -> None:
    names = {3: ["layers0-0", "layers1-1", "layers2-2"], 2: ["layers0-1", "layers2-2"]}[groups]
    last = {"layers0-0": 1, "layers1-1": 2, "layers2-2": 3, "layers0-1": 2}

    async def main() -> None:
        async with served(model, groups, mode) as (urls, workers):
            assert list(workers["prefill"]._hf.engine.groups) == names  # type: ignore[attr-defined]
            seen: list[tuple[str, int]] = []
            watch_publishes(workers["prefill"], seen)
            try:
                async with Router([urls["prefill"]], [urls["decode"]]) as router:
                    for prompt, want in zip(PROMPTS, oracle):
                        done = await router.generate(prompt, NEW)
                        assert done.ok, done.error
                        assert list(done.tokens) == want
                        assert done.path == "disaggregated" and done.recomputed_tokens == 0, done.events
                        transfer = done.transfer
                        assert transfer is not None and transfer.status == "delivered"
                        # Each group moves every block of the prompt, of its own layers.
                        assert transfer.rows == transfer.rows_delivered == groups * -(-len(prompt) // PAGE_SIZE)
                # Each group was published once the forward had run its layers and before it
                # began a later one: it goes out while the later layers are still to compute.
                assert seen == [(name, last[name]) for name in names] * len(PROMPTS)
            finally:
                unwatch(workers["prefill"])
            health = workers["prefill"].health()
            assert health["layerwise"] == groups

    asyncio.run(main())


def test_concurrent_streamed_prefills_share_steps_and_stay_token_identical(model: Any,
                                                                          oracle: list[list[int]]) -> None:
    async def main() -> None:
        async with served(model, 3) as (urls, _):
            async with Router([urls["prefill"]], [urls["decode"]]) as router:
                done = await asyncio.gather(*(router.generate(p, NEW) for p in PROMPTS))
        for completion, want in zip(done, oracle):
            assert completion.ok, completion.error
            assert list(completion.tokens) == want
            assert completion.path == "disaggregated" and completion.recomputed_tokens == 0

    asyncio.run(main())


# --- the decode worker starts only once every group has landed -------------------------------

async def _prefill_streamed(workers: dict[str, Worker], rid: str, prompt: list[int], max_new: int
                            ) -> tuple[Any, int, dict[str, torch.Tensor]]:
    """Reserve on the decode worker, prefill with hint D (each group published from the
    forward), publish: hint P, the first token and each group's K/V planes at the prefill
    worker, over the prompt's blocks."""
    from kvxfer import wire
    from kvxfer.worker.calls import PrefillCall, PublishCall, ReserveCall

    prefill, decode = workers["prefill"], workers["decode"]
    assert prefill.backend is not None
    reserved = await decode.reserve(ReserveCall(rid, prompt, max_new, prefill.backend.peer))
    hint_d = wire.decode_hints(base64.b64decode(reserved["hint"]))
    answer = await prefill.prefill(PrefillCall(rid, prompt, decode_hint=hint_d))
    engine: Any = prefill._hf.engine  # type: ignore[attr-defined]
    table = engine.prefilled[rid].tables[hf.FULL]
    rows = await prefill._engine.run(_group_rows, engine, table)
    events = await prefill.publish(PublishCall(rid, hint_d))
    published = await events.__anext__()
    assert published["event"] == "published"
    asyncio.get_running_loop().create_task(_drain(events))
    return wire.decode_hints(base64.b64decode(published["hint"])), int(answer["token"]), rows


def _group_rows(engine: Any, table: Any) -> dict[str, torch.Tensor]:
    """Each layer group's K and V planes over the blocks of ``table`` (a copy)."""
    index = torch.from_numpy(table.copy())
    layout = engine.batch.layouts()[hf.FULL]
    out = {}
    for name in engine.groups:
        first, last = (int(x) for x in name.removeprefix("layers").split("-"))
        out[name] = torch.stack([layout.plane(i, value)[index] for i in range(first, last + 1)
                                 for value in (False, True)]).clone()
    return out


async def _drain(events: Any) -> None:
    async for _ in events:
        pass


async def _landed(workers: dict[str, Worker], rid: str, group: str, rows: dict[str, torch.Tensor]) -> bool:
    """Whether the decode cache's blocks of ``group`` hold the prefill worker's bytes."""
    decode = workers["decode"]
    engine: Any = decode._hf.engine  # type: ignore[attr-defined]
    reservation = engine.reservation(rid)
    if reservation is None:
        return False
    there = await decode._engine.run(_group_rows, engine, reservation.tables[hf.FULL])
    return bool(torch.equal(there[group], rows[group]))


def test_nothing_decodes_until_every_group_has_landed(model: Any) -> None:
    from kvxfer.worker.calls import GenerateCall

    prompt = PROMPTS[1]  # 38 tokens: 3 blocks
    rid = "partial"
    want = hf.colocated(model, [prompt], 4, hf.batching_config(PAGE_SIZE, BLOCKS, MAX_BATCH_TOKENS))[0]

    async def main() -> None:
        async with served(model, 2) as (_, workers):
            seen: list[tuple[str, int]] = []
            watch_publishes(workers["prefill"], seen, delays={"layers2-2": 0.6})
            try:
                hint_p, first, rows = await _prefill_streamed(workers, rid, prompt, 4)
            finally:
                unwatch(workers["prefill"])
            # The first group went out when only its two layers had run.
            assert seen == [("layers0-1", 2), ("layers2-2", 3)]
            events = await workers["decode"].generate(GenerateCall(rid, prefill_hint=hint_p, first_token=first))
            nxt = asyncio.ensure_future(events.__anext__())
            deadline = time.monotonic() + 5.0
            while not await _landed(workers, rid, "layers0-1", rows):  # the first group lands...
                assert time.monotonic() < deadline, "the first layer group never landed"
                await asyncio.sleep(0.01)
            # ...and while the last has not, the decode worker has started nothing.
            assert not await _landed(workers, rid, "layers2-2", rows)
            await asyncio.sleep(0.05)
            assert not nxt.done()
            resume = await nxt
            assert resume["event"] == "resume" and resume["position"] == len(prompt), resume
            tokens = [first] + [e["token"] async for e in events if e["event"] == "token"]
            assert tokens == want

    asyncio.run(main())


def test_a_group_refused_after_another_went_out_is_recomputed_and_every_block_comes_back(
        model: Any, oracle: list[list[int]]) -> None:
    """The last group's publish is refused after the first went out: /publish fails as one
    whose hints D may be in use (500, not a 409), the router recomputes the request at the
    decode worker, token-identical, and both workers end with no lease, attempt or block
    held (``served_workers`` checks the close report; the caches come back whole)."""
    async def main() -> None:
        async with served(model, 2) as (urls, workers):
            refuse_group(workers["prefill"], "layers2-2", "injected: the last group is refused")
            async with Router([urls["prefill"]], [urls["decode"]], on_failure="recompute") as router:
                done = await router.generate(PROMPTS[1], NEW)
            assert done.ok, done.error
            assert list(done.tokens) == oracle[1]
            assert done.path == "local"
            assert any("HTTP 500" in e and "failed after 1 went out" in e for e in done.events), done.events
            for worker in workers.values():
                engine: Any = worker._hf.engine  # type: ignore[attr-defined]
                for _ in range(500):  # the cancelled group's blocks come back once it quiesced
                    await worker.metrics_text()  # a reclaim pass on the engine thread
                    counts = await worker._engine.run(engine.block_counts)
                    if counts["free"] + counts["cached"] == counts["blocks"] and worker.lender.open_leases == 0:
                        break
                    await asyncio.sleep(0.01)
                assert counts["free"] + counts["cached"] == counts["blocks"], counts
                assert not engine._streamed

    asyncio.run(main())


# --- what is refused, by name --------------------------------------------------------------------

def test_ends_cut_differently_refuse_each_other_naming_the_groups(model: Any) -> None:
    async def main() -> None:
        async with served(model, 3, decode_groups=2) as (urls, _):
            async with Router([urls["prefill"]], [urls["decode"]], on_failure="fail") as router:
                done = await router.generate(PROMPTS[0], NEW)
        assert not done.ok and done.error is not None
        assert "--layerwise" in done.error and "layers0-1" in done.error, done.error

    asyncio.run(main())


def test_the_transformers_engine_is_no_longer_refused_and_what_cannot_stream_is() -> None:
    WorkerConfig(role="prefill", model=SHAPE, engine="transformers", layerwise=3)  # streams now
    with pytest.raises(ValueError, match="layerwise 4 is more layer groups than the model has layers \\(3\\)"):
        WorkerConfig(role="prefill", model=SHAPE, engine="transformers", layerwise=4)
    with pytest.raises(ValueError, match="--lender staging"):
        WorkerConfig(role="prefill", model=SHAPE, engine="transformers", layerwise=2, lender="staging")


def test_a_hybrid_cache_is_refused_by_name_when_cut() -> None:
    hybrid = seeded_model(SHAPE, "cpu", sliding_window=20)
    with pytest.raises(UnsupportedCache, match=re.escape("full-attention layers only; this model's cache has "
                                                         "['full_attention', 'sliding_attention'] layers")):
        TransformersEngine(hybrid, page_size=PAGE_SIZE, num_blocks=16, layer_groups=2)


@pytest.mark.parametrize(("flags", "words"), [
    (["--layerwise", "2", "--sliding-window", "20", "--head-dim", "32", "--hidden", "128", "--heads", "4"],
     "--layerwise 2 with --sliding-window: layer-wise streaming cuts a cache of full-attention layers only"),
    (["--layers", "3", "--layerwise", "4"], "--layerwise 4 is more layer groups than the model has layers (3)"),
])
def test_serve_refuses_what_transformers_cannot_stream_by_name(flags: list[str], words: str,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    from kvxfer.worker import serve

    with pytest.raises(SystemExit) as exc:
        serve.main(["--role", "prefill", "--engine", "transformers", *flags])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and words in err and "Traceback" not in err, err


def test_a_prompt_prefilled_in_chunks_is_ready_only_in_its_last_step_with_every_block(model: Any) -> None:
    """A 40-token prompt in 16-token steps: no group is ready in the first two steps (their
    chunks leave the prompt's end uncomputed); in the third each group is ready in the model's
    order, and its lease, lent then, covers every token of the prompt over all its blocks."""
    engine = TransformersEngine(model, page_size=PAGE_SIZE, num_blocks=16, max_batch_tokens=16, layer_groups=3)
    prompt = [(7 * i + 3) % SHAPE.vocab_size for i in range(40)]
    steps = {"n": 0}
    ready: list[tuple[str, int, Any]] = []
    try:
        engine.prefill("r", prompt, ready=lambda group: ready.append((group, steps["n"],
                                                                      engine.lend_streamed("r", group))))
        while "r" not in engine.prefilled:
            assert engine.step()
            steps["n"] += 1
        assert [(group, step) for group, step, _ in ready] == [("layers0-0", 2), ("layers1-1", 2), ("layers2-2", 2)]
        table = engine.prefilled["r"].tables[hf.FULL]
        for group, _, lease in ready:
            view = lease.view()
            assert view.request == f"r/{group}" and (view.tokens.start, view.tokens.end) == (0, 40)
            assert view.groups[0].layer_group == group and view.geometry.layers == 1
            assert len(view.groups[0]) == len(table) == 3
            lease.release()
        engine.finish_prefill("r")
        counts = engine.block_counts()  # the forward's pins and the prefill's went back (whole blocks: cached)
        assert counts["free"] + counts["cached"] == counts["blocks"] and counts["cached"] == 2, counts
    finally:
        engine.shutdown()
