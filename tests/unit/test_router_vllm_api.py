"""What an OpenAI or vLLM client expects of the router beyond completions: the model object
(``GET /v1/models/{id}``, with vLLM's ``max_model_len``), through the official ``openai``
client against a real router over toy workers in this process."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import aiohttp
import openai
import pytest
from test_router import CFG, cluster  # noqa: I001 - pytest puts tests/unit on sys.path

from kvxfer.router import Router
from kvxfer.router.app import make_handler
from kvxfer.serving.http import HttpServer


@contextlib.asynccontextmanager
async def toy_router() -> AsyncIterator[tuple[str, Router, openai.AsyncOpenAI]]:
    async with cluster() as c, Router(c.prefill, c.decode) as router:
        server = HttpServer(make_handler(router))
        url = f"http://127.0.0.1:{await server.start()}"
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
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
