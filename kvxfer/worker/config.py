"""A worker's configuration: its role, model, pool, lender and backend (``kvxfer serve`` flags)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvxfer.contract import TransferMode
from kvxfer.engine import ModelConfig

ROLES = ("prefill", "decode")


@dataclass(frozen=True)
class WorkerConfig:
    role: str
    model: ModelConfig = field(default_factory=ModelConfig)
    num_blocks: int = 2048
    backend: str = "nixl"
    mode: TransferMode = TransferMode.PUSH
    lender: str = "inplace"
    transfer_timeout_s: float = 30.0
    hold_s: float = 120.0
    prefix_cache: bool = True
    name: str = ""
    chunk_bytes: int | None = None  # nixl: bytes per submission chunk (None: the backend's default)
    chunk_pause_s: float = 0.0      # nixl: pause between chunk posts (fault-injection tests)
    device: str = "cpu"             # where the pool lives (the model must be on the same device)
    busy_poll: bool = False         # ipc: spin while transfers wait, and offer a doorbell (make_backend)
    arena_bytes: int | None = None  # nixl: the packed path's bounce arena (None: the backend's default, 0: none)

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        if self.lender not in ("inplace", "staging"):
            raise ValueError(f"lender must be 'inplace' or 'staging', got {self.lender!r}")
        if self.busy_poll and self.backend != "ipc":
            raise ValueError(f"busy_poll applies to the ipc backend only, not {self.backend!r}")
        if self.arena_bytes is not None and (self.backend != "nixl" or self.arena_bytes < 0):
            raise ValueError(f"arena_bytes applies to the nixl backend only and is >= 0, got {self.arena_bytes} "
                             f"with {self.backend!r}")
