"""Layout identity and opaque block names.

The identity is a versioned digest of everything that decides what the bytes of a row
mean: each group's geometry and dtype, the layout order, the tensor-parallel shard and the
caller's scope bytes (model, weights, adapters, KV dtype: the caller must put everything
byte-affecting there). Two processes with equal layouts compute equal identities; any
difference gives a different one. Block names chain a group's token blocks under that
identity, so equal prefixes under equal layouts have equal names on every process, and
nothing about the tokens can be read back from a name.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

from kvxfer.pool.spec import LayerGroupSpec, Layout

LAYOUT_VERSION = 1
IDENTITY_BYTES = 1 + 32  # version byte + sha256
NAME_BYTES = 16


def layout_identity(
    groups: Sequence[LayerGroupSpec], layout: Layout, tp: tuple[int, int], scope: bytes
) -> bytes:
    """Fixed-width (33 bytes) identity: version byte, then sha256 of the canonical text."""
    count, index = tp
    if not (isinstance(count, int) and isinstance(index, int) and count >= 1 and 0 <= index < count):
        raise ValueError(f"tensor-parallel shard must be (count >= 1, 0 <= index < count), got {tp!r}")
    if not isinstance(scope, bytes):
        raise TypeError(f"scope must be bytes, got {type(scope).__name__}")
    parts = [f"kvxfer-layout/{LAYOUT_VERSION}", f"order={layout.value}", f"tp={count}:{index}",
             f"scope={scope.hex()}"]
    for g in groups:
        parts.append(
            f"group={g.name}|{g.kind.value}|layers={g.layers}|bt={g.block_tokens}|heads={g.kv_heads}"
            f"|dim={g.head_dim}|dtype={str(g.dtype)}|window={g.window}|sinks={g.sink_blocks}"
        )
    digest = hashlib.sha256("\n".join(parts).encode()).digest()
    return bytes([LAYOUT_VERSION]) + digest


def block_names(identity: bytes, group: str, block_tokens: int, token_ids: np.ndarray) -> list[bytes]:
    """Chained names of the *full* blocks of ``token_ids`` in one group (16 bytes each).

    name[i] = blake2b(identity | group | name[i-1] | tokens of block i). A name thus
    stands for the whole prefix up to and including its block, under one layout.
    """
    ids = np.ascontiguousarray(np.asarray(token_ids, dtype=np.int64))
    full = ids.size // block_tokens
    blocks = ids[: full * block_tokens].reshape(full, block_tokens)
    salt = hashlib.blake2b(identity + b"|" + group.encode(), digest_size=NAME_BYTES).digest()
    names: list[bytes] = []
    parent = salt
    for i in range(full):  # one hash per block is inherent to a chain
        parent = hashlib.blake2b(parent + blocks[i].tobytes(), digest_size=NAME_BYTES).digest()
        names.append(parent)
    return names
