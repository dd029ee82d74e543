"""kvxfer.router: the embeddable asyncio router (``Router``), its OpenAI-compatible front end
(``kvxfer.router.openai``) and ``kvxfer router``.

    from kvxfer.router import Router, Token, Completion
    async with Router(prefill=[url_p], decode=[url_d], on_failure="recompute") as router:
        completion = await router.generate(prompt_ids, max_new_tokens=32)
"""

from kvxfer.router.inputs import InvalidRequest
from kvxfer.router.results import Completion, Token, TransferFigures
from kvxfer.router.router import POLICIES, Router
from kvxfer.router.workers import SELECTIONS, ModelLimits, RouterHealth

__all__ = ["POLICIES", "SELECTIONS", "Completion", "InvalidRequest", "ModelLimits", "Router", "RouterHealth", "Token",
           "TransferFigures"]
