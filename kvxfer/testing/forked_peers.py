"""Peer processes of the test kit, forked from a server that has imported the kit already.

Why: a ``spawn`` child starts a fresh interpreter and imports numpy, kvxfer and (for engine
KV) torch again: 0.5 s of CPU for an IPC peer, 3 s with torch, paid hundreds of times per
suite run on a 2-core machine. multiprocessing's fork server imports them once per test
process (``set_forkserver_preload``) and forks each peer from that clean, single-threaded
process: no thread, lock or CUDA context of the test process is copied (the server never
touches CUDA: importing torch does not initialise it), which is why ``fork`` itself is not
used.

A forked peer inherits the fork server's environment, fixed when the server started; the
caller's environment at start time is what a spawned peer would have seen, so ``start``
passes it and the peer takes it before it runs anything (``CUDA_VISIBLE_DEVICES``, hint
keys, NIXL and UCX settings are all read later than that).

Peers stay ``multiprocessing`` children of the test process (``active_children()``,
``kill``, ``join``), which is how the conftests find one left running; they are not
children in /proc (the fork server is their parent).
"""

from __future__ import annotations

import multiprocessing as mp
import os
from collections.abc import Callable
from multiprocessing.context import BaseContext
from typing import Any

# What a peer imports: loaded once in the fork server, not per peer.
PRELOAD = ("kvxfer.testing.ipc_pairs", "kvxfer.testing.kv_ranks")


def peer_context() -> BaseContext:
    """The fork-server context the kit starts its peers in (``ctx.Pipe()`` as usual)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))  # read when the server starts: the first peer
    return ctx


def _run_with_environment(environ: dict[str, str], target: Callable[..., Any], args: tuple[Any, ...]) -> None:
    os.environ.clear()
    os.environ.update(environ)
    target(*args)


def start_peer(ctx: BaseContext, target: Callable[..., Any], args: tuple[Any, ...], name: str) -> Any:
    """A started daemon peer running ``target(*args)`` with this process's environment."""
    proc = ctx.Process(target=_run_with_environment, args=(dict(os.environ), target, args), name=name,  # type: ignore[attr-defined]
                       daemon=True)
    proc.start()
    return proc
