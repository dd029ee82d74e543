"""A worker's configuration: its role, model, pool, lender and backend (``kvxfer serve`` flags)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvxfer.contract import TransferMode
from kvxfer.engine import ModelConfig

ENGINES = ("reference", "transformers")

ROLES = ("prefill", "decode")
CLOCK_SKEW_S = 5.0
"""How far apart two hosts' clocks may be (hints expire by the publisher's wall clock)."""


def settle_bound(deadline_s: float) -> float:
    """The longest a transfer with this deadline takes to conclude and quiesce, a silent peer
    included: twice the deadline, or the deadline plus 8 s where that is longer
    (docs/configuration.md, "A peer that vanishes silently")."""
    return max(2 * deadline_s, deadline_s + 8.0)

LAYOUTS = ("block_major", "layer_major")


def integrity_state(backend: str, enabled: bool) -> str:
    """What a worker's integrity setting means (/health, kvxfer pair's report): every transfer
    backend checks its rows (ipc between engine geometries excepted: docs/reliability.md)."""
    return "on" if enabled else "off"


def layerwise_refusal(groups: int, what: str) -> str:
    """Why ``--layerwise GROUPS`` refuses ``what`` ("engine_kv": a TP group of engine KV, or
    "staging": --lender staging), one message for kvxfer serve and kvxfer pair."""
    if what == "engine_kv":
        return (f"--layerwise {groups} with a TP group of engine KV (--engine-kv, --tp, --kv-block-tokens, "
                "--kv-layout; kvxfer pair: --prefill-/--decode-tp, -kv-block-tokens, -kv-layout) is not supported: "
                "a TP group moves a request as one transfer per rank pair whose geometry spans every layer, not "
                "one per rank pair and layer group; use --layerwise 1 there")
    return (f"--layerwise {groups} with --lender staging is not supported: --layerwise streams the engine's own KV, "
            "lent in place as each group is computed, and a staging lender copies the rows out only after prefill; "
            "use --lender inplace")


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
    # A decode reservation set aside because a peer holding its hint D might still write it
    # comes back this long after hint D expired (kvxfer serve --expiry-grace): the longest a
    # transfer begun before then could still touch it, plus clock skew. None:
    # settle_bound(transfer_timeout_s) + CLOCK_SKEW_S, this worker's own deadline; the write
    # runs under the prefill worker's, so set it when theirs is longer.
    expiry_grace_s: float | None = None
    prefix_cache: bool = True
    name: str = ""
    model_name: str = "toy"         # what --model (or --checkpoint) named: /health says it, a router serves it by it
    chunk_bytes: int | None = None  # nixl: bytes per submission chunk (None: the backend's default)
    chunk_pause_s: float = 0.0      # nixl: pause between chunk posts (fault-injection tests)
    device: str = "cpu"             # where the pool lives (the model must be on the same device)
    busy_poll: bool = False         # ipc: spin while transfers wait, and offer a doorbell (make_backend)
    arena_bytes: int | None = None  # nixl: the packed path's bounce arena (None: the backend's default, 0: none)
    integrity: bool = True          # row digests sent and checked (nixl, ucx, loopback, the store); --integrity off
    # Fault injection (kvxfer serve --inject-corruption): the share of rows landing here that
    # are damaged after their copy and before their check (a bit flipped or the row rewritten).
    inject_corruption: float = 0.0
    # An engine's own KV (kvxfer.worker.ranks): a TP group sharded by KV heads, in a block
    # size and order of its own, moved as engine geometries. ``peer_tp``: the TP of the
    # prefill workers a decode worker takes KV from.
    tp: int = 1
    block_tokens: int | None = None  # None: the model's
    layout: str = "block_major"
    peer_tp: int = 1
    engine_kv: bool = False
    # A KV store (kvxfer.worker.store): "" none, "memory" (a /dev/shm directory the host's
    # processes share, at store_path) or "mooncake" (a Mooncake Store, its master at store_master).
    store: str = ""
    store_path: str = ""
    store_master: str = ""
    store_segment_mib: int = 256   # mooncake: memory this worker gives the store (0: none, a store server holds)
    # nixl: keep the agent's metadata in etcd (kvxfer.backends.nixl.etcd_metadata) at these
    # endpoints; "": as NIXL_ETCD_ENDPOINTS says (unset: the metadata travels in the hints).
    etcd_endpoints: str = ""
    etcd_namespace: str = ""       # "": KVXFER_ETCD_NAMESPACE, else "default"
    etcd_ttl_s: int = 10           # how long a killed worker's metadata outlives it
    # What computes and holds KV (kvxfer.worker.engines): "reference" (kvxfer's LlamaModel and
    # its pool) or "transformers" (Hugging Face transformers' continuous batching, its cache
    # lent in place; kvxfer serve --engine transformers).
    engine: str = "reference"
    # Layer-wise streaming (kvxfer.worker.layers; kvxfer serve --layerwise): the model's
    # layers cut into this many groups, each published by the prefill worker as soon as the
    # forward computed it. 1: the request moves in one transfer after prefill. Both ends of
    # a pair must say the same (the groups are part of the pool's layout identity). Either
    # engine: the reference engine's pool (with a KV store or without), or transformers'
    # cache (a model of full-attention layers only: a hybrid cache is refused when the
    # engine is built). Not a TP group of engine KV, nor --lender staging (layerwise_refusal).
    layerwise: int = 1

    @property
    def reclaim_grace_s(self) -> float:
        """Seconds after hint D's expiry when no transfer can touch a set-aside reservation."""
        if self.expiry_grace_s is not None:
            return self.expiry_grace_s
        return settle_bound(self.transfer_timeout_s) + CLOCK_SKEW_S

    def __post_init__(self) -> None:
        self._check_numbers()
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        if self.lender not in ("inplace", "staging"):
            raise ValueError(f"lender must be 'inplace' or 'staging', got {self.lender!r}")
        if self.busy_poll and self.backend != "ipc":
            raise ValueError(f"busy_poll applies to the ipc backend only, not {self.backend!r}")
        if self.tp != 1 or self.peer_tp != 1 or self.block_tokens is not None or self.layout != "block_major":
            object.__setattr__(self, "engine_kv", True)
        if self.engine_kv:
            self._check_engine_kv()
        if self.store:
            self._check_store()
        if self.engine != "reference":
            self._check_engine()
        self._check_layerwise()
        if self.arena_bytes is not None and (self.backend != "nixl" or self.arena_bytes < 0):
            raise ValueError(f"arena_bytes applies to the nixl backend only and is >= 0, got {self.arena_bytes} "
                             f"with {self.backend!r}")

    def _check_numbers(self) -> None:
        if self.expiry_grace_s is not None and (isinstance(self.expiry_grace_s, bool) or
                                                not isinstance(self.expiry_grace_s, (int, float)) or
                                                not 0 <= self.expiry_grace_s < 1e9):
            raise ValueError(f"expiry_grace_s must be None or a number of seconds in [0, 1e9), got "
                             f"{self.expiry_grace_s!r}")
        if isinstance(self.inject_corruption, bool) or not 0.0 <= self.inject_corruption <= 1.0:
            raise ValueError(f"inject_corruption must be a share of rows from 0 to 1, got {self.inject_corruption!r}")
        if self.inject_corruption and not self.integrity:
            raise ValueError("inject_corruption damages rows for the integrity check to catch: it needs integrity on")

    def _check_layerwise(self) -> None:
        value = self.layerwise
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"layerwise must be a positive number of layer groups, got {value!r}")
        if value > self.model.layers:
            raise ValueError(f"layerwise {value} is more layer groups than the model has layers ({self.model.layers})")
        if value > 1 and self.engine_kv:
            raise ValueError(layerwise_refusal(value, "engine_kv"))
        if value > 1 and self.lender != "inplace":
            raise ValueError(layerwise_refusal(value, "staging"))

    def _check_engine(self) -> None:
        if self.engine not in ENGINES:
            raise ValueError(f"engine must be one of {ENGINES}, got {self.engine!r}")
        if self.engine_kv or self.store or self.lender != "inplace":
            raise ValueError("--engine transformers lends transformers' own cache in place: it takes no --engine-kv, "
                             "--tp, --kv-block-tokens, --kv-layout, --store or --lender staging")

    def _check_store(self) -> None:
        if self.store not in ("memory", "mooncake"):
            raise ValueError(f"store must be 'memory' or 'mooncake', got {self.store!r}")
        if self.engine_kv:
            raise ValueError("a TP group (--tp, --kv-block-tokens, --kv-layout) does not use a KV store: the store "
                             "keeps pool rows under their block names")
        if self.lender != "inplace":
            raise ValueError("--store reads and writes the pool's rows in place: use --lender inplace")
        if self.store == "mooncake" and not self.store_master:
            raise ValueError("--store mooncake needs --store-master HOST:PORT (the Mooncake master)")
        if self.store_segment_mib < 0 or 0 < self.store_segment_mib < 16:
            raise ValueError(f"--store-segment-mib must be 0 or at least 16 (Mooncake's least segment), got "
                             f"{self.store_segment_mib}")

    def _check_engine_kv(self) -> None:
        for name in ("tp", "peer_tp"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {self.layout!r}")
        if self.block_tokens is not None and (not isinstance(self.block_tokens, int) or self.block_tokens < 1):
            raise ValueError(f"block_tokens must be a positive int, got {self.block_tokens!r}")
        if self.lender != "inplace":
            raise ValueError("a TP group (--tp, --kv-block-tokens, --kv-layout) lends in place: --lender staging "
                             "moves pool rows only")
        if self.prefix_cache:
            raise ValueError("a TP group (--tp, --kv-block-tokens, --kv-layout) does not share prompt prefixes: "
                             "pass --no-prefix-cache (prefix_cache=False)")
        if self.backend not in ("nixl", "ipc", "loopback"):
            raise ValueError(f"the {self.backend} backend moves pool rows only; a TP group needs nixl, ipc or loopback")
        kv_heads = self.model.kv_heads
        for name, tp in (("tp", self.tp), ("peer_tp", self.peer_tp)):
            if tp <= kv_heads and kv_heads % tp:
                raise ValueError(f"{name} {tp} does not divide the model's {kv_heads} KV heads")
            if tp > kv_heads and tp % kv_heads:
                raise ValueError(f"{name} {tp} is not a multiple of the model's {kv_heads} KV heads "
                                 "(ranks replicate whole heads)")
