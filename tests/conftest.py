"""Shared test set-up: GPU tests skip cleanly without CUDA, and no test module leaves a
backend's thread, any process it started (a child, or one reparented away) or a UCX worker
running behind it."""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import resource
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

from kvxfer.testing.etcd_server import EtcdServer, etcd_binary
from kvxfer.testing.leftovers import mark_run, marked_processes
from kvxfer.worker.procs import children_of

# Hypothesis judges its own speed by the wall clock, which tests running beside each other
# (ci/test.sh runs them in parallel) make slow: a property test fails on what it checks, not
# on how busy the machine was (no per-example deadline either).
settings.register_profile("kvxfer", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("kvxfer")

# Backends' progress threads (kvxfer.backends.*): each backend's shutdown() ends its own.
_BACKEND_THREADS = ("kvxfer-ipc-", "kvxfer-loopback-", "kvxfer-nixl-", "kvxfer-ucx-", "kvxfer-blob-", "etcd-")
_SETTLE_S = 10.0  # a process killed at a module's end may take a moment to be reaped
_RUN_MARK = mark_run()  # every process this run starts carries it (kvxfer.testing.leftovers)
_UCX_FILES = pytest.StashKey[set[str]]()  # a module's UCX files when it started (_ucx_shared_memory)


@pytest.fixture(autouse=True, scope="module")
def nothing_outlives_its_module(request: pytest.FixtureRequest) -> Iterator[None]:
    """Checked per module (module-scoped fixtures keep peers across a module's tests): the
    threads and processes its tests started have ended once its fixtures are torn down."""
    threads = {t.ident for t in threading.enumerate()}
    children = set(children_of(os.getpid()))
    peers = set(mp.active_children())
    before = set(marked_processes(_RUN_MARK))
    request.node.stash[_UCX_FILES] = _ucx_shared_memory()  # checked by pytest_runtest_teardown
    cpu = _cpu_seconds()
    yield
    _log_cpu(request.node.nodeid, cpu)
    deadline = time.monotonic() + _SETTLE_S
    while True:
        left = [t.name for t in threading.enumerate()
                if t.ident not in threads and t.is_alive() and t.name.startswith(_BACKEND_THREADS)]
        procs = [pid for pid in children_of(os.getpid()) if pid not in children]
        # Descendants too, reparented ones included (started with setsid, or orphaned).
        strays = {pid: cmd for pid, cmd in marked_processes(_RUN_MARK).items() if pid not in before}
        # multiprocessing children, the kit's forked peers included (their parent is the fork server)
        forked = [p.name for p in mp.active_children() if p not in peers]
        if not (left or procs or strays or forked) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert not left, f"backend threads still running after the module's tests: {left}"
    assert not procs, f"child processes still running after the module's tests: {procs}"
    assert not strays, f"processes this module started still running after its tests: {strays}"
    assert not forked, f"multiprocessing children still running after the module's tests: {forked}"


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """After a module's last teardown: no UCX worker its tests made (ucxx's or NIXL's) is
    still alive. Here, not in the module fixture above: until this teardown ends, pytest still
    holds the last test's fixture values (a list of shut-down backends, say)."""
    yield
    module = item.getparent(pytest.Module)
    if module is None or _UCX_FILES not in module.stash or (
            nextitem is not None and nextitem.getparent(pytest.Module) is module):
        return
    if isinstance(item, pytest.Function):
        item.funcargs.clear()  # pytest lets go of them next; it must be first
    before = module.stash[_UCX_FILES]
    if left := _ucx_shared_memory() - before:
        gc.collect()  # a backend shut down but still in a reference cycle lets go of its worker here
        left = _ucx_shared_memory() - before
    assert not left, (f"UCX workers made by {module.nodeid}'s tests still exist: they hold {len(left)} of UCX's "
                      f"shared-memory files, and sockets with UCX async handlers on them")


def _ucx_shared_memory() -> set[str]:
    """UCX's shared-memory files this process holds open: every live UCX worker, ucxx's or
    NIXL's, holds some. A worker left alive keeps its descriptors (about 18) and UCX's async
    handlers, keyed by descriptor number, for the life of the test process: under xdist one
    process passed 1,100 descriptors, and a later UCX worker failed to start."""
    found = set()
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue  # closed since the listing (the listing's own, for one)
        if "/ucx_shm_" in target:
            found.add(target)
    return found


def _cpu_group() -> Path | None:
    """With KVXFER_TEST_CPU_LOG set, a cpuacct cgroup (v1, writable: root) that this test
    process joins, so that every process it starts is counted, however it was started or
    reparented (peers forked by a fork server are no descendants reaped here); None elsewhere."""
    root = Path("/sys/fs/cgroup/cpuacct")
    if not os.environ.get("KVXFER_TEST_CPU_LOG") or not os.access(root, os.W_OK):
        return None
    group = root / f"kvxfer-test-{os.getpid()}"
    try:
        group.mkdir(exist_ok=True)
        (group / "cgroup.procs").write_text(str(os.getpid()))
    except OSError:
        return None
    return group


_CPU_GROUP = _cpu_group()


def _cpu_seconds() -> tuple[float, float, float, float]:
    """CPU seconds of this process, of its reaped descendants and (with a cgroup, else 0) of
    every process in its cgroup, and the monotonic clock."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    group = int((_CPU_GROUP / "cpuacct.usage").read_text()) / 1e9 if _CPU_GROUP is not None else 0.0
    return me.ru_utime + me.ru_stime, kids.ru_utime + kids.ru_stime, group, time.monotonic()


def _log_cpu(module: str, start: tuple[float, float, float, float]) -> None:
    """With KVXFER_TEST_CPU_LOG=PATH, one line per module (tab-separated: module, CPU seconds
    in the test process, CPU seconds of the processes it started once reaped, wall seconds,
    and, where the run may make a cpuacct cgroup, CPU seconds of every process in it): the
    suite is bound by the CPU, and a module's wall time under parallel workers says little."""
    path = os.environ.get("KVXFER_TEST_CPU_LOG")
    if path:
        end = _cpu_seconds()
        with open(path, "a") as log:
            log.write(f"{module}\t{end[0] - start[0]:.2f}\t{end[1] - start[1]:.2f}\t{end[3] - start[3]:.2f}"
                      f"\t{end[2] - start[2]:.2f}\n")


@pytest.fixture(scope="module")
def etcd_server() -> Iterator[EtcdServer]:
    """A real etcd on loopback for the module's tests (ci/setup.sh installs etcd-server)."""
    if etcd_binary() is None:
        pytest.skip("etcd is not installed (apt-get install etcd-server; ci/setup.sh does as root)")
    with EtcdServer() as server:
        yield server


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


# Whole stacks, processes killed on purpose, namespaces, examples as a user runs them: each
# test there takes seconds, so `-m "not slow"` leaves them out of a quick loop (docs/testing.md).
_SLOW_DIRECTORIES = ("chaos", "e2e", "examples", "netns")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.parent.name in _SLOW_DIRECTORIES and item.path.parent.parent.name == "tests":
            item.add_marker(pytest.mark.slow)
    if _cuda_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (gpu marker)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Where the time went, so that the next slowdown is seen in the run that brings it: the
    slowest ten tests and the total per test directory (set-up, call and teardown summed; with
    workers in parallel the totals add up to more than the wall time)."""
    per_test: dict[str, float] = {}
    for reports in terminalreporter.stats.values():
        for report in reports:
            if isinstance(report, pytest.TestReport):
                per_test[report.nodeid] = per_test.get(report.nodeid, 0.0) + report.duration
    if not per_test:
        return
    per_dir: dict[str, float] = {}
    for nodeid, seconds in per_test.items():
        parts = nodeid.split("::", 1)[0].split("/")
        directory = "/".join(parts[:2]) if len(parts) > 2 else parts[0]
        per_dir[directory] = per_dir.get(directory, 0.0) + seconds
    terminalreporter.section("time per test directory (set-up + call + teardown)")
    for directory, seconds in sorted(per_dir.items(), key=lambda kv: -kv[1]):
        terminalreporter.write_line(f"{seconds:9.1f} s  {directory}")
    terminalreporter.section("slowest 10 tests (set-up + call + teardown)")
    for nodeid, seconds in sorted(per_test.items(), key=lambda kv: -kv[1])[:10]:
        terminalreporter.write_line(f"{seconds:9.2f} s  {nodeid}")
