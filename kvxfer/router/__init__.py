"""kvxfer.router: the embeddable asyncio router (``Router``), its OpenAI-compatible front end
(``kvxfer.router.openai``) and ``kvxfer router``.

    from kvxfer.router import Router, Token, Completion
    async with Router(prefill=[url_p], decode=[url_d], on_failure="recompute") as router:
        completion = await router.generate(prompt_ids, max_new_tokens=32)
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from kvxfer.router.constants import POLICIES, SELECTIONS

if TYPE_CHECKING:
    from kvxfer.router.inputs import InvalidRequest
    from kvxfer.router.results import Completion, Token, TransferFigures
    from kvxfer.router.router import Router
    from kvxfer.router.workers import ModelLimits, RouterHealth

__all__ = ["POLICIES", "SELECTIONS", "Completion", "InvalidRequest", "ModelLimits", "Router", "RouterHealth", "Token",
           "TransferFigures"]
_WHERE = {"InvalidRequest": "inputs", "Completion": "results", "Token": "results", "TransferFigures": "results",
          "Router": "router", "ModelLimits": "workers", "RouterHealth": "workers"}


def __getattr__(name: str) -> Any:
    """The router's classes, imported when first named: ``kvxfer router``'s flags are checked
    (and a bad one refused) before aiohttp loads."""
    if name in _WHERE:
        return getattr(importlib.import_module(f"kvxfer.router.{_WHERE[name]}"), name)
    raise AttributeError(f"module 'kvxfer.router' has no attribute {name!r}")
