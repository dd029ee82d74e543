"""Decode TP ranks' engine KV in a second process, for two-process geometry benchmarks.

A decode TP group's ranks each keep their own KV (an ``EngineKV`` over a block-major
``PagedKVPool`` holding the rank's heads, or a tensor per layer), and each runs its own
backend. ``DecodeRanks`` starts one child process (forked from the kit's fork server) that builds every
rank's KV from a ``KVSpec``, one backend per rank (``NixlBackend`` or ``IpcBackend``, push
mode: the ranks fetch), and registers each rank's tensors with its backend. The parent gets
each rank's geometry (the child's addresses) as an ``EngineKV`` without tensors, to lend
views of the child's blocks with ``ExternalLender``.

Hints cross as ``kvxfer.wire`` bytes, as a router carries them. When a fetch's outcome becomes
visible in the child (its wake callback), the child stamps ``time.monotonic_ns()``: both
processes read the same CLOCK_MONOTONIC, so the parent can time from its own submission to
the decode outcomes. ``sample`` reads chosen tokens of a rank's KV (every layer, K and V, the
rank's heads) in the child, on the device for device memory, for byte checks.

``build_kv``, ``fill_random`` and ``gather_tokens`` serve this process's own KV too.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import torch

from kvxfer.contract import Backend, BlockOrder, HeadOrder, Hint, KVGeometry, Outcome, TransferMode, View
from kvxfer.lender.engine_kv import EngineKV
from kvxfer.pool import LayerGroupSpec, Layout, PagedKVPool
from kvxfer.testing.forked_peers import peer_context, start_peer
from kvxfer.wire import decode_hint, encode_hint

PROCESS_NAME = "kvxfer-kv-ranks"
_START_TIMEOUT_S = 120.0  # a busy 2-core host takes tens of seconds to import NIXL in a child


@dataclass(frozen=True)
class KVSpec:
    """One end's KV, buildable in any process. ``kind``: ``"layers"``, a tensor per layer
    ``[2, blocks, bt, H, D]`` (``order`` NHD) or ``[2, blocks, H, bt, D]`` (HND); ``"pool"``,
    block-major: a BLOCK_MAJOR ``PagedKVPool`` ``[blocks, layers, 2, bt, H, D]`` (NHD), or one
    tensor ``[blocks, layers, 2, H, bt, D]`` (HND). ``H``: the heads held, ``heads`` = [first,
    end) of the model's ``kv_heads``. float16."""

    kind: str
    layers: int
    kv_heads: int
    heads: tuple[int, int]
    head_dim: int
    blocks: int
    block_tokens: int
    order: str = "nhd"
    name: str = "kv"

    @property
    def nbytes(self) -> int:
        return 2 * self.layers * self.blocks * self.block_tokens * (self.heads[1] - self.heads[0]) * self.head_dim * 2


def torch_device(memory: str, device: int) -> str:
    return f"cuda:{device}" if memory == "device" else "cpu"


def build_kv(spec: KVSpec, device: str = "cpu") -> EngineKV:
    """The spec's tensors (zeros) on ``device`` as an EngineKV."""
    held, bt, dim = spec.heads[1] - spec.heads[0], spec.block_tokens, spec.head_dim
    order = HeadOrder(spec.order)
    if spec.kind == "pool" and order is HeadOrder.NHD:
        group = LayerGroupSpec("g", layers=spec.layers, block_tokens=bt, kv_heads=held, head_dim=dim)
        pool = PagedKVPool([group], spec.blocks, device=device, layout=Layout.BLOCK_MAJOR, name=spec.name)
        return EngineKV.from_pool(pool, heads=spec.heads, kv_heads=spec.kv_heads)
    if spec.kind == "pool":
        t = torch.zeros((spec.blocks, spec.layers, 2, held, bt, dim), dtype=torch.float16, device=device)
        return EngineKV.from_planes([t[:, i, 0] for i in range(spec.layers)], [t[:, i, 1] for i in range(spec.layers)],
                                    tensors=(t,), kv_heads=spec.kv_heads, heads=spec.heads, head_order=order,
                                    order=BlockOrder.BLOCK_MAJOR, name=spec.name)
    if spec.kind != "layers":
        raise ValueError(f"KVSpec.kind {spec.kind!r}: 'layers' or 'pool'")
    shape = (2, spec.blocks, bt, held, dim) if order is HeadOrder.NHD else (2, spec.blocks, held, bt, dim)
    tensors = [torch.zeros(shape, dtype=torch.float16, device=device) for _ in range(spec.layers)]
    return EngineKV.per_layer(tensors, kv_heads=spec.kv_heads, heads=spec.heads, head_order=order, name=spec.name)


