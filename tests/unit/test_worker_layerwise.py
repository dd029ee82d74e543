"""Layer-wise streaming (--layerwise): the prefill worker publishes each layer group as its
forward computes it, over real Worker objects behind real HTTP servers in this process,
moving KV with the loopback backend."""

from __future__ import annotations

import asyncio
import base64
import re
import time
from contextlib import AbstractAsyncContextManager
from typing import Any

import pytest
import torch

from kvxfer.contract import TransferMode
from kvxfer.engine import LlamaModel, ModelConfig, colocated_generate, layer_groups, synthetic_prompts
from kvxfer.router import Completion, Router
from kvxfer.testing.served import refuse_group, served_pair
from kvxfer.worker.core import Worker, WorkerConfig

torch.set_num_threads(1)
CFG = ModelConfig(vocab_size=128, hidden=64, layers=4, heads=4, kv_heads=2, head_dim=16, intermediate=96,
                  block_tokens=4)
MODEL = LlamaModel(CFG)


def pair(prefill: dict[str, Any], decode: dict[str, Any]) -> AbstractAsyncContextManager[tuple[str, str, dict[str, Worker]]]:
    return served_pair(prefill, decode, weights=MODEL, model=CFG, num_blocks=128, backend="loopback",
                       transfer_timeout_s=5.0)


@pytest.mark.parametrize(("groups", "mode"), [(1, TransferMode.PUSH), (2, TransferMode.PUSH), (4, TransferMode.PUSH),
                                             (3, TransferMode.PULL)])
def test_layerwise_pairs_are_token_identical_with_nothing_recomputed(groups: int, mode: TransferMode) -> None:
    prompts = synthetic_prompts(3, 3, 37, CFG.vocab_size, seed=7)
    ends = {"layerwise": groups, "mode": mode}

    async def main() -> None:
        async with pair(ends, ends) as (p_url, d_url, workers):
            seen: list[tuple[str, bool]] = []
            _shape_publishes(workers["prefill"], {}, seen)
            router = Router([p_url], [d_url])
            for prompt in prompts:
                done = await router.generate(prompt, 5)
                assert isinstance(done, Completion)
                assert done.ok, done.error
                assert list(done.tokens) == colocated_generate(MODEL, prompt, 5)
                assert done.recomputed_tokens == 0 and done.path == "disaggregated", done.events
                assert done.transfer is not None and done.transfer.status == "delivered"
            await router.close()
            assert workers["prefill"].health()["layerwise"] == groups
            names = [g.name for g in workers["prefill"].pool.groups]  # type: ignore[union-attr]
            # Every group but the last went out before the forward had computed the last one
            # (with one group: published after prefill, by /publish, as without streaming).
            assert seen == [(name, name == names[-1]) for name in names] * len(prompts)

    asyncio.run(main())


# --- workers called directly: which group lands when -------------------------------------------

def _shape_publishes(worker: Worker, per_group: dict[str, dict[str, Any]], seen: list[tuple[str, bool]]) -> None:
    """Fault injection on the prefill worker's (real) loopback backend: each group's publish
    gets its own delay and row budget; ``seen`` records, per publish, whether the forward
    had committed the request's last group yet (False: the group went out while later
    layers were still to compute)."""
    backend: Any = worker.backend
    pool: Any = worker.pool
    real = backend.publish
    last = pool.groups[-1].name

    def publish(view: Any, hint: Any, wake: Any = None) -> Any:
        group = view.groups[0].layer_group
        rid = view.request.split("/")[0]
        seen.append((group, bool(pool.filled(rid, last)[0] > 0)))
        backend.delay_s = per_group.get(group, {}).get("delay_s", 0.0)
        backend.fail_after_rows = per_group.get(group, {}).get("fail_after_rows")
        return real(view, hint, wake)

    backend.publish = publish


