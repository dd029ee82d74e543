"""Raw NIXL baselines, two agents in two processes: the transport's ceiling and peer practice.

``nixl._api.nixl_agent`` is used directly, with no kvxfer code on the path, so these
figures say what the transport itself does with a given descriptor shape:

- ``nixl_one_desc``: the whole request as one descriptor (the transport's ceiling);
- ``nixl_per_row``: one descriptor per row, at the point's slots (contiguous or scattered);
- ``peer_practice``: one descriptor per layer, per K/V, per block over a layer-major pool,
  as serving engines commonly register their caches.

The initiator lives in this process; the target agent lives in a spawned child that owns
its buffer, so UCX takes the same inter-process path a real prefill/decode pair takes.
Push is a NIXL WRITE into the child; pull is a READ from it. A prepared transfer handle
is reposted for every timed run: descriptor-list construction is reported apart
(``prep_s``), not mixed into the transfer figure. Sampled rows are checksummed on both
ends after timing, so a figure is only reported for bytes that really moved.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import time
import zlib
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from kvxfer.backends.nixl.loader import nixl_api
from kvxfer.bench.cases import CaseSpec, Measurement, Requirement, Role, Skip, device_scope, hold_until_run_end
from kvxfer.bench.children import start_child
from kvxfer.bench.config import BenchConfig, LatencySweep, OverheadSweep, Point
from kvxfer.bench.layout import choose_slots, layer_major_addresses, pool_slots, row_addresses
from kvxfer.bench.timing import Timing, check_fresh_bytes, time_runs
from kvxfer.ucx_env import ucx_settings

_SAMPLED_ROWS = 16
_REPLY_TIMEOUT_S = 120.0


def _quiet_nixl() -> None:
    # NIXL logs INFO lines to stdout, which would interleave with the bench's table.
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    logging.getLogger("nixl").setLevel(logging.WARNING)


def _agent_api() -> tuple[Any, Any]:
    api = nixl_api()
    return api.nixl_agent, api.nixl_agent_config


def _mem_type(memory: str) -> str:
    return "VRAM" if memory == "device" else "DRAM"


class _Buffer:
    """One end's registered span: numpy on host, a torch tensor on CUDA device ``device``."""

    def __init__(self, nbytes: int, memory: str, fill: int, device: int = 0) -> None:
        self.memory = memory
        self.nbytes = nbytes
        self.device = device if memory == "device" else 0
        if memory == "host":
            self.array: Any = np.full(nbytes, fill, dtype=np.uint8)  # written: pages resident
            self.address = int(self.array.ctypes.data)
        else:
            import torch

            self.array = torch.full((nbytes,), fill, dtype=torch.uint8, device=f"cuda:{device}")
            self.address = int(self.array.data_ptr())

    def descs(self) -> np.ndarray:
        return np.array([[self.address, self.nbytes, self.device]], dtype=np.uint64)

    def _slice(self, offset: int, length: int) -> np.ndarray:
        part = self.array[offset:offset + length]
        return part if self.memory == "host" else part.cpu().numpy()

    def crc(self, ranges: np.ndarray) -> int:
        crc = 0
        for off, length in ranges.tolist():
            crc = zlib.crc32(self._slice(off, length).tobytes(), crc)
        return crc

    def stamp(self, ranges: np.ndarray, seed: int) -> None:
        """Write distinct bytes into ``ranges`` so a stale destination cannot pass the check."""
        rng = np.random.default_rng(seed)
        for off, length in ranges.tolist():
            data = rng.integers(0, 256, size=length, dtype=np.uint8)
            if self.memory == "host":
                self.array[off:off + length] = data
            else:
                import torch

                self.array[off:off + length] = torch.from_numpy(data).to(self.array.device)
        if self.memory == "device":
            import torch

            torch.cuda.synchronize(self.device)


