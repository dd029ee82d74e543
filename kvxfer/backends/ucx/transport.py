"""A ucxx worker as the ucx backend uses it: tag messages to peers by worker address, probes
that take arrived messages out of UCX's queue, and receives into memory of our choosing.

ucxx (the RAPIDS Python binding of UCX; wheels ``ucxx-cu12``/``ucxx-cu13``) exposes tag,
stream and active-message operations, but no one-sided put/get with remote keys. The
backend is built on tag messages, which suits kvxfer's rule that nothing may land in memory
its owner has since reused: a receive is posted into our rows only after the message has
arrived (``tag_probe(remove=True)``) and only while the transfer is live, so no peer can
write into our memory at any other time, and none needs a key to it.
"""

from __future__ import annotations

import ctypes
import os
import threading
import time
from collections.abc import Iterable
from types import ModuleType
from typing import Any

import numpy as np

from kvxfer.contract import KvxferError
from kvxfer.ucx_env import ucx_settings

CONTROL_TAG = 1 << 63  # records, heartbeats, pull requests; data tags keep this bit clear
DATA_MASK = 1 << 63
RUN_BITS = 24  # data tag = (transfer tag << RUN_BITS) | run
RUN_MASK = (1 << RUN_BITS) - 1
TRANSFER_TAG_BITS = 63 - RUN_BITS


class UcxUnavailable(KvxferError):
    """The ucx backend cannot run in this process (ucxx is not installed, or UCX failed)."""


class UcxPeerGone(KvxferError):
    """A ucx peer disconnected (or cannot be reached)."""


_LOADED: tuple[ModuleType, Any, dict[str, str]] | None = None
_LOAD_LOCK = threading.Lock()
"""Makes the load once only: a second load that began before the first ended would find ucxx
imported, see no option set, and replace the first's options with none."""


def load_ucxx() -> tuple[ModuleType, Any, dict[str, str]]:
    """(ucxx's libucxx module, its Array type, the UCX options ucxx wanted); UcxUnavailable
    naming why not.

    Importing ucxx sets UCX_* variables in the process environment (UCX_RNDV_THRESH,
    UCX_RNDV_FRAG_MEM_TYPE=cuda, UCX_MAX_RNDV_RAILS, UCX_MEMTYPE_CACHE). NIXL's own UCX, in this
    process and in every process started from it, would read them too: on the CPU machine a
    NIXL pull probed after an import of ucxx took TCP instead of CMA. So they are taken back out
    of the environment and given to our UCX context alone."""
    loaded = _LOADED
    if loaded is not None:
        return loaded
    with _LOAD_LOCK:  # before ucx_settings' lock, never after it
        if _LOADED is None:
            _load()
        assert _LOADED is not None
        return _LOADED


def _load() -> None:
    global _LOADED
    # ucxx sets options this UCX may not know: UCX must not warn about them, here (its import)
    # or when the context is made (WARN_UNUSED_ENV_VARS among the context's options). The
    # host's UCX settings (kvxfer.ucx_env) apply while its UCX loads.
    quiet = {"UCX_WARN_UNUSED_ENV_VARS": "n"}
    with ucx_settings(quiet):
        before = {k: v for k, v in os.environ.items() if k.startswith("UCX_")}
        try:
            import ucxx._lib.libucxx as libucxx  # noqa: PLC0415 - optional: pip install "kvxfer[ucx]"
            from ucxx._lib.arr import Array  # noqa: PLC0415
        except ImportError as exc:
            if "Support for UCX" in str(exc):  # an older system UCX found before the wheel's
                raise UcxUnavailable(f"ucxx loaded an older UCX than it needs ({exc}); put the libucx wheel's "
                                     f"libraries first: LD_LIBRARY_PATH={_wheel_ucx_dir()}:$LD_LIBRARY_PATH") from exc
            raise UcxUnavailable(f"the ucx backend needs ucxx (pip install 'kvxfer[ucx]'): {exc}") from exc
        finally:
            added = {k: v for k, v in os.environ.items() if k.startswith("UCX_") and before.get(k) != v}
            for name in added:
                if name in before:
                    os.environ[name] = before[name]
                else:
                    del os.environ[name]
    options = {k[len("UCX_"):]: v for k, v in added.items()}
    if "UCX_WARN_UNUSED_ENV_VARS" not in os.environ:
        options.setdefault("WARN_UNUSED_ENV_VARS", "n")
    _LOADED = (libucxx, Array, options)