async def _prefill_streamed(workers: dict[str, Worker], rid: str, prompt: list[int], max_new: int
                            ) -> tuple[Any, int, dict[str, torch.Tensor]]:
    """Reserve on the decode worker, prefill with hint D (each group published as it is
    computed), publish: hint P, the first token and each group's rows at the prefill worker."""
    from kvxfer import wire
    from kvxfer.worker.calls import PrefillCall, PublishCall, ReserveCall

    prefill, decode = workers["prefill"], workers["decode"]
    assert prefill.backend is not None
    reserved = await decode.reserve(ReserveCall(rid, prompt, max_new, prefill.backend.peer))
    hint_d = wire.decode_hints(base64.b64decode(reserved["hint"]))
    answer = await prefill.prefill(PrefillCall(rid, prompt, decode_hint=hint_d))
    pool: Any = prefill.pool
    rows = {g.name: pool.storage(g.name)[torch.from_numpy(pool.block_table(rid, g.name).copy())].clone()
            for g in pool.groups}
    events = await prefill.publish(PublishCall(rid, hint_d))
    published = await events.__anext__()
    assert published["event"] == "published"
    asyncio.get_running_loop().create_task(_drain(events))
    return wire.decode_hints(base64.b64decode(published["hint"])), int(answer["token"]), rows


async def _drain(events: Any) -> None:
    async for _ in events:
        pass


def _landed(workers: dict[str, Worker], rid: str, group: str, rows: dict[str, torch.Tensor]) -> bool:
    """Whether the decode pool's rows of ``group`` hold the prefill worker's bytes."""
    d_pool: Any = workers["decode"].pool
    return bool(torch.equal(rows[group], d_pool.storage(group)[torch.from_numpy(d_pool.block_table(rid, group).copy())]))


def test_nothing_decodes_until_every_group_has_landed() -> None:
    from kvxfer.worker.calls import GenerateCall

    prompt = synthetic_prompts(1, 29, 29, CFG.vocab_size, seed=3)[0]
    rid = "partial"

    async def main() -> None:
        async with pair({"layerwise": 2}, {"layerwise": 2}) as (_, _, workers):
            seen: list[tuple[str, bool]] = []
            _shape_publishes(workers["prefill"], {"layers2-3": {"delay_s": 0.6}}, seen)
            hint_p, first, rows = await _prefill_streamed(workers, rid, prompt, 4)
            # The first group went out before the forward had computed the last one.
            assert seen == [("layers0-1", False), ("layers2-3", True)]
            events = await workers["decode"].generate(GenerateCall(rid, prefill_hint=hint_p, first_token=first))
            nxt = asyncio.ensure_future(events.__anext__())
            deadline = time.monotonic() + 5.0
            while not _landed(workers, rid, "layers0-1", rows):  # the first group lands...
                assert time.monotonic() < deadline, "the first layer group never landed"
                await asyncio.sleep(0.01)
            # ...and while the last has not, the decode worker has started nothing.
            assert not _landed(workers, rid, "layers2-3", rows)
            await asyncio.sleep(0.05)
            assert not nxt.done()
            resume = await nxt
            assert resume["event"] == "resume" and resume["position"] == len(prompt), resume
            assert _landed(workers, rid, "layers2-3", rows)
            tokens = [first] + [e["token"] async for e in events if e["event"] == "token"]
            assert tokens == colocated_generate(MODEL, prompt, 4)

    asyncio.run(main())


def test_a_later_group_failing_resumes_from_the_intersection_of_the_groups() -> None:
    from kvxfer.worker.calls import GenerateCall

    prompt = synthetic_prompts(1, 29, 29, CFG.vocab_size, seed=4)[0]  # 8 blocks of 4 tokens
    rid = "later-fails"

    async def main() -> None:
        async with pair({"layerwise": 2}, {"layerwise": 2}) as (_, _, workers):
            seen: list[tuple[str, bool]] = []
            # The first group arrives whole, the second only its first 3 rows (blocks).
            _shape_publishes(workers["prefill"], {"layers2-3": {"fail_after_rows": 3}}, seen)
            hint_p, first, _ = await _prefill_streamed(workers, rid, prompt, 4)
            events = await workers["decode"].generate(GenerateCall(rid, on_failure="recompute", prefill_hint=hint_p,
                                                                   first_token=first))
            resume = await events.__anext__()
            assert resume["event"] == "resume", resume
            assert resume["transfer"]["status"] == "failed" and "layers2-3" in resume["transfer"]["reason"]
            assert resume["transfer"]["rows_delivered"] == 8 + 3
            # The bound is the intersection over groups: 3 blocks, not the first group's 8.
            assert resume["position"] == 3 * CFG.block_tokens
            tokens = [e["token"] async for e in events if e["event"] == "token"]
            assert tokens == colocated_generate(MODEL, prompt, 4)

    asyncio.run(main())


# --- what is refused, by name ---------------------------------------------------------------------