def _target_main(conn: Connection, name: str, nbytes: int, memory: str, device: int = 0) -> None:
    """The child: owns the target buffer (on ``device`` for device memory, made current as a
    worker on that GPU would) and answers checksum/stamp requests until told to stop."""
    _quiet_nixl()
    try:
        if memory == "device":
            import torch

            torch.cuda.set_device(device)
        nixl_agent, nixl_agent_config = _agent_api()

        with ucx_settings():  # the host's UCX settings (kvxfer.ucx_env), as the backend's agents get them
            agent = nixl_agent(name, nixl_agent_config(backends=["UCX"]))
        buf = _Buffer(nbytes, memory, fill=0, device=device)
        reg = agent.register_memory(buf.descs(), _mem_type(memory))
        conn.send(("ready", agent.get_agent_metadata(), buf.address))
    except Exception as err:  # report why the child could not start, then exit
        conn.send(("error", f"{type(err).__name__}: {err}"))
        return
    try:
        while True:
            msg = conn.recv()
            if msg[0] == "stop":
                break
            try:
                if msg[0] == "crc":
                    conn.send(("ok", buf.crc(msg[1])))
                elif msg[0] == "stamp":
                    buf.stamp(msg[1], msg[2])
                    conn.send(("ok", None))
                else:
                    conn.send(("error", f"unknown command {msg[0]!r}"))
            except Exception as err:
                conn.send(("error", f"{type(err).__name__}: {err}"))
    finally:
        agent.deregister_memory(reg)
        conn.send(("stopped", None))


class NixlPair:
    """An initiator agent here and a target agent in a child process, each with ``nbytes``;
    device buffers on ``devices`` (here, the child's)."""

    def __init__(self, nbytes: int, memory: str, devices: tuple[int, int] = (0, 0)) -> None:
        _quiet_nixl()
        nixl_agent, nixl_agent_config = _agent_api()

        self.memory = memory
        self.nbytes = nbytes
        self.devices = devices if memory == "device" else (0, 0)
        ctx = mp.get_context("spawn")
        self._conn, child_conn = ctx.Pipe()
        self._proc = ctx.Process(target=_target_main, name="kvxfer-bench-nixl-target", daemon=True,
                                 args=(child_conn, f"bench-target-{os.getpid()}", nbytes, memory, self.devices[1]))
        self._reg = None
        try:
            try:
                start_child(self._proc.start)  # spared the terminal's Ctrl-C
            finally:
                child_conn.close()
            status, *rest = self._reply()
            if status != "ready":
                raise RuntimeError(f"NIXL target process failed to start: {rest[0]}")
            metadata, self.remote_address = rest
            with device_scope(memory, self.devices[0]):
                with ucx_settings():
                    self.agent = nixl_agent(f"bench-initiator-{os.getpid()}", nixl_agent_config(backends=["UCX"]))
                self.local = _Buffer(nbytes, memory, fill=0x5A, device=self.devices[0])
                self._reg = self.agent.register_memory(self.local.descs(), _mem_type(memory))
            self.remote_name = self.agent.add_remote_agent(metadata)
            if isinstance(self.remote_name, bytes):
                self.remote_name = self.remote_name.decode()
        except BaseException:
            self.close()
            raise

    def _reply(self) -> tuple[Any, ...]:
        if not self._conn.poll(_REPLY_TIMEOUT_S):
            raise RuntimeError(f"NIXL target process did not answer within {_REPLY_TIMEOUT_S:g}s")
        msg = self._conn.recv()
        if msg[0] == "error":
            raise RuntimeError(f"NIXL target process: {msg[1]}")
        return tuple(msg)

    def _call(self, *msg: Any) -> Any:
        self._conn.send(msg)
        return self._reply()[1]

    def handle(self, op: str, local_addr: np.ndarray, remote_addr: np.ndarray, length: int) -> Any:
        """A prepared transfer of ``len(local_addr)`` descriptors of ``length`` bytes each."""
        n = local_addr.size
        here, there = (np.full(n, d, dtype=np.uint64) for d in self.devices)
        lens = np.full(n, length, dtype=np.uint64)
        mem = _mem_type(self.memory)
        local = self.agent.get_xfer_descs(np.stack([local_addr.astype(np.uint64), lens, here], axis=1), mem)
        remote = self.agent.get_xfer_descs(np.stack([remote_addr.astype(np.uint64), lens, there], axis=1), mem)
        return self.agent.initialize_xfer(op, local, remote, self.remote_name, b"")

    def run(self, handle: Any) -> None:
        """Post and busy-poll to completion: the figure is the transport's, not a sleeper's."""
        state = self.agent.transfer(handle)
        while state != "DONE":
            if state == "ERR":
                raise RuntimeError("NIXL transfer failed (ERR)")
            state = self.agent.check_xfer_state(handle)

    def release(self, handle: Any) -> None:
        self.agent.release_xfer_handle(handle)

    def verify(self, op: str, local_off: np.ndarray, remote_off: np.ndarray, length: int, seed: int) -> Any:
        """Stamp fresh bytes at the source, returning a check to run after the transfer."""
        pick = np.linspace(0, local_off.size - 1, num=min(_SAMPLED_ROWS, local_off.size)).astype(np.int64)
        lr = np.stack([local_off[pick], np.full(pick.size, length)], axis=1).astype(np.int64)
        rr = np.stack([remote_off[pick], np.full(pick.size, length)], axis=1).astype(np.int64)
        if op == "WRITE":
            self.local.stamp(lr, seed)
        else:
            self._call("stamp", rr, seed)

        def check() -> bool:
            return bool(self.local.crc(lr) == self._call("crc", rr))

        return check

    def close(self) -> None:
        if self._reg is not None:
            self.agent.deregister_memory(self._reg)
            self._reg = None
        if self._proc.is_alive():
            try:
                self._conn.send(("stop",))
                if self._conn.poll(10.0):
                    self._conn.recv()
            except (BrokenPipeError, EOFError, OSError):
                pass
            self._proc.join(timeout=10.0)
            if self._proc.is_alive():
                self._proc.terminate()
                self._proc.join(timeout=5.0)
        self._conn.close()


