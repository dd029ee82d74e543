"""The error every model file reader raises."""

from __future__ import annotations

from kvxfer.contract import KvxferError


class CheckpointError(KvxferError):
    """A checkpoint file is malformed, or its tensors do not fit the model config."""
