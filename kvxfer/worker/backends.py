"""Choose a worker's backend by name. kvxfer has no transport of its own here: each name is
one of ``kvxfer.backends``.

- ``nixl`` (default): NIXL over UCX; host memory between processes on this machine, GPU
  memory where CUDA is present.
- ``ipc``: CUDA IPC between processes sharing a node's GPU (needs CUDA and the native module).
- ``ucx``: UCX tag messages through ucxx (``pip install 'kvxfer[ucx]'``), host memory
  between processes.
- ``loopback``: the in-process reference; it only connects backends of one process, so it
  serves in-process workers (tests and ``examples/router_embed.py``), never ``kvxfer serve``.
"""

from __future__ import annotations

from kvxfer.backends.common import CorruptFn
from kvxfer.backends.loopback import LoopbackBackend, LoopbackFabric
from kvxfer.contract import DEFAULT_HINT_TTL_S, Backend, TransferMode

BACKENDS = ("nixl", "ipc", "ucx", "loopback")


def make_backend(kind: str, mode: TransferMode, *, name: str, deadline_s: float,
                 fabric: LoopbackFabric | None = None, device: int = 0, chunk_bytes: int | None = None,
                 chunk_pause_s: float = 0.0, busy_poll: bool = False, arena_bytes: int | None = None,
                 hint_ttl_s: float = DEFAULT_HINT_TTL_S, etcd_endpoints: str = "", etcd_namespace: str = "",
                 etcd_ttl_s: int = 10, integrity: bool = True, corrupt_landed: CorruptFn | None = None) -> Backend:
    """``chunk_bytes``/``chunk_pause_s`` tune NIXL's submission chunks (a chunk is the unit
    that a partial delivery reports); a pause between chunks lets tests kill a peer mid-way.
    ``arena_bytes`` (nixl only): the packed path's bounce arena (None: the backend's default,
    0: none). ``hint_ttl_s``: how long the hints it describes may be used. ``etcd_*`` (nixl
    only): keep the agent's metadata in etcd there ("" endpoints: as NIXL_ETCD_ENDPOINTS says).
    ``busy_poll`` (ipc only): a core spins while transfers wait, and a waiting end offers its
    doorbell (``kvxfer.backends.ipc.doorbells``), for the lowest small-transfer latency.
    ``integrity``: row digests sent and checked (docs/reliability.md; ipc: its copy kernel
    checks each row where it landed). ``corrupt_landed``: fault injection, rows damaged where
    they land before their check (``kvxfer.backends.common.Corruptor``; for ipc, whose kernel
    damages them, a ``Corruptor``: its ``pick`` chooses them)."""
    if busy_poll and kind != "ipc":
        raise ValueError(f"busy_poll applies to the ipc backend only, not {kind!r}")
    if arena_bytes is not None and kind != "nixl":
        raise ValueError(f"arena_bytes applies to the nixl backend only, not {kind!r}")
    if kind == "nixl":
        from kvxfer.backends.nixl import EtcdSettings, NixlBackend  # noqa: PLC0415 - nixl loads UCX: only when asked

        etcd = EtcdSettings(etcd_endpoints or None, etcd_namespace or None, etcd_ttl_s)
        return NixlBackend(name, mode, deadline_s=deadline_s, chunk_pause_s=chunk_pause_s,
                           chunk_bytes=chunk_bytes or None, arena_bytes=arena_bytes, hint_ttl_s=hint_ttl_s,
                           etcd=etcd, integrity=integrity, corrupt_landed=corrupt_landed)
    if kind == "ipc":
        from kvxfer.backends.ipc import IpcBackend  # noqa: PLC0415

        pick = getattr(corrupt_landed, "pick", None)
        if corrupt_landed is not None and pick is None:
            raise ValueError("the ipc backend's kernel damages the rows itself: corrupt_landed must offer pick() "
                             "(kvxfer.backends.common.Corruptor)")
        return IpcBackend(name, mode, device=device, deadline_s=deadline_s, busy_poll=busy_poll, hint_ttl_s=hint_ttl_s,
                          integrity=integrity, corrupt_rows=pick)
    if kind == "ucx":
        from kvxfer.backends.ucx import UcxBackend  # noqa: PLC0415 - ucxx loads UCX: only when asked

        return UcxBackend(name, mode, deadline_s=deadline_s, hint_ttl_s=hint_ttl_s, integrity=integrity,
                          corrupt_landed=corrupt_landed)
    if kind == "loopback":
        if fabric is None:
            raise ValueError("the loopback backend connects backends of one process only: pass a LoopbackFabric "
                             "shared by in-process workers, or use --backend nixl between processes")
        return LoopbackBackend(fabric, name, mode, deadline_s=deadline_s, hint_ttl_s=hint_ttl_s, integrity=integrity,
                               corrupt_landed=corrupt_landed)
    raise ValueError(f"unknown backend {kind!r}: choose one of {', '.join(BACKENDS)}")