_PAIRS: dict[tuple[str, int, tuple[int, int]], NixlPair] = {}


def shared_pair(memory: str, nbytes: int, devices: tuple[int, int] = (0, 0)) -> NixlPair:
    """One pair per (memory kind, size, devices) for the whole run: the child takes seconds to start."""
    key = (memory, nbytes, devices)
    if key not in _PAIRS:
        _PAIRS[key] = NixlPair(nbytes, memory, devices)

        def close() -> None:
            pair = _PAIRS.pop(key, None)
            if pair is not None:
                pair.close()

        hold_until_run_end(close)
    return _PAIRS[key]


class _RawCase:
    """Shared machinery: one NixlPair per memory kind and placement of its two ends, sized for
    the largest point of the run."""

    descriptor_shape = "one"

    def __init__(self, config: BenchConfig) -> None:
        self.config = config
        self._rng = np.random.default_rng(config.seed)
        points = config.throughput_points() + (config.latency.points() if config.latency else [])
        self._capacity = max((self._span(p)[1] * p.groups for p in points), default=1 << 20)

    def _span(self, point: Point) -> tuple[int, int]:
        """(slots per group, bytes per group) on each end."""
        slots = pool_slots(point, self.config.pool_factor)
        return slots, slots * point.row_bytes

    def _pair(self, point: Point) -> NixlPair:
        # The initiator here is the active end: a push writes from prefill, a pull reads into decode.
        devices = self.config.active_devices(point.direction) if point.memory == "device" else (0, 0)
        return shared_pair(point.memory, self._capacity, devices)

    def descriptors(self, point: Point) -> tuple[np.ndarray, np.ndarray, int]:
        """(local offsets, remote offsets, bytes per descriptor), offsets from each buffer's base."""
        raise NotImplementedError

    def _prepare(self, point: Point) -> tuple[NixlPair, Any, str, dict[str, Any], Callable[[int], Any]]:
        local_off, remote_off, length = self.descriptors(point)
        if local_off.size > self.config.max_descriptors:
            raise Skip(f"{local_off.size} descriptors exceed the run's limit of {self.config.max_descriptors} "
                       "(--max-descriptors)")
        pair = self._pair(point)
        op = "WRITE" if point.direction == "push" else "READ"
        t0 = time.perf_counter()
        handle = pair.handle(op, pair.local.address + local_off, pair.remote_address + remote_off, length)
        prep = time.perf_counter() - t0
        def stamp(seed: int) -> Any:
            return pair.verify(op, local_off, remote_off, length, seed)

        facts = {"descriptors": int(local_off.size), "descriptor_bytes": int(length), "prep_s": prep,
                 "op": op, "processes": 2, "memory_type": _mem_type(point.memory)}
        if point.memory == "device":
            facts["devices"] = list(self.config.devices)
        return pair, handle, op, facts, stamp

    def throughput(self, point: Point) -> Measurement:
        pair, handle, _op, facts, stamp = self._prepare(point)
        try:
            stamp(self.config.seed + point.rows)
            timing = time_runs(lambda: pair.run(handle), self.config.repetition)
            check_fresh_bytes(stamp, lambda: pair.run(handle), "bytes at the destination")
            facts["verified"] = True
        finally:
            pair.release(handle)
        return Measurement({"seconds_best": timing.best, "seconds_median": timing.median,
                            "reps": len(timing.samples)}, facts)

    def latency(self, point: Point, sweep: LatencySweep) -> Measurement:
        pair, handle, _op, facts, stamp = self._prepare(point)
        try:
            stamp(self.config.seed + point.rows)
            for _ in range(sweep.warmup):
                pair.run(handle)
            samples = []
            for _ in range(sweep.samples):
                t0 = time.perf_counter()
                pair.run(handle)
                samples.append(time.perf_counter() - t0)
            check_fresh_bytes(stamp, lambda: pair.run(handle), "bytes at the destination")
            facts["verified"] = True
        finally:
            pair.release(handle)
        facts["measured"] = "post to local completion (the target is not notified)"
        return latency_measurement(Timing(tuple(samples)), facts)

    def overhead(self, point: Point, sweep: OverheadSweep) -> Measurement:
        raise Skip("raw NIXL has no kvxfer submission to time")

    def close(self) -> None:
        pass  # the pair is shared by the raw cases and closed when the run ends