def ucxx_version() -> str:
    """The installed ucxx distribution and version, e.g. "ucxx-cu13 0.52.0"."""
    from importlib import metadata  # noqa: PLC0415

    for dist in ("ucxx-cu13", "ucxx-cu12", "ucxx"):
        try:
            return f"{dist} {metadata.version(dist)}"
        except metadata.PackageNotFoundError:
            continue
    return "ucxx (version unknown)"


def ucxx_unavailable() -> str | None:
    """Why the ucx backend cannot run here, or None (for tests and tools that must skip)."""
    try:
        load_ucxx()
    except UcxUnavailable as exc:
        return str(exc)
    return None


def _wheel_ucx_dir() -> str:
    import importlib.util  # noqa: PLC0415

    spec = importlib.util.find_spec("libucx")
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    return os.path.join(locations[0], "lib") if locations else "<site-packages>/libucx/lib"


class _DeviceSpan:
    """Device memory as ucxx takes it: an object with __cuda_array_interface__."""

    def __init__(self, address: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (address, False),
                                         "version": 3, "strides": None}


def memory_span(address: int, nbytes: int, device: bool) -> Any:
    """``nbytes`` at ``address`` as a buffer ucxx can send from or receive into, without a copy."""
    if device:
        return _DeviceSpan(address, nbytes)
    return np.ctypeslib.as_array((ctypes.c_ubyte * nbytes).from_address(address)) if nbytes else np.zeros(0, np.uint8)


