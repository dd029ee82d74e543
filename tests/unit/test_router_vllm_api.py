"""What an OpenAI or vLLM client, and an operator, expect of the router beyond completions:
the model object (``GET /v1/models/{id}``, with vLLM's ``max_model_len``), through the
official ``openai`` client against a real router over toy workers in this process; each
refusal's reason in the access log."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator

import aiohttp
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from test_router import CFG, backend, cluster  # noqa: I001 - pytest puts tests/unit on sys.path

import kvxfer
from kvxfer.router import Router
from kvxfer.router.app import make_handler
from kvxfer.router.frontend import OpenAIFrontend
from kvxfer.serving.http import HttpServer, request_text
from kvxfer.serving.keys import BearerKey

ACCESS = "kvxfer.router.access"  # the logger kvxfer router gives its server


@contextlib.asynccontextmanager
async def toy_router(api_key: BearerKey | None = None) -> AsyncIterator[tuple[str, Router, openai.AsyncOpenAI]]:
    async with cluster() as c, Router(c.prefill, c.decode) as router:
        server = HttpServer(make_handler(router, api_key=api_key), access_log=ACCESS)
        url = f"http://127.0.0.1:{await server.start()}"
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=api_key.secret if api_key else "unused",
                                    max_retries=0)
        try:
            yield url, router, client
        finally:
            await client.close()
            await server.close()


def test_models_list_and_retrieve_give_vllms_model_object_and_404_names_the_id() -> None:
    async def main() -> None:
        async with toy_router() as (url, _, client):
            listed = await client.models.list()
            assert [m.id for m in listed.data] == ["toy"]
            card = await client.models.retrieve("toy")
            assert card.id == "toy" and card.object == "model" and card.owned_by == "kvxfer"
            assert card.model_extra is not None and card.model_extra["max_model_len"] == CFG.max_positions
            assert listed.data[0].model_dump() == card.model_dump()
            with pytest.raises(openai.NotFoundError) as info:
                await client.models.retrieve("gpt-4o")
            assert "The model 'gpt-4o' does not exist here; this router serves 'toy'" in info.value.message
            assert isinstance(info.value.body, dict) and info.value.body["code"] == "model_not_found"
            assert info.value.body["param"] == "model" and info.value.body["type"] == "invalid_request_error"
            async with aiohttp.ClientSession() as http:  # an id with a slash, percent-encoded, is named whole
                async with http.get(f"{url}/v1/models/org%2Fname") as answer:
                    assert answer.status == 404 and "'org/name'" in (await answer.json())["error"]["message"]

    asyncio.run(main())


async def _logged(caplog: pytest.LogCaptureFixture, start: str) -> str:
    """The access line that starts with ``start``: aiohttp writes it once the answer is sent,
    which may be after the client has read it."""
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline:
        for record in caplog.records:
            if record.name == ACCESS and record.getMessage().startswith(start):
                return record.getMessage()
        await asyncio.sleep(0.01)
    raise AssertionError(f"no access line {start!r} in {[r.getMessage() for r in caplog.records]}")


def test_every_refusal_is_logged_at_info_with_its_reason_on_one_line(caplog: pytest.LogCaptureFixture) -> None:
    key = BearerKey("sk-test-0123456789", "test")

    async def main() -> None:
        async with toy_router(api_key=key) as (url, _, client):
            auth = {"Authorization": f"Bearer {key.secret}"}
            async with aiohttp.ClientSession() as http:
                async with http.post(f"{url}/v1/completions", headers=auth,
                                     json={"model": "toy", "prompt": [1], "bogus": 1}) as answer:
                    assert answer.status == 400
                async with http.post(f"{url}/generate", headers=auth, json={"prompt": [1], "max_new_tokens": 0}):
                    pass
                async with http.post(f"{url}/generate", headers=auth, data=b"{not json"):
                    pass
                async with http.get(f"{url}/v1/models/nope", headers=auth):
                    pass
                async with http.get(f"{url}/v1/models"):
                    pass
                async with http.get(f"{url}/v1/models", headers=auth) as answer:
                    assert answer.status == 200
            line = await _logged(caplog, "POST /v1/completions 400 ")
            assert line.endswith("s: unknown field 'bogus': this router does not support it"), line
            await _logged(caplog, "POST /generate 400 ")
            await _logged(caplog, "GET /v1/models 200 ")  # the last request: every line is in now
            generate = sorted(r.getMessage().split("s: ", 1)[1] for r in caplog.records
                              if r.getMessage().startswith("POST /generate 400 "))
            assert generate[0] == "'max_new_tokens' must be a positive integer, got 0", generate
            assert generate[1].startswith("body is not JSON: Expecting property name"), generate
            line = await _logged(caplog, "GET /v1/models/nope 404 ")
            assert "The model 'nope' does not exist here" in line and "\n" not in line
            line = await _logged(caplog, "GET /v1/models 401 ")
            assert "s: no key: this server wants " in line, line
            line = await _logged(caplog, "GET /v1/models 200 ")
            assert line.endswith("s") and ": " not in line, line  # no refusal: no reason

    with caplog.at_level(logging.INFO, logger=ACCESS):
        asyncio.run(main())


def test_version_and_tokenize_without_a_tokenizer_say_so_and_bad_fields_are_named() -> None:
    async def main() -> None:
        async with toy_router() as (url, _, _client), aiohttp.ClientSession() as http:
            async with http.get(f"{url}/version") as answer:
                assert answer.status == 200 and await answer.json() == {"version": kvxfer.__version__}
            for path, body, status, param, words in (
                    ("/tokenize", {"prompt": "hi"}, 400, None, "/tokenize needs the model's tokenizer, and this "
                                                               "router has none: model 'toy' has none"),
                    ("/tokenize", {"messages": [{"role": "user", "content": "hi"}]}, 400, None,
                     "/tokenize needs the model's tokenizer"),
                    ("/detokenize", {"tokens": [1, 2]}, 400, None, "/detokenize needs the model's tokenizer"),
                    ("/tokenize", {"model": "other", "prompt": "hi"}, 404, "model", "model 'other' is not served"),
                    ("/tokenize", {"prompt": "hi", "bogus": 1}, 400, "bogus", "unknown field 'bogus': /tokenize "
                                                                              "takes add_special_tokens, model"),
                    ("/tokenize", {"prompt": "hi", "messages": []}, 400, "prompt", "not both"),
                    ("/tokenize", {"prompt": 5}, 400, "prompt", "'prompt' must be a string"),
                    ("/tokenize", {"prompt": "hi", "return_token_strs": True}, 400, "return_token_strs",
                     "not supported"),
                    ("/tokenize", {"prompt": "hi", "add_special_tokens": "yes"}, 400, "add_special_tokens",
                     "must be true or false"),
                    ("/tokenize", {"messages": [{"role": "user", "content": "x"}], "tools": [{}]}, 400, "tools",
                     "the model's own chat template"),
                    ("/tokenize", {"messages": [{"role": "user", "content": "x"}], "continue_final_message": True},
                     400, "continue_final_message", "not supported"),
                    ("/detokenize", {"tokens": [1, "2"]}, 400, "tokens", "list of token ids"),
                    ("/detokenize", {"tokens": [1], "prompt": "x"}, 400, "prompt", "unknown field 'prompt'")):
                async with http.post(f"{url}{path}", json=body) as answer:
                    error = (await answer.json())["error"]
                assert answer.status == status and words in error["message"], (body, error)
                assert error["param"] == param and set(error) == {"message", "type", "param", "code"}, error
            async with http.post(f"{url}/tokenize", data=b"{") as answer:
                assert answer.status == 400 and "body is not JSON" in (await answer.json())["error"]["message"]

    asyncio.run(main())


def _samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def _value(samples: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str, **labels: str) -> float:
    return samples[(name, frozenset(labels.items()))]


def _bounds(samples: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str) -> list[float]:
    return sorted(float(dict(labels)["le"]) for n, labels in samples if n == name + "_bucket")


def test_vllm_series_count_what_was_sent_on_the_router_and_the_workers() -> None:
    asks = [([5, 4, 3], 4), ([9] * 11, 5), (list(range(1, 30)), 6)]  # prompt ids, tokens asked

    async def main() -> None:
        async with cluster() as c, Router(c.prefill, c.decode) as router:
            server = HttpServer(make_handler(router))
            url = f"http://127.0.0.1:{await server.start()}"
            client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
            try:
                for prompt, n in asks:
                    done = await client.completions.create(model="toy", prompt=prompt, max_tokens=n)
                    assert done.usage is not None and done.usage.completion_tokens == n
                stream = await client.completions.create(model="toy", prompt=[1, 2], max_tokens=3, stream=True)
                await stream.__anext__()  # its first token is out: the request is running
                during = _samples(await request_text(url, "/metrics"))
                assert _value(during, "vllm:num_requests_running", model_name="toy") == 1.0
                assert _value(during, "vllm:num_requests_waiting", model_name="toy") == 0.0
                rest = [chunk async for chunk in stream]
                assert rest[-1].choices[0].finish_reason == "length"
                after = _samples(await request_text(url, "/metrics"))
                workers = {u: _samples(await request_text(u, "/metrics")) for u in c.prefill + c.decode}
            finally:
                await client.close()
                await server.close()
        everything = asks + [([1, 2], 3)]
        toy = {"model_name": "toy"}
        assert _value(after, "vllm:prompt_tokens_total", **toy) == sum(len(p) for p, _ in everything)
        assert _value(after, "vllm:generation_tokens_total", **toy) == sum(n for _, n in everything)
        assert _value(after, "vllm:time_to_first_token_seconds_count", **toy) == len(everything)
        assert _value(after, "vllm:e2e_request_latency_seconds_count", **toy) == len(everything)
        assert _value(after, "vllm:time_per_output_token_seconds_count", **toy) == sum(n - 1 for _, n in everything)
        assert 0 < _value(after, "vllm:time_to_first_token_seconds_sum", **toy) < \
            _value(after, "vllm:e2e_request_latency_seconds_sum", **toy)
        assert _value(after, "vllm:num_requests_running", **toy) == 0.0
        assert _value(after, "vllm:num_requests_waiting", **toy) == 0.0
        # vLLM's bucket bounds, so that its dashboards' quantiles read the same.
        assert _bounds(after, "vllm:time_to_first_token_seconds") == [
            0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
            80.0, 160.0, 640.0, 2560.0, float("inf")]
        assert _bounds(after, "vllm:time_per_output_token_seconds")[:3] == [0.01, 0.025, 0.05]
        assert _bounds(after, "vllm:e2e_request_latency_seconds")[-3:] == [1920.0, 7680.0, float("inf")]
        for u, w in workers.items():  # each worker counts every transfer it took part in
            assert _value(w, "vllm:nixl_xfer_time_seconds_count", **toy) == len(everything), u
            assert _value(w, "vllm:nixl_bytes_transferred_count", **toy) == len(everything), u
            assert _value(w, "vllm:nixl_bytes_transferred_sum", **toy) == _value(w, "kvxfer_transfer_bytes_total") > 0
            assert _value(w, "vllm:nixl_num_failed_transfers_total", **toy) == 0.0, u
            assert _bounds(w, "vllm:nixl_bytes_transferred")[:2] == [2048.0, 8192.0]
            assert _bounds(w, "vllm:nixl_xfer_time_seconds")[:2] == [0.005, 0.01]

    asyncio.run(main())


def test_a_failed_transfer_counts_in_the_vllm_failed_transfers_series() -> None:
    async def main() -> None:
        async with cluster() as c, Router(c.prefill, c.decode, on_failure="recompute") as router:
            backend(c.workers[c.prefill[0]]).fail_after_rows = 2  # the publisher fails after 2 rows
            done = await router.generate(list(range(1, 31)), 3)
            assert done.ok and done.transfer is not None and done.transfer.status == "failed"
            for u in c.prefill + c.decode:
                w = _samples(await request_text(u, "/metrics"))
                failed = sum(v for (n, labels), v in w.items()
                             if n == "kvxfer_transfers_total" and ("status", "delivered") not in labels)
                assert failed == 1 and _value(w, "vllm:nixl_num_failed_transfers_total", model_name="toy") == 1, u
                assert _value(w, "vllm:nixl_xfer_time_seconds_count", model_name="toy") == 0, u
            router_samples = _samples(router.metrics_text())
            assert _value(router_samples, "vllm:generation_tokens_total", model_name="toy") == 3
            OpenAIFrontend(router, model="served-name")  # the name clients use labels the router's series
            await router.generate([1, 2], 2)
            router_samples = _samples(router.metrics_text())
            assert _value(router_samples, "vllm:generation_tokens_total", model_name="served-name") == 2

    asyncio.run(main())
