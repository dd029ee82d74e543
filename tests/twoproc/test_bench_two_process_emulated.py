"""kvxfer bench's two-process IPC case (throughput and the small-request latency) run end to
end on CPU, with IpcBackend over kvxfer.testing.host_cuda: the measuring code, its byte
checks and its clean-up, not the figures (those come from the GPU machine)."""

from __future__ import annotations

import dataclasses

import pytest

from kvxfer.backends.ipc import IpcBackend
from kvxfer.bench.config import LatencySweep, Point, Repetition, preset
from kvxfer.bench.two_process import Kind, TwoProcessCase
from kvxfer.testing import host_cuda
from kvxfer.testing.ipc_pairs import ChildPeer, DeviceRows, PeerSpec


def emulated_ipc_kind() -> Kind:
    return Kind(
        memory=("device",),
        local=lambda mode, device: IpcBackend("bench", mode, device=device, cuda=host_cuda),
        peer=lambda mode, geometry, memory, device: ChildPeer(PeerSpec(mode, geometry=geometry, device=device,
                                                                       emulated=True)),
        rebuild_args=None,
        rows=lambda geometry, memory, device: DeviceRows(geometry, device, cuda=host_cuda),
        facts={"processes": 2, "transport": "emulated CUDA IPC (host memory)"},
        stamps_outcome=True,
    )


@pytest.fixture()
def case():  # type: ignore[no-untyped-def]
    config = dataclasses.replace(preset("tiny"), repetition=Repetition(warmup=1, reps=3, budget_s=0.5))
    runner = TwoProcessCase(config, emulated_ipc_kind())
    yield runner
    runner.close()


@pytest.mark.parametrize("direction", ["push", "pull"])
def test_throughput_moves_and_verifies_rows(case, direction):  # type: ignore[no-untyped-def]
    m = case.throughput(Point(direction, "device", "scattered", 4096, 64, 2))
    assert m.facts["verified"] is True and m.metrics["reps"] >= 3
    assert 0 < m.metrics["seconds_best"] <= m.metrics["seconds_median"]


def test_latency_samples_are_decode_side_stamps_with_rows_checked(case):  # type: ignore[no-untyped-def]
    sweep = LatencySweep(rows=(8,), row_bytes=4096, memory=("device",), samples=5, warmup=1)
    m = case.latency(Point("push", "device", "scattered", 4096, 8, 1), sweep)
    assert m.facts["verified"] is True
    assert m.metrics["samples"] == 5
    assert 0 < m.metrics["min_s"] <= m.metrics["p50_s"] <= m.metrics["p99_s"]


def test_latency_rows_are_compared_in_blocks_of_fresh_slots(case, monkeypatch):  # type: ignore[no-untyped-def]
    """Blocks of two samples (the last one short): each block's rows are compared, then cleared."""
    import kvxfer.bench.two_process as two_process

    monkeypatch.setattr(two_process, "_LATENCY_VERIFY_BYTES", 2 * 8 * 4096)
    reads: list[int] = []
    original = ChildPeer.read

    def counting_read(self, region, slots):  # type: ignore[no-untyped-def]
        reads.append(len(slots))
        return original(self, region, slots)

    monkeypatch.setattr(ChildPeer, "read", counting_read)
    sweep = LatencySweep(rows=(8,), row_bytes=4096, memory=("device",), samples=4, warmup=1)
    m = case.latency(Point("push", "device", "scattered", 4096, 8, 1), sweep)
    assert m.metrics["samples"] == 4
    assert reads == [16, 16, 8]  # 5 samples of 8 rows in blocks of 2, every row compared


def test_latency_is_refused_where_nobody_stamps_the_decode_outcome(case):  # type: ignore[no-untyped-def]
    from kvxfer.bench.cases import Skip

    sweep = LatencySweep(rows=(8,), row_bytes=4096, memory=("device",), samples=2, warmup=0)
    with pytest.raises(Skip, match="IPC push"):
        case.latency(Point("pull", "device", "scattered", 4096, 8, 1), sweep)
    with pytest.raises(Skip, match="device"):
        case.latency(Point("push", "host", "scattered", 4096, 8, 1), sweep)


