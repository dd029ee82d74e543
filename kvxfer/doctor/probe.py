"""The two processes ``kvxfer doctor`` measures with: a NIXL target and a NIXL initiator.

``python -m kvxfer.doctor.probe target FD MEM BYTES [REPS [CUDA_DEVICE]]`` registers a buffer (host or device, on
CUDA_DEVICE when given and not -1)
and sends its agent metadata and address; ``... initiator FD MEM BYTES`` loads them, runs
WRITE (push lane) and READ (pull lane) at a few sizes, and 64 KiB rows four ways
(scattered per-row descriptors via ``initialize_xfer``, the same via prepared descriptor
lists, contiguous rows per-row, contiguous rows coalesced), then sends the figures as
JSON. Both talk to the doctor over a socket (NIXL logs on stdout); the doctor runs them
with ``UCX_PROTO_INFO=y`` and reads which transports UCX chose from their output.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from kvxfer.backends.nixl.agent import raw_agent

ROW = 64 << 10


def _send(sock: socket.socket, payload: bytes) -> None:
    sock.sendall(len(payload).to_bytes(8, "little") + payload)


def _recv(sock: socket.socket) -> bytes:
    def exact(n: int) -> bytes:
        out = bytearray()
        while len(out) < n:
            part = sock.recv(n - len(out))
            if not part:
                raise EOFError("the doctor closed the connection")
            out += part
        return bytes(out)
    return exact(int.from_bytes(exact(8), "little"))


def _buffer(mem: str, nbytes: int, fill: int, cuda_device: int = -1) -> tuple[Any, int, int]:
    """(keep-alive object, address, device id) of a fresh buffer with every page touched;
    device memory on ``cuda_device`` (made current, as a worker on it has it), or the current one."""
    if mem == "device":
        import torch  # noqa: PLC0415 - only on machines with CUDA

        if cuda_device >= 0:
            torch.cuda.set_device(cuda_device)
        tensor = torch.full((nbytes,), fill, dtype=torch.uint8, device="cuda")
        return tensor, int(tensor.data_ptr()), int(tensor.device.index or 0)
    array = np.full(nbytes, fill, dtype=np.uint8)
    return array, int(array.ctypes.data), 0


def _agent(role: str) -> Any:
    # The target keeps NIXL's progress thread (lanes over TCP need the target's worker to
    # progress); the initiator progresses by polling its own requests, as the backend does,
    # so that it does not compete with the transfer for this machine's cores.
    return raw_agent(f"kvxfer-doctor-{role}-{os.getpid()}", progress_thread=role == "target")


def target(sock: socket.socket, mem: str, nbytes: int, cuda_device: int = -1) -> None:
    keep, address, device = _buffer(mem, nbytes, 0, cuda_device)  # the GPU first: UCX may take the current one
    agent = _agent("target")
    agent.register_memory([(address, nbytes, device, "")], "VRAM" if mem == "device" else "DRAM")
    _send(sock, json.dumps({"metadata": agent.get_agent_metadata().hex(), "address": address,
                            "device": device}).encode())
    _recv(sock)  # wait until the doctor says we are done
    del keep


def _timed(agent: Any, make: Callable[[], Any], reps: int, nbytes: int) -> dict[str, float]:
    """Best and median GB/s of ``reps`` runs (after one warm-up) of create + post + complete."""
    times = []
    for i in range(reps + 1):
        start = time.perf_counter()
        handle = make()
        state = agent.transfer(handle)
        while state == "PROC":
            state = agent.check_xfer_state(handle)
        elapsed = time.perf_counter() - start
        handle.release()
        if state != "DONE":
            raise RuntimeError(f"transfer ended in state {state}")
        if i:
            times.append(elapsed)
    times.sort()
    return {"best_gbps": nbytes / times[0] / 1e9, "median_gbps": nbytes / times[len(times) // 2] / 1e9,
            "best_ms": times[0] * 1e3}


def _descs(base: int, slots: np.ndarray, lengths: np.ndarray, device: int) -> np.ndarray:
    out = np.empty((slots.size, 3), dtype=np.uint64)
    out[:, 0] = np.uint64(base) + slots.astype(np.uint64) * np.uint64(ROW)
    out[:, 1] = lengths.astype(np.uint64) * np.uint64(ROW)
    out[:, 2] = device
    return out


def initiator(sock: socket.socket, mem: str, nbytes: int, reps: int, progress: Callable[[str], None],
              cuda_device: int = -1) -> dict[str, Any]:
    peer = json.loads(_recv(sock))
    kind = "VRAM" if mem == "device" else "DRAM"
    keep, address, device = _buffer(mem, nbytes, 1, cuda_device)
    agent = _agent("initiator")
    agent.register_memory([(address, nbytes, device, "")], kind)
    name = agent.add_remote_agent(bytes.fromhex(peer["metadata"]))
    name = name.decode() if isinstance(name, bytes) else str(name)
    remote, rdev = int(peer["address"]), int(peer["device"])
    results: dict[str, Any] = {"lanes": {}, "rows": {}}

    def one(op: str, size: int) -> Callable[[], Any]:
        local = agent.get_xfer_descs(np.array([[address, size, device]], dtype=np.uint64), kind)
        far = agent.get_xfer_descs(np.array([[remote, size, rdev]], dtype=np.uint64), kind)
        return lambda: agent.initialize_xfer(op, local, far, name)

    sizes = [s for s in (ROW, 1 << 20, 16 << 20, 256 << 20) if s <= nbytes]
    for op, lane in (("WRITE", "push"), ("READ", "pull")):
        results["lanes"][lane] = {}
        for size in sizes:
            progress(f"{lane} ({op}) {size >> 10} KiB")
            results["lanes"][lane][str(size)] = _timed(agent, one(op, size), reps, size)

    rows = min(4096, nbytes // ROW // 2)
    rng = np.random.default_rng(0)
    slots = nbytes // ROW
    local_slots = rng.permutation(slots)[:rows].astype(np.int64)
    far_slots = rng.permutation(slots)[:rows].astype(np.int64)
    ones = np.ones(rows, dtype=np.int64)
    contiguous = np.arange(rows, dtype=np.int64)
    every = np.arange(slots, dtype=np.int64)
    local_prep = agent.prep_xfer_dlist("NIXL_INIT_AGENT", _descs(address, every, np.ones(slots, np.int64), device), kind)
    far_prep = agent.prep_xfer_dlist(name, _descs(remote, every, np.ones(slots, np.int64), rdev), kind)
    row_bytes = rows * ROW

    def per_row(op: str, ls: np.ndarray, fs: np.ndarray) -> Callable[[], Any]:
        # Descriptor lists are built inside the timed call: the backend builds them per submission.
        return lambda: agent.initialize_xfer(op, agent.get_xfer_descs(_descs(address, ls, ones, device), kind),
                                             agent.get_xfer_descs(_descs(remote, fs, ones, rdev), kind), name)

    def prepped(op: str, ls: np.ndarray, fs: np.ndarray) -> Callable[[], Any]:
        return lambda: agent.make_prepped_xfer(op, local_prep, ls.astype(np.int32), far_prep, fs.astype(np.int32))

    cases = {
        "scattered_per_row_initialize": per_row("WRITE", local_slots, far_slots),
        "scattered_per_row_prepped": prepped("WRITE", local_slots, far_slots),
        "scattered_per_row_initialize_read": per_row("READ", local_slots, far_slots),
        "contiguous_per_row_initialize": per_row("WRITE", contiguous, contiguous),
        "contiguous_per_row_prepped": prepped("WRITE", contiguous, contiguous),
        "contiguous_coalesced": one("WRITE", row_bytes),
    }
    for label, make in cases.items():
        progress(f"{rows} x 64 KiB rows: {label}")
        results["rows"][label] = _timed(agent, make, reps, row_bytes)
    results["rows"]["rows"] = rows
    local_prep.release()
    far_prep.release()
    del keep
    return results


def main(argv: list[str]) -> int:
    role, fd, mem, nbytes = argv[0], int(argv[1]), argv[2], int(argv[3])
    reps = int(argv[4]) if len(argv) > 4 else 5
    cuda_device = int(argv[5]) if len(argv) > 5 else -1  # -1: the current device
    sock = socket.socket(fileno=fd)
    try:
        if role == "target":
            target(sock, mem, nbytes, cuda_device)
        else:
            def progress(step: str) -> None:
                _send(sock, json.dumps({"progress": step}).encode())
            try:
                results = initiator(sock, mem, nbytes, reps, progress, cuda_device)
                _send(sock, json.dumps({"results": results}).encode())
            except Exception as exc:  # report, do not hide: the doctor prints it
                _send(sock, json.dumps({"error": f"{type(exc).__name__}: {exc}"}).encode())
                return 1
    finally:
        sock.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
