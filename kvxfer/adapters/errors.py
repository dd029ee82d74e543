"""Errors of the engine adapters (``AdapterError`` and its kinds, under ``KvxferError``)."""

from __future__ import annotations

from kvxfer.contract import KvxferError


class AdapterError(KvxferError):
    """An engine adapter cannot do what was asked of it."""


class EngineVersionError(AdapterError):
    """The installed engine is not the version the adapter's reach into its internals was
    written against."""


class EngineMismatch(AdapterError):
    """The two ends of a transfer run different engines (or engine versions): their KV
    cannot be assumed to mean the same thing."""


class UnsupportedCache(AdapterError):
    """The engine's cache has a shape the adapter does not lend (for example a layer type other
    than full or sliding-window attention in transformers' continuous batching), or the call
    asks for it in a way its shape does not allow (one lease of a hybrid cache)."""