@pytest.mark.parametrize("busy_poll", [False, True], ids=["sockets", "doorbell"])
def test_ipc_breakdown_script_runs_emulated(busy_poll):  # type: ignore[no-untyped-def]
    """bench/ipc_breakdown.py stamps the backend's steps by name: renaming one of them must
    fail here, on CPU, not on the GPU machine."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "bench" / "ipc_breakdown.py"
    done = subprocess.run([sys.executable, str(script), "--emulated", "--cases", "32x4096", "--small-reps", "3"]
                          + (["--busy-poll"] if busy_poll else []), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    steps = {line.split()[0] for line in done.stdout.splitlines() if line.startswith("  ")}
    # One group: its kernel, the doorbell store and the event go in one native call.
    wanted = ["check_submission<", "match_rows<", "native_then<", "event_done", "peer_visible"]
    wanted.append("peer:_check_bells<" if busy_poll else "peer:_on_frame<")
    for step in wanted:
        assert step in steps, (step, done.stdout)


def test_ipc_in_flight_script_runs_emulated(tmp_path):  # type: ignore[no-untyped-def]
    """bench/ipc_in_flight.py end to end over host_cuda: requests in flight, rows verified, JSON written."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "bench" / "ipc_in_flight.py"
    out = tmp_path / "in_flight.json"
    done = subprocess.run([sys.executable, str(script), "--emulated", "--row-sizes", "4096", "--request-mib", "1",
                           "--depths", "1,3", "--reps", "2", "--json", str(out)], capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    result = json.loads(out.read_text())
    assert [f["depth"] for f in result["figures"]] == [1, 3]
    assert all(f["verified"] and f["gbps_best"] > 0 for f in result["figures"])
    assert result["devices"] == [0, 0] and result["reference"].startswith("host memcpy")
    # Two devices exist only on a GPU machine: asked for over the emulation, refused by name.
    refused = subprocess.run([sys.executable, str(script), "--emulated", "--devices", "0,1"], capture_output=True,
                             text=True, timeout=60)
    assert refused.returncode == 2 and "--devices" in refused.stderr


def test_ipc_in_flight_sustained_requests_emulated(tmp_path):  # type: ignore[no-untyped-def]
    """--requests N: N requests in all, depth in flight at a time, the first and last verified."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "bench" / "ipc_in_flight.py"
    out = tmp_path / "sustained.json"
    done = subprocess.run([sys.executable, str(script), "--emulated", "--row-sizes", "4096", "--request-mib", "1",
                           "--depths", "1,2", "--requests", "5", "--reps", "2", "--json", str(out)],
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    figures = json.loads(out.read_text())["figures"]
    assert [(f["depth"], f["requests"]) for f in figures] == [(1, 5), (2, 5)]
    assert all(f["verified"] and f["payload_bytes"] == 5 * 2**20 for f in figures)


def _timeline(stdout: str) -> tuple[list[str], list[str]]:
    """(publisher's, fetcher's) events of bench/nixl_packed_timeline.py's printout, each
    without its "[cpu N us]" column, which every line after a thread's first one carries."""
    import re

    lines = stdout.splitlines()[1:]
    assert sum("[cpu " in line for line in lines) >= len(lines) - 4, lines  # four threads at most start unstamped
    events = [(bool(line[11:13].strip()), re.sub(r"\s*\[cpu -?\d+ us\]$", "", line.split(None, 1)[1]))
              for line in lines]
    return [e for p, e in events if p], [e for p, e in events if not p]


def test_nixl_packed_timeline_script_stamps_both_ends(tmp_path):  # type: ignore[no-untyped-def]
    """bench/nixl_packed_timeline.py over host memory: both processes' steps of one packed push,
    in order from the request to each end's outcome, the fetcher's indented."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "bench" / "nixl_packed_timeline.py"
    done = subprocess.run([sys.executable, str(script), "--memory", "host", "--rows", "256", "--row-bytes", "16384",
                           "--chunk-mib", "1", "--arena-mib", "8", "--reps", "1"],
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    publisher, fetcher = _timeline(done.stdout)
    assert publisher[0] == "publish>" and "sent req" in publisher and "outcome Delivered" in publisher
    assert {"gather>", "post>", "WRITE DONE"} <= set(publisher), publisher
    assert "received req" in fetcher and "scatter>" in fetcher and "outcome Delivered" in fetcher, fetcher
    assert any(f.startswith("sent credit") for f in fetcher) and any(f.startswith("received chunk") for f in fetcher)


def test_nixl_timeline_script_stamps_an_unpacked_push():  # type: ignore[no-untyped-def]
    """--path unpacked --layout contiguous: the planning, the post, its release, the
    conclusion and the record, in that order, then the fetcher's outcome."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "bench" / "nixl_packed_timeline.py"
    done = subprocess.run([sys.executable, str(script), "--memory", "host", "--rows", "256", "--row-bytes", "16384",
                           "--chunk-mib", "1", "--reps", "1", "--path", "unpacked", "--layout", "contiguous"],
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    assert "256 contiguous rows" in done.stdout and "unpacked" in done.stdout.splitlines()[0]
    publisher, fetcher = _timeline(done.stdout)
    order = ["publish>", "plan_chunks>", "publish<", "post>", "release>", "conclusion>", "sent record",
             "outcome Delivered"]
    at = [publisher.index(e) for e in order]
    assert at == sorted(at), publisher
    assert publisher.count("post>") == 4  # 4 MiB in 1 MiB chunks, one coalesced descriptor each
    assert "received record" in fetcher and "outcome Delivered" in fetcher, fetcher