@pytest.mark.parametrize(("groups", "named"), [(0, "positive number of layer groups, got 0"),
                                              (-2, "positive number of layer groups, got -2"),
                                              (5, "layerwise 5 is more layer groups than the model has layers (4)")])
def test_bad_group_counts_are_refused_by_name(groups: int, named: str) -> None:
    with pytest.raises(ValueError, match=re.escape(named)):
        WorkerConfig(role="prefill", model=CFG, layerwise=groups)
    with pytest.raises(ValueError, match=re.escape(named)):
        layer_groups(CFG.layers, groups)


def test_layerwise_refuses_what_it_cannot_stream() -> None:
    with pytest.raises(ValueError, match="--layerwise 2 with --lender staging is not supported"):
        WorkerConfig(role="prefill", model=CFG, layerwise=2, lender="staging")
    with pytest.raises(ValueError, match="--layerwise 2 with a TP group of engine KV .* is not supported"):
        WorkerConfig(role="decode", model=CFG, layerwise=2, tp=2, prefix_cache=False)
    # A KV store streams: its rows are named per layer group (test_worker_store.py moves them).
    assert WorkerConfig(role="prefill", model=CFG, layerwise=2, store="memory").store == "memory"


def test_groups_cut_the_layers_in_order_and_one_group_is_todays_pool() -> None:
    assert layer_groups(4, 1) == (("full", 0, 4),)
    assert layer_groups(7, 3) == (("layers0-2", 0, 3), ("layers3-4", 3, 2), ("layers5-6", 5, 2))
    assert CFG.make_pool(4).identity == CFG.make_pool(4, groups=1).identity
    assert CFG.make_pool(4, groups=2).identity != CFG.make_pool(4).identity


def test_ends_cut_differently_refuse_each_other_and_the_request_is_recomputed() -> None:
    prompt = synthetic_prompts(1, 21, 21, CFG.vocab_size, seed=9)[0]

    async def main() -> None:
        async with pair({"layerwise": 2}, {"layerwise": 4}) as (p_url, d_url, _):
            router = Router([p_url], [d_url], on_failure="recompute")
            done = await router.generate(prompt, 4)
            await router.close()
            assert done.ok, done.error
            assert list(done.tokens) == colocated_generate(MODEL, prompt, 4)
            assert done.path == "local" and any("--layerwise" in e for e in done.events), done.events

    asyncio.run(main())


@pytest.mark.parametrize(("flags", "words"), [
    (["--layerwise", "0"], "--layerwise must be a positive number of layer groups, got 0"),
    (["--layerwise", "-3"], "--layerwise must be a positive number of layer groups, got -3"),
    (["--layerwise", "5"], "--layerwise 5 is more layer groups than the model has layers (4)"),
    (["--layerwise", "2", "--lender", "staging"], "--layerwise 2 with --lender staging is not supported"),
    (["--layerwise", "2", "--tp", "2", "--no-prefix-cache"], "--layerwise 2 with a TP group of engine KV (--engine-kv"),
    (["--layerwise", "2", "--kv-layout", "layer_major", "--no-prefix-cache"],
     "is not supported: a TP group moves a request as one transfer per rank pair"),
])
def test_serve_refuses_bad_layerwise_by_name(flags: list[str], words: str, capsys: pytest.CaptureFixture[str]) -> None:
    from kvxfer.worker import serve

    with pytest.raises(SystemExit) as exc:
        serve.main(["--role", "prefill", *flags])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and words in err and "Traceback" not in err, err


def test_a_group_refused_after_another_went_out_is_not_taken_as_nothing_escaped() -> None:
    """The second group's publish is refused after the first was submitted: /publish fails
    as one whose hints D may be in use (500, not a 409 refusal), the router asks the prefill
    worker to take them back before the decode worker reuses the rows, and the request is
    recomputed at the decode worker, token-identical."""
    prompt = synthetic_prompts(1, 25, 25, CFG.vocab_size, seed=12)[0]

    async def main() -> None:
        async with pair({"layerwise": 2}, {"layerwise": 2}) as (p_url, d_url, workers):
            refuse_group(workers["prefill"], "layers2-3", "injected: the second group is refused")
            router = Router([p_url], [d_url], on_failure="recompute")
            done = await router.generate(prompt, 4)
            await router.close()
            assert done.ok, done.error
            assert list(done.tokens) == colocated_generate(MODEL, prompt, 4)
            assert done.path == "local"
            assert any("HTTP 500" in e and "failed after 1 went out" in e for e in done.events), done.events

    asyncio.run(main())
