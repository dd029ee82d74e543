"""Workers of this process behind real HTTP servers, for tests that drive them as a router does,
and a refusal to inject into a worker's backend."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Mapping
from typing import Any

from kvxfer.backends.loopback import LoopbackFabric
from kvxfer.contract import InvalidSubmission
from kvxfer.serving.http import HttpServer
from kvxfer.worker.app import make_handler
from kvxfer.worker.core import Worker, WorkerConfig


@contextlib.asynccontextmanager
async def served_workers(workers: Mapping[str, tuple[WorkerConfig, Any]]
                         ) -> AsyncIterator[tuple[dict[str, str], dict[str, Worker]]]:
    """One worker per name (its config and model: None lets a reference worker build its
    own), all on one loopback fabric, each behind an HTTP server on 127.0.0.1: their URLs and
    the workers, by name. On the way out the servers close, then the workers, and each must
    report no unquiesced attempt and no retained block."""
    fabric = LoopbackFabric()
    servers: list[HttpServer] = []
    started: dict[str, Worker] = {}
    urls: dict[str, str] = {}
    try:
        for name, (config, model) in workers.items():
            started[name] = worker = Worker(config, model=model, fabric=fabric)
            await worker.start()
            server = HttpServer(make_handler(worker))
            servers.append(server)
            urls[name] = f"http://127.0.0.1:{await server.start()}"
        yield urls, started
    finally:
        for server in servers:
            await server.close()
        for worker in started.values():
            report = await worker.close()
            assert report == {"unquiesced_attempts": 0, "retained_blocks": 0}, report


@contextlib.asynccontextmanager
async def served_pair(prefill: Mapping[str, Any], decode: Mapping[str, Any], *, weights: Any, **common: Any
                      ) -> AsyncIterator[tuple[str, str, dict[str, Worker]]]:
    """A prefill and a decode worker named by their roles, served as ``served_workers`` does:
    each one's WorkerConfig is ``common`` with its own fields over it, and both run ``weights``.
    Yields the prefill URL, the decode URL and the workers by role."""
    configs = {role: (WorkerConfig(role=role, name=role, **{**common, **extra}), weights)
               for role, extra in (("prefill", prefill), ("decode", decode))}
    async with served_workers(configs) as (urls, workers):
        yield urls["prefill"], urls["decode"], workers


def refuse_group(worker: Worker, layer_group: str, why: str) -> None:
    """Wrap the worker's backend in place: its publish of a view of ``layer_group`` raises
    InvalidSubmission(``why``) before anything is submitted; other groups publish as before."""
    backend: Any = worker.backend
    real = backend.publish

    def publish(view: Any, hint: Any, wake: Any = None) -> Any:
        if view.groups[0].layer_group == layer_group:
            raise InvalidSubmission(why)
        return real(view, hint, wake)

    backend.publish = publish