class Transport:
    """One UCX context and worker; progressed only by the backend's progress thread (and by
    the owner's submission, which only posts sends)."""

    def __init__(self, error_handling: bool = True) -> None:
        # Endpoints in UCX's peer error-handling mode: a send to a dead peer fails instead of
        # hanging (or aborting the process). UCX 1.21 (ucxx-cu13 0.52) then leaves out its
        # shared-memory transports between processes of one host and takes TCP over
        # loopback; without it tag messages go over shared memory, measured 3.5x faster
        # (``kvxfer doctor``), but a peer's death is seen only at the transfer's deadline.
        self.error_handling = error_handling
        self._lib, self._array, options = load_ucxx()
        lib = self._lib
        try:
            self._context = lib.UCXContext(config_dict=options, feature_flags=(lib.Feature.TAG,))
            self._worker = lib.UCXWorker(self._context)
        except lib.UCXError as exc:
            raise UcxUnavailable(f"UCX could not start a worker: {exc}") from exc
        self.address: bytes = self._worker.address.tobytes()
        self._endpoints: dict[str, tuple[bytes, Any]] = {}
        self.closed = False
        self._leftover: list[tuple[Any, np.ndarray]] = []
        self._control: list[tuple[Any, np.ndarray]] = []  # control messages being received
        self._gone_errors = tuple(getattr(lib, n) for n in (
            "UCXConnectionResetError", "UCXEndpointTimeoutError", "UCXUnreachableError", "UCXNotConnectedError",
            "UCXCanceledError", "UCXCloseError") if hasattr(lib, n))
        self.cuda = bool(getattr(self._context, "cuda_support", False))

    def _endpoint(self, agent: str, address: bytes) -> Any:
        known = self._endpoints.get(agent)
        if known is not None and known[0] == address:
            return known[1]
        if known is not None:  # restarted under the same name: a new worker address
            self.forget(agent)
        try:
            ep = self._worker.create_endpoint_from_worker_address(self._lib.UCXAddress.create_from_buffer(address),
                                                                  self.error_handling)
        except (self._lib.UCXError, ValueError) as exc:
            raise UcxPeerGone(f"cannot reach ucx peer {agent!r}: {exc}") from exc
        self._endpoints[agent] = (address, ep)
        return ep

    def send(self, agent: str, address: bytes, buffer: Any, tag: int) -> Any:
        """Post a tag send; UcxPeerGone when the peer cannot be reached. ``buffer`` must stay
        alive until the send completes (the caller keeps it)."""
        ep = self._endpoint(agent, address)
        try:
            return ep.tag_send(self._array(buffer), self._lib.UCXXTag(tag))
        except self._lib.UCXError as exc:
            raise UcxPeerGone(f"ucx peer {agent!r}: {exc}") from exc

    def alive(self, agent: str, address: bytes) -> bool:
        """False once our endpoint to the peer at ``address`` failed (unknown: True)."""
        known = self._endpoints.get(agent)
        return known is None or known[0] != address or bool(known[1].alive)

    def forget(self, agent: str) -> None:
        known = self._endpoints.pop(agent, None)
        if known is not None and known[1].alive:
            # Closing an endpoint that already failed crashes ucxx 0.52 (a null request is
            # dereferenced): a failed one is only dropped.
            try:
                known[1].close()
            except self._lib.UCXError:
                pass

    def probe(self, tag: int, mask: int) -> Any | None:
        """The next arrived message matching, taken out of UCX's queue (receive or drain it)."""
        found = self._worker.tag_probe(self._lib.UCXXTag(tag), self._lib.UCXXTagMask(mask), True)
        return found if found.matched else None

    def receive(self, probe: Any, buffer: Any) -> Any:
        return self._worker.tag_recv_with_handle(self._array(buffer), probe)

    def take_control(self) -> list[bytes]:
        """Control messages (``CONTROL_TAG``) that arrived whole since the last call, in order."""
        while (probe := self.probe(CONTROL_TAG, (1 << 64) - 1)) is not None:
            buffer = np.empty(int(probe.length), np.uint8)
            self._control.append((self.receive(probe, buffer), buffer))
        done = []
        while self._control and self._control[0][0].completed:
            request, buffer = self._control.pop(0)
            if self.state(request) == "DONE":
                done.append(bytes(buffer))
        return done

    def drain(self, probe: Any) -> tuple[Any, np.ndarray]:
        """Receive a message nobody wants into a scratch buffer, so that UCX lets go of it:
        (the receive, the buffer, which must live until the receive completes)."""
        scratch = np.empty(max(1, int(probe.length)), np.uint8)
        return self.receive(probe, scratch), scratch

    def drain_everything(self, held: Iterable[list[Any]], sends: Iterable[Any] = ()) -> None:
        """At shutdown: every message still queued, and those taken out and ``held``, dropped;
        ``sends`` still on their way given up to a second too. A send that close() must cancel
        instead stays registered on its endpoint (ucxx 0.52), and keeps the endpoint, and
        through it the worker with its descriptors, for the life of the process."""
        scratch = [self.drain(probe) for probes in held for probe in probes]
        while (probe := self.probe(0, 0)) is not None:
            scratch.append(self.drain(probe))
        waiting = [request for request, _ in scratch] + list(sends)
        deadline = time.monotonic() + 1.0
        while not all(request.completed for request in waiting) and time.monotonic() < deadline:
            self._worker.progress()
        # A receive still running past that keeps its buffer alive with the worker's lifetime.
        self._leftover += [entry for entry in scratch if not entry[0].completed]

    def state(self, request: Any) -> str:
        """"PROC" while ``request`` runs, "DONE", "GONE" (its peer disconnected) or "ERR"."""
        if not request.completed:
            return "PROC"
        try:
            request.check_error()
        except self._gone_errors:
            return "GONE"
        except self._lib.UCXError:
            return "ERR"
        return "DONE"

    def progress(self) -> None:
        self._worker.progress()

    def close(self) -> None:
        """Close every endpoint now, so that the UCX worker goes with this Transport.

        Not with ``forget()``'s ``close()``: that leaves a close request registered on its
        endpoint, holding the endpoint and through it the worker (C++ references Python's
        collector does not see) until the peer answers, and a peer whose worker is no longer
        progressed never does. The worker then lived on for the life of the process with its
        descriptors (about 18: sockets, epoll, pipes, shared memory) and UCX's async handlers
        on them; one conformance module left 1,881 open. ``close_blocking()`` cancels the
        endpoint's requests and, with error handling, closes it by force without the peer."""
        self.closed = True
        endpoints = [ep for _, ep in self._endpoints.values()]
        self._endpoints.clear()
        for ep in endpoints:
            if ep.alive:  # a failed one is closed already (see forget())
                ep.close_blocking()
        self._worker.progress()  # cancellations of failed endpoints' requests complete here
