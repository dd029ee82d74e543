"""kvxfer.router: the embeddable asyncio router (``Router``) and ``kvxfer router``.

    from kvxfer.router import Router, Token, Completion
    router = Router(prefill=[url_p], decode=[url_d], selection="least_outstanding", on_failure="recompute")
    completion = await router.generate(prompt_ids, max_new_tokens=32)
"""

from kvxfer.router.results import Completion, Token, TransferFigures
from kvxfer.router.router import POLICIES, SELECTIONS, Router

__all__ = ["POLICIES", "SELECTIONS", "Completion", "Router", "Token", "TransferFigures"]
