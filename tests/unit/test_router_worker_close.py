"""A worker closed while streams run: nothing touches its pool after the forced shutdown."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch

from kvxfer.backends.loopback import LoopbackFabric
from kvxfer.engine import LlamaModel, ModelConfig
from kvxfer.worker.calls import GenerateCall
from kvxfer.worker.core import Worker, WorkerConfig

torch.set_num_threads(1)
CFG = ModelConfig(vocab_size=128, hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, intermediate=96,
                  block_tokens=4)


def test_no_decode_step_runs_after_the_lender_was_shut_down() -> None:
    """Decode steps queued behind the teardown used to run after ``lender.shutdown(force=True)``,
    writing K/V into blocks the shutdown may have retained for a peer."""
    async def main() -> list[str]:
        model = LlamaModel(CFG)
        worker = Worker(WorkerConfig(role="decode", model=CFG, num_blocks=256, backend="loopback"),
                        model=model, fabric=LoopbackFabric())
        await worker.start()
        order: list[str] = []
        assert worker.lender is not None
        shutdown, step = worker.lender.shutdown, model.next_pick

        def record_shutdown(*args: Any, **kwargs: Any) -> Any:
            order.append("shutdown")
            return shutdown(*args, **kwargs)

        def record_step(*args: Any, **kwargs: Any) -> Any:
            order.append("step")
            return step(*args, **kwargs)

        worker.lender.shutdown = record_shutdown  # type: ignore[method-assign]
        model.next_pick = record_step  # type: ignore[method-assign]
        streams = [await worker.generate(GenerateCall(f"r{i}", prompt=list(range(1, 20)), max_new_tokens=100))
                   for i in range(2)]
        started = asyncio.Event()

        async def consume(events: Any) -> None:
            with pytest.raises(RuntimeError, match="shut down|after shutdown"):
                async for event in events:
                    if event.get("index") == 3:
                        started.set()
                    assert event["event"] != "done", "the stream finished before the close"

        tasks = [asyncio.create_task(consume(s)) for s in streams]
        await started.wait()
        report = await worker.close()
        await asyncio.gather(*tasks)
        assert report == {"unquiesced_attempts": 0, "retained_blocks": 0}
        return order

    order = asyncio.run(main())
    assert "shutdown" in order
    assert "step" not in order[order.index("shutdown"):], order[-5:]


def test_a_publish_that_raises_keeps_its_rows_out_of_reuse() -> None:
    """Backend rule 3: a raise other than InvalidSubmission/SubmissionRejected means access may
    have escaped. The read lease used to be released and the blocks freed for reuse."""
    from test_router import backend, cluster  # noqa: I001 - pytest puts tests/unit on sys.path

    from kvxfer.serving.http import HttpError, request_json, request_text

    async def main() -> str:
        async with cluster(1, 1) as c:
            p, d = c.prefill[0], c.decode[0]
            prompt = list(range(1, 11))  # 10 tokens: 3 blocks of 4

            def broken(*args: Any, **kwargs: Any) -> Any:
                raise OSError("transport fell over mid-post")

            backend(c.workers[p]).publish = broken  # type: ignore[method-assign]
            publisher = (await request_json(p, "GET", "/health"))["publisher"]
            hint = (await request_json(d, "POST", "/reserve", {"request": "a", "prompt": prompt,
                                                              "max_new_tokens": 2, "publisher": publisher}))["hint"]
            await request_json(p, "POST", "/prefill", {"request": "a", "prompt": prompt})
            with pytest.raises(HttpError) as info:
                await request_json(p, "POST", "/publish", {"request": "a", "hint": hint})
            assert info.value.status == 500 and "transport fell over" in str(info.value)
            await request_json(d, "POST", "/abort", {"request": "a", "rows_safe": True})
            return await request_text(p, "/metrics")

    text = asyncio.run(main())
    assert "kvxfer_open_leases 1.0\n" in text and "kvxfer_quarantined_slots 3.0\n" in text
    assert 'kvxfer_pool_blocks{group="full",state="pinned"} 3.0\n' in text
