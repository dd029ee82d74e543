"""kvxfer.backends.blob: the store half of the contract.

``BlobBackend`` (backend.py) publishes lent rows into a blob store under their block names
and fetches them back with exact per-row masks; ``BlobDriver`` (driver.py) is the boundary a
store implements: ``MemoryDriver`` (memory.py, in this process), ``ShmDriver`` (shm.py, files
in /dev/shm that the processes of one host share) and ``MooncakeDriver`` (mooncake.py, a real
Mooncake Store).
"""

from kvxfer.backends.blob.backend import BACKEND_KIND, BlobBackend
from kvxfer.backends.blob.driver import BlobDriver, KeyStatus, Span, StoreError
from kvxfer.backends.blob.memory import MemoryDriver, MemoryStore
from kvxfer.backends.blob.mooncake import MooncakeDriver
from kvxfer.backends.blob.names import NAME_BYTES, Namer, request_names
from kvxfer.backends.blob.shm import ShmDriver

__all__ = ["BACKEND_KIND", "NAME_BYTES", "BlobBackend", "BlobDriver", "KeyStatus", "MemoryDriver", "MemoryStore",
           "MooncakeDriver", "MooncakeMaster", "Namer", "ShmDriver", "Span", "StoreError", "request_names"]


def __getattr__(name: str) -> object:
    # Imported on first use, not with the package: ``python -m kvxfer.backends.blob.mooncake_master``
    # would otherwise find its module imported already (runpy warns of it).
    if name == "MooncakeMaster":
        from kvxfer.backends.blob.mooncake_master import MooncakeMaster

        return MooncakeMaster
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