def latency_measurement(timing: Timing, facts: dict[str, Any]) -> Measurement:
    return Measurement({
        "p50_s": timing.percentile(50), "p99_s": timing.percentile(99), "min_s": timing.best,
        "samples": len(timing.samples),
    }, facts)


class OneDescriptor(_RawCase):
    def descriptors(self, point: Point) -> tuple[np.ndarray, np.ndarray, int]:
        zero = np.zeros(1, dtype=np.int64)
        return zero, zero, point.total_bytes


class PerRow(_RawCase):
    def _slots(self, point: Point) -> tuple[list[np.ndarray], list[np.ndarray]]:
        local = [choose_slots(point, self.config.pool_factor, self._rng) for _ in range(point.groups)]
        remote = [choose_slots(point, self.config.pool_factor, self._rng) for _ in range(point.groups)]
        return local, remote

    def descriptors(self, point: Point) -> tuple[np.ndarray, np.ndarray, int]:
        local, remote = self._slots(point)
        _, group_bytes = self._span(point)
        return (row_addresses(0, group_bytes, point.row_bytes, local),
                row_addresses(0, group_bytes, point.row_bytes, remote), point.row_bytes)


class PeerPractice(PerRow):
    def descriptors(self, point: Point) -> tuple[np.ndarray, np.ndarray, int]:
        parts = 2 * self.config.layers
        if point.row_bytes % parts:
            raise Skip(f"a {point.row_bytes}-byte row does not split into {parts} layer pieces")
        local, remote = self._slots(point)
        _, group_bytes = self._span(point)
        lo, piece = layer_major_addresses(0, group_bytes, point.row_bytes, self.config.layers, local)
        ro, _ = layer_major_addresses(0, group_bytes, point.row_bytes, self.config.layers, remote)
        return lo, ro, piece


_ALL = ("memory", "direction", "slots", "row_bytes", "rows", "groups")
SPECS = [
    CaseSpec("nixl_one_desc", "NIXL, one descriptor (2 processes)", Role.CEILING, frozenset({Requirement.NIXL}),
             ("memory", "direction"), frozenset({"throughput", "latency"}), OneDescriptor),
    CaseSpec("nixl_per_row", "NIXL, one descriptor per row (2 processes)", Role.BASELINE,
             frozenset({Requirement.NIXL}), _ALL, frozenset({"throughput", "latency"}), PerRow),
    CaseSpec("peer_practice", "NIXL, one descriptor per layer per block, layer-major (2 processes)", Role.BASELINE,
             frozenset({Requirement.NIXL}), _ALL, frozenset({"throughput", "latency"}), PeerPractice),
]
