"""kvxfer.backends.blob: the store half of the contract.

``BlobBackend`` (backend.py) publishes lent rows into a blob store under their block names
and fetches them back with exact per-row masks; ``BlobDriver`` (driver.py) is the boundary a
store implements: ``MemoryDriver`` (memory.py, in this process) and ``MooncakeDriver``
(mooncake.py, a real Mooncake Store).
"""

from kvxfer.backends.blob.backend import BACKEND_KIND, BlobBackend
from kvxfer.backends.blob.driver import BlobDriver, KeyStatus, Span, StoreError
from kvxfer.backends.blob.memory import MemoryDriver, MemoryStore
from kvxfer.backends.blob.names import NAME_BYTES, Namer, request_names

__all__ = ["BACKEND_KIND", "NAME_BYTES", "BlobBackend", "BlobDriver", "KeyStatus", "MemoryDriver", "MemoryStore",
           "Namer", "Span", "StoreError", "request_names"]
