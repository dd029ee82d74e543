"""Hugging Face transformers' continuous batching, disaggregated by kvxfer (``kvxfer[transformers]``).

transformers' ``PagedAttentionCache`` is lent in place through ``EngineKV`` and
``ExternalLender``: the prefill end lends a prompt's blocks straight out of the cache tensor,
the decode end reserves blocks in its own cache, receives the KV into them and adopts the
request at its position. Every reach into transformers' internals is in ``_internals`` (pinned
to one version; another is refused by name).
"""

from kvxfer.adapters.transformers.engine import (
    ENGINE,
    Prefilled,
    Reservation,
    TransformersEngine,
    check_peer_engine,
    checkpoint_scope,
)

__all__ = ["ENGINE", "Prefilled", "Reservation", "TransformersEngine", "check_peer_engine", "checkpoint_scope"]