def fill_random(tensors: Sequence[torch.Tensor], seed: int) -> None:
    """Random bytes in every tensor (generated where the tensor lives)."""
    for i, t in enumerate(tensors):
        gen = torch.Generator(device=t.device).manual_seed(seed * 1009 + i)
        t.view(torch.uint8).random_(0, 256, generator=gen)
    if tensors and tensors[0].is_cuda:
        torch.cuda.synchronize(tensors[0].device)


def gather_tokens(geometry: KVGeometry, tensors: Sequence[torch.Tensor], table: Any, tokens: Any,
                  heads: tuple[int, int] | None = None) -> np.ndarray:
    """``[planes, len(tokens), heads, unit_bytes]`` uint8: the KV of ``tokens`` (a request's token
    indices; its logical block i is block ``table[i]``) for ``heads`` (default: all held),
    read through ``geometry`` from ``tensors`` (its regions, in order)."""
    first, end = heads if heads is not None else geometry.heads
    if not geometry.heads[0] <= first < end <= geometry.heads[1]:
        raise ValueError(f"heads [{first}, {end}) are not within the geometry's {geometry.heads}")
    bt, unit = geometry.block_tokens, geometry.unit_bytes
    t = np.asarray(tokens, dtype=np.int64)
    token_off = np.asarray(table, dtype=np.int64)[t // bt] * geometry.block_stride + (t % bt) * geometry.token_stride
    head_off = (np.arange(first, end, dtype=np.int64) - geometry.heads[0]) * geometry.head_stride
    offsets = token_off[:, None, None] + head_off[None, :, None] + np.arange(unit, dtype=np.int64)[None, None, :]
    flats = [x.view(torch.uint8).reshape(-1) for x in tensors]
    index = torch.from_numpy(offsets).to(flats[0].device)
    out = [flats[region][index + offset] for region, offset in geometry.planes]
    return torch.stack(out).cpu().numpy()


@dataclass(frozen=True)
class RanksSpec:
    """The child: ``ranks`` KV specs (one backend each) of ``backend`` (``"nixl"`` or ``"ipc"``)
    over ``memory`` (``"host"``/``"device"``) on CUDA ``device``; ``options``: the backend's
    keyword arguments."""

    backend: str
    ranks: tuple[KVSpec, ...]
    memory: str = "host"
    device: int = 0
    options: tuple[tuple[str, Any], ...] = ()
    deadline_s: float = 30.0


def _make_backend(spec: RanksSpec, rank: int) -> Backend:
    options = dict(spec.options)
    if spec.backend == "nixl":
        from kvxfer.backends.nixl import NixlBackend

        return NixlBackend(mode=TransferMode.PUSH, deadline_s=spec.deadline_s, **options)
    if spec.backend == "ipc":
        from kvxfer.backends.ipc import IpcBackend

        return IpcBackend(f"rank{rank}", TransferMode.PUSH, device=spec.device, deadline_s=spec.deadline_s, **options)
    raise ValueError(f"unknown backend {spec.backend!r}: 'nixl' or 'ipc'")


def backend_stats(backend: Backend) -> Any:
    """``backend.stats()`` as a dict where it keeps counters (NixlBackend), else None."""
    stats = getattr(backend, "stats", None)
    if not callable(stats):
        return None
    value = stats()
    return dataclasses.asdict(value) if dataclasses.is_dataclass(value) and not isinstance(value, type) else repr(value)


class _Child:
    """The child's ranks: KV, backends and fetches, one method per command."""

    def __init__(self, spec: RanksSpec) -> None:
        self.kvs: list[EngineKV] = []
        self.backends: list[Backend] = []
        where = torch_device(spec.memory, spec.device)
        for rank, kv_spec in enumerate(spec.ranks):
            kv = build_kv(kv_spec, where)
            self.kvs.append(kv)
            backend = _make_backend(spec, rank)
            self.backends.append(backend)
            skipped = backend.register(kv.regions)
            if skipped:
                raise RuntimeError(f"rank {rank}: {type(backend).__name__} cannot reach {spec.memory} memory here")
        self.attempts: dict[int, Any] = {}
        self.visible: dict[int, int] = {}

    def describe(self, rank: int, view: View) -> bytes:
        return encode_hint(self.backends[rank].describe(view))

    def start(self, rank: int, view: View, hint: bytes) -> int:
        handle = len(self.attempts) + 1
        holder: list[Any] = []

        def wake() -> None:  # the first moment the outcome is visible here
            if handle not in self.visible and holder and holder[0].poll() is not None:
                self.visible[handle] = time.monotonic_ns()

        attempt = self.backends[rank].fetch(view, decode_hint(hint), wake)
        holder.append(attempt)
        self.attempts[handle] = attempt
        wake()
        return handle

    def result(self, handle: int, timeout: float) -> tuple[Outcome | None, bool, int | None]:
        attempt = self.attempts[handle]
        end = time.monotonic() + timeout
        attempt.wait(timeout)
        while not attempt.quiesced() and time.monotonic() < end:
            time.sleep(0.0005)
        return attempt.poll(), attempt.quiesced(), self.visible.get(handle)

    def sample(self, rank: int, table: Any, tokens: Any) -> np.ndarray:
        kv = self.kvs[rank]
        return gather_tokens(kv.geometry, kv.tensors, table, tokens)

    def stats(self, rank: int) -> Any:
        return backend_stats(self.backends[rank])

    def ping(self) -> None:
        return None

    def forget(self) -> int:
        """Drop finished attempts (a long run would otherwise keep every one)."""
        done = [h for h, a in self.attempts.items() if a.poll() is not None and a.quiesced()]
        for h in done:
            self.attempts.pop(h)
            self.visible.pop(h, None)
        return len(done)

    def shutdown(self) -> int:
        return sum(len(b.shutdown()) for b in self.backends)


def _serve(conn: Connection, spec: RanksSpec) -> None:
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    try:
        if spec.memory == "device":
            torch.cuda.set_device(spec.device)
        child = _Child(spec)
    except Exception as err:  # reported to the parent, which raises it
        conn.send(("err", f"{type(err).__name__}: {err}"))
        return
    conn.send(("ok", [(kv.geometry, kv.layout) for kv in child.kvs]))
    ops: dict[str, Callable[..., Any]] = {
        "describe": child.describe, "start": child.start, "result": child.result, "sample": child.sample,
        "stats": child.stats, "ping": child.ping, "forget": child.forget, "shutdown": child.shutdown}
    try:
        while True:
            cmd, *args = conn.recv()
            if cmd == "close":
                conn.send(("ok", child.shutdown()))
                return
            try:
                conn.send(("ok", ops[cmd](*args)))
            except Exception as err:
                conn.send(("err", f"{type(err).__name__}: {err}"))
    except (EOFError, OSError):
        child.shutdown()  # the parent went away


class DecodeRanks:
    """The decode ranks of ``spec`` in a child process; ``kv[r]``: rank r's KV as seen from here
    (the child's geometry and layout, no tensors)."""

    def __init__(self, spec: RanksSpec, timeout_s: float = _START_TIMEOUT_S) -> None:
        os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")  # inherited by the child: NIXL logs INFO to stdout
        ctx = peer_context()
        self._conn, child = ctx.Pipe()
        self._proc = start_peer(ctx, _serve, (child, spec), PROCESS_NAME)
        child.close()
        self.spec = spec
        try:
            ends = self._reply(timeout_s)
        except BaseException:
            self.close()
            raise
        self.kv = [EngineKV(geometry, layout, ()) for geometry, layout in ends]

    @property
    def pid(self) -> int | None:
        return self._proc.pid

    def _reply(self, timeout: float) -> Any:
        if not self._conn.poll(timeout):
            raise TimeoutError(f"the decode ranks' process {self._proc.pid} did not answer within {timeout:g}s")
        status, value = self._conn.recv()
        if status == "err":
            raise RuntimeError(f"decode ranks' process: {value}")
        return value

    def _call(self, *msg: Any, timeout: float = 120.0) -> Any:
        self._conn.send(msg)
        return self._reply(timeout)

    def describe(self, rank: int, view: View) -> Hint:
        return decode_hint(self._call("describe", rank, view))

    def start(self, rank: int, view: View, hint: Hint) -> int:
        """Rank ``rank`` fetches ``view`` with the publisher's ``hint``; a handle for ``result``."""
        return int(self._call("start", rank, view, encode_hint(hint)))

    def result(self, handle: int, timeout: float) -> tuple[Outcome | None, bool, int | None]:
        """(outcome, quiesced, monotonic ns when the outcome became visible in the child)."""
        outcome, quiet, visible = self._call("result", handle, timeout, timeout=timeout + 60.0)
        return outcome, bool(quiet), visible

    def sample(self, rank: int, table: Any, tokens: Any) -> np.ndarray:
        """``gather_tokens`` of rank ``rank``'s KV in the child (all the heads it holds)."""
        return self._call("sample", rank, np.asarray(table, dtype=np.int64), np.asarray(tokens, dtype=np.int64))

    def stats(self, rank: int) -> Any:
        return self._call("stats", rank)

    def ping(self) -> None:
        self._call("ping")

    def forget(self) -> int:
        return int(self._call("forget"))

    def close(self) -> int | None:
        """Shut the ranks' backends down (how many attempts were not quiesced) and reap the child."""
        left = None
        if self._proc.is_alive():
            try:
                left = int(self._call("close", timeout=30.0))
            except (OSError, EOFError, TimeoutError, RuntimeError):
                pass
            self._proc.join(10.0)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(10.0)
        self._conn.close()
        return left
