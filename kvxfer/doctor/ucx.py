"""``kvxfer doctor``'s ucx part: which UCX transport ucxx (the ucx backend's UCX) chose for
tag messages between two processes on this node, and how fast they went.

Two processes: ``python -m kvxfer.doctor.ucx receiver FD BYTES REPS EH`` prints its worker
address and receives; ``... sender FD ADDRESS BYTES REPS EH`` sends 64 KiB and BYTES messages, timing each
size from the first send to the receiver's answer, and runs with ``UCX_PROTO_INFO=y``, so
UCX prints the protocol table of each tag send; the doctor reads the transports from it.
FD is the read end of a pipe whose write end only the doctor holds: both exit when it reads
end of file, so a doctor killed mid-probe (a timeout) leaves no probe spinning on UCX progress.
ucxx bundles its own UCX (1.21 in ucxx-cu13 0.52), which need not be NIXL's.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from typing import Any

import numpy as np

SMALL = 64 << 10
DONE_TAG = 1 << 62  # the receiver's answer: every message of a size arrived
_CELL_TRANSPORT = re.compile(r"([a-z][a-z0-9_]*)/([A-Za-z0-9_:.\-]+)")


def parse_tag_tables(text: str) -> list[str]:
    """Transports in the tables UCX printed for tagged messages between processes (not an
    endpoint to itself), e.g. ["posix/memory", "cma/memory"] or ["tcp/lo"]."""
    found: list[str] = []
    in_table = False
    previous = ""
    for raw in text.splitlines():
        if "|" not in raw:
            continue
        line = raw[raw.index("|"):].strip().strip("|").strip()
        if "tagged message by" in line:
            in_table = " self " not in f" {previous} {line} "
        elif " by ucp_" in line:
            in_table = False
        elif in_table:
            cells = [c.strip() for c in line.split("|")]
            if len(cells) >= 3 and re.match(r"^[0-9.]+[KMGT]?(\.\.[0-9a-zA-Z]+)?$", cells[0]):
                for name, device in _CELL_TRANSPORT.findall(cells[-1]):
                    if f"{name}/{device}" not in found:
                        found.append(f"{name}/{device}")
        previous = line
    return found


def _ucx_version() -> str:
    from kvxfer.backends.ucx.transport import load_ucxx  # noqa: PLC0415 - keeps UCX_* out of os.environ

    lib, _, _ = load_ucxx()
    return ".".join(str(x) for x in lib.get_ucx_version())


def exit_with_parent(fd: int) -> None:
    """Exit at once when ``fd`` (the read end of the doctor's pipe) reads end of file: the doctor
    is gone, killed or not. The probes spin on UCX progress and never block where a dead parent
    would be noticed, so without this a killed doctor leaves them spinning a core each."""
    def watch() -> None:
        while os.read(fd, 4096):
            pass
        os._exit(3)

    threading.Thread(target=watch, name="kvxfer-doctor-parent", daemon=True).start()


def receiver(nbytes: int, reps: int, error_handling: bool) -> None:
    from kvxfer.backends.ucx.transport import CONTROL_TAG, Transport  # noqa: PLC0415

    transport = Transport(error_handling)
    print(transport.address.hex(), flush=True)
    sender = sys.stdin.readline().strip()
    big = np.empty(max(nbytes, SMALL), np.uint8)
    for size in (SMALL, nbytes):
        for _ in range(reps):
            while (probe := transport.probe(0, CONTROL_TAG)) is None:
                transport.progress()
            request = transport.receive(probe, big[:size])
            while not request.completed:
                transport.progress()
        done = np.zeros(1, np.uint8)
        answer = transport.send("sender", bytes.fromhex(sender), done, DONE_TAG)
        while not answer.completed:
            transport.progress()
    transport.close()


def sender(address: str, nbytes: int, reps: int, error_handling: bool) -> None:
    from kvxfer.backends.ucx.transport import Transport  # noqa: PLC0415

    transport = Transport(error_handling)
    print(transport.address.hex(), flush=True)
    target = bytes.fromhex(address)
    data = np.ones(max(nbytes, SMALL), np.uint8)
    figures = {}
    for size in (SMALL, nbytes):
        start = time.perf_counter()
        requests = [transport.send("receiver", target, data[:size], i) for i in range(reps)]
        done = np.zeros(1, np.uint8)
        while (probe := transport.probe(DONE_TAG, (1 << 64) - 1)) is None:
            transport.progress()
        answer = transport.receive(probe, done)
        while not (answer.completed and all(r.completed for r in requests)):
            transport.progress()
        figures[str(size)] = size * reps / (time.perf_counter() - start) / 1e9
    print("FIGURES " + json.dumps(figures), flush=True)
    transport.close()


def probe(nbytes: int = 64 << 20, reps: int = 5, timeout: float = 120.0) -> dict[str, Any]:
    """The ucx section of the doctor's report (``skipped`` when ucxx is not installed): the
    lane of UcxBackend's default (UCX's peer error handling on), then without it."""
    out = _probe_once(nbytes, reps, timeout, True)
    if "skipped" not in out:
        out["without_error_handling"] = _probe_once(nbytes, reps, timeout, False)
    return out


def _probe_once(nbytes: int, reps: int, timeout: float, error_handling: bool) -> dict[str, Any]:
    try:
        version = _ucx_version()
    except Exception as exc:  # noqa: BLE001 - any reason ucxx cannot load is the answer here
        return {"skipped": str(exc)}
    env = {**os.environ, "UCX_WARN_UNUSED_ENV_VARS": "n"}
    watch_fd, alive_fd = os.pipe()  # the probes exit when alive_fd closes: with this process
    os.set_inheritable(watch_fd, True)
    cmd = [sys.executable, "-m", "kvxfer.doctor.ucx"]
    common = [str(nbytes), str(reps), str(int(error_handling))]
    send: subprocess.Popen[str] | None = None
    try:
        recv = subprocess.Popen([*cmd, "receiver", str(watch_fd), *common], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env,
                                pass_fds=[watch_fd])
    except BaseException:
        os.close(watch_fd)
        os.close(alive_fd)
        raise
    try:
        assert recv.stdout is not None and recv.stdin is not None
        address = recv.stdout.readline().strip()
        send = subprocess.Popen([*cmd, "sender", str(watch_fd), address, *common], stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, env={**env, "UCX_PROTO_INFO": "y"},
                                pass_fds=[watch_fd])
        assert send.stdout is not None
        recv.stdin.write(send.stdout.readline().strip() + "\n")
        recv.stdin.flush()
        output, _ = send.communicate(timeout=timeout)
        recv.wait(timeout=timeout)
    finally:
        os.close(watch_fd)
        os.close(alive_fd)
        for proc in (recv, send):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
    figures = next((json.loads(line[8:]) for line in output.splitlines() if line.startswith("FIGURES ")), {})
    from kvxfer.backends.ucx.transport import ucxx_version  # noqa: PLC0415

    return {"ucxx": ucxx_version(), "ucx": version, "transports": parse_tag_tables(output), "gbps": figures}


def main(argv: list[str]) -> int:
    if argv[:1] == ["receiver"]:
        exit_with_parent(int(argv[1]))
        receiver(int(argv[2]), int(argv[3]), argv[4] == "1")
    elif argv[:1] == ["sender"]:
        exit_with_parent(int(argv[1]))
        sender(argv[2], int(argv[3]), int(argv[4]), argv[5] == "1")
    else:
        print(json.dumps(probe(), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
