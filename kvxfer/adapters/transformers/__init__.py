"""Hugging Face transformers' continuous batching, disaggregated by kvxfer (``kvxfer[transformers]``).

transformers' ``PagedAttentionCache`` is lent in place through ``EngineKV`` and
``ExternalLender``: the prefill end lends a prompt's blocks straight out of the cache tensor,
the decode end reserves blocks in its own cache, receives the KV into them and adopts the
request at its position. Each request picks its tokens with kvxfer's sampler
(``RequestSampling``: ``kvxfer.engine.sampling``'s parameters and logprobs), so a seeded request
makes the same completion colocated and disaggregated. Every reach into transformers' internals is in ``_internals`` (pinned
to one version; another is refused by name).
"""

from kvxfer.adapters.transformers.engine import (
    ENGINE,
    Prefilled,
    Reservation,
    TransformersEngine,
    check_peer_engine,
    checkpoint_scope,
    colocated_sampled,
)
from kvxfer.adapters.transformers.sampler import PLAIN, RequestSampling

__all__ = ["ENGINE", "PLAIN", "Prefilled", "RequestSampling", "Reservation", "TransformersEngine", "check_peer_engine",
           "checkpoint_scope", "colocated_sampled"]
