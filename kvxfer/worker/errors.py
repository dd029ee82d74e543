"""The worker's refusals, as domain errors: the HTTP adapter (``kvxfer.worker.app``) maps
them to statuses."""

from __future__ import annotations

from kvxfer.contract import KvxferError


class Refused(KvxferError):
    """The worker refuses this call as it stands: the wrong role, an id already in use here, no
    such held prefill or reservation, a completion past the model's positions, or shutting
    down. Nothing was made or submitted (the HTTP API answers 400)."""


class Aborted(KvxferError):
    """A /prefill or /reserve whose request was aborted while it ran: what it made is dropped
    and nothing was submitted (the HTTP API answers 409)."""
