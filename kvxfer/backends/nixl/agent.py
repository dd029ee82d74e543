"""One NIXL agent over UCX, behind a lock, with the few calls the nixl backend needs.

NIXL's Python agent is created with thread sync NONE unless a listener thread runs, so
concurrent calls are unsafe: every call here takes one lock. The backend's progress thread
makes almost all of them; the owner's thread only registers memory and loads peers'
metadata at submit. A post is bounded by the backend's chunk size, so the lock is never
held for long (docs/performance.md: with host memory UCX may do the whole copy inside ``transfer()``).

Remote agents are kept by name together with the metadata they were loaded from. A peer's
newer metadata (it registered more memory since) is loaded over what we hold: NIXL adds the
new regions and keeps the connection, the regions already loaded and our requests in flight
(dropping the peer first would end those requests: NIXL fails a request whose remote agent
was invalidated). Only a peer whose connection changed, the same name in a new process (a
restart), is dropped and loaded again, and not while a request of ours to its previous run
is alive. ``forget`` drops one that died so that its successor can be added.

etcd mode (``NIXL_ETCD_ENDPOINTS``, or ``use_etcd=True``/``etcd=EtcdSettings(...)``): kvxfer
keeps the metadata in etcd itself (``etcd_metadata``), under a lease, and hints carry a
short token naming this agent's process and metadata generation instead of the metadata.
NIXL's own etcd backend is never started (the variable is hidden from NIXL while the agent
is made) and no NIXL listener thread runs, so no agent binds a metadata port (NIXL's
listener bound 8888 for every agent of a host) and any number of workers share a host.
An agent whose etcd does not answer is not made (``EtcdUnavailable`` names the endpoint), so
a worker never announces itself ready without it; ``close()`` takes the key away first,
bounded by the client's timeout.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvxfer.backends.nixl.etcd_metadata import (
    EtcdMetadata,
    EtcdSettings,
    Version,
    etcd_settings,
    hidden_from_nixl,
    parse_token,
)
from kvxfer.backends.nixl.loader import nixl_modules
from kvxfer.contract import KvxferError, MemoryKind, SlotRegion
from kvxfer.etcd import ETCD_ENV
from kvxfer.ucx_env import ucx_settings

log = logging.getLogger(__name__)

_MEM = {MemoryKind.HOST: "DRAM", MemoryKind.DEVICE: "VRAM"}


def raw_agent(name: str, *, progress_thread: bool) -> Any:
    """A bare NIXL agent with a UCX backend, no kvxfer wrapper: what the lane probes
    (``kvxfer doctor``, a worker's ``/probe``) measure with. NIXL's etcd variables are hidden
    while it is made (NIXL would start its own etcd backend where ``NIXL_ETCD_ENDPOINTS`` is
    set), and the host's UCX settings (``kvxfer.ucx_env``) go to its UCX."""
    api = nixl_modules()[0]
    config = api.nixl_agent_config(enable_prog_thread=progress_thread, backends=["UCX"])
    with hidden_from_nixl(), ucx_settings():
        return api.nixl_agent(name, config)


class PeerGone(KvxferError):
    """The peer's agent disconnected (NIXL_ERR_REMOTE_DISCONNECT) or cannot be reached."""


class PeerUnknown(KvxferError):
    """The peer's metadata is not loaded (yet: in etcd mode it may still arrive)."""


class XferError(KvxferError):
    """NIXL refused or failed a transfer request; the message says how."""


def _nixl() -> Any:
    try:
        api, bindings = nixl_modules()
    except ImportError as exc:  # pragma: no cover - nixl is a dependency of the package
        raise RuntimeError(f"the nixl backend needs the nixl package: {exc}") from exc
    return api, bindings


def _refused(name: str, exc: BaseException) -> Exception:
    """What NIXL's refusal of a peer's metadata means to a submission."""
    if type(exc).__name__ in ("nixlMismatchError", "nixlInvalidParamError"):
        return ValueError(f"NIXL refused the metadata in the hint for agent {name!r}: {exc}")
    return PeerGone(f"cannot connect to agent {name!r}: {exc}")


_SERDES_AGENT = b"nixlSerDes|Agent"


def _metadata_agent(metadata: bytes) -> str | None:
    """The agent name NIXL's serialized metadata opens with (its nixlSerDes layout: a tag, a
    little-endian 8-byte length, the name), or None where it does not read as such."""
    start = len(_SERDES_AGENT) + 8
    if not metadata.startswith(_SERDES_AGENT) or len(metadata) < start:
        return None
    size = int.from_bytes(metadata[len(_SERDES_AGENT):start], "little")
    if size > len(metadata) - start:
        return None
    return metadata[start:start + size].decode("utf-8", "replace")


def _is_disconnect(exc: BaseException) -> bool:
    return type(exc).__name__ == "nixlRemoteDisconnectError" or "REMOTE_DISCONNECT" in str(exc)


@dataclass(frozen=True)
class Post:
    """A posted transfer: NIXL's handle, and the state ``transfer()`` returned."""

    handle: Any
    state: str  # "DONE" or "PROC"


class NixlAgent:
    """A NIXL agent with a UCX backend, its registered regions, and the peers it knows."""

    def __init__(self, name: str, *, use_etcd: bool | None = None, etcd: EtcdSettings | None = None,
                 progress_thread: bool = False, ucx: dict[str, str] | None = None) -> None:
        api, bindings = _nixl()
        self._api = api
        self._bindings = bindings
        self.name = name
        settings = etcd_settings(use_etcd, etcd)  # ValueError: etcd asked for without an endpoint
        self.use_etcd = settings is not None
        # etcd first: where it does not answer, EtcdUnavailable before NIXL starts anything.
        self._etcd = EtcdMetadata(name, settings, lambda: self._metadata) if settings is not None else None
        try:
            self._make_agent(name, progress_thread, ucx or {})
        except BaseException:
            if self._etcd is not None:
                self._etcd.close()
            raise

    def _make_agent(self, name: str, progress_thread: bool, ucx: dict[str, str]) -> None:
        # NIXL's own progress thread spins without pause (the Python API sets its delay to 0):
        # measured here at 0.64 of a core per idle agent. By default the backend's thread
        # progresses UCX instead (every NIXL call it makes does), polling fast only while
        # transfers are pending. No listener thread: metadata travels in hints, or through
        # etcd by kvxfer (etcd_metadata), never through NIXL's listener or its etcd backend.
        config = self._api.nixl_agent_config(enable_prog_thread=progress_thread, enable_listen_thread=False,
                                             backends=["UCX"])
        self._lock = threading.RLock()
        # ``ucx``: UCX settings the user left unset (kvxfer.ucx_env.tcp_liveness), in the
        # environment only while UCX reads it, when the agent's UCX context is made.
        with hidden_from_nixl(), ucx_settings(ucx):
            self._agent = self._api.nixl_agent(name, config)
        if "UCX" not in self._agent.backends:
            raise RuntimeError(f"NIXL agent {name!r} has no UCX backend (plugins: {self._agent.get_plugin_list()})")
        self.memory_types = frozenset(self._agent.get_backend_mem_types("UCX"))
        self._registered: list[Any] = []
        self._peers: dict[str, set[bytes]] = {}  # remote agent name -> metadata versions loaded
        self._versions: dict[str, Version] = {}  # etcd mode: remote agent name -> the version loaded
        self._alive: dict[str, int] = {}  # remote agent name -> our requests to it not released yet
        self._gone: set[str] = set()  # peers the backend declared gone: never reconnected to
        self._stuck: dict[str, int] = {}  # remote agent name -> failed posts whose handle would not release
        self._unproven: set[str] = set()  # peers reconnected to and not heard from since (no second try)
        self._request_peer: dict[Any, str] = {}  # such a request's handle (kept, so never reused) -> its peer
        self._metadata: bytes = self._agent.get_agent_metadata()
        if self._etcd is not None:
            self._etcd.publish(required=True)

    @property
    def etcd(self) -> EtcdMetadata | None:
        """The agent's metadata in etcd (None outside etcd mode)."""
        return self._etcd

    # --- memory and metadata ------------------------------------------------------------
    def reachable(self) -> frozenset[MemoryKind]:
        kinds = {MemoryKind.HOST} if "DRAM_SEG" in self.memory_types else set()
        if "VRAM_SEG" in self.memory_types:
            kinds.add(MemoryKind.DEVICE)
        return frozenset(kinds)

    def register(self, regions: Iterable[SlotRegion]) -> None:
        with self._lock:
            for region in regions:
                descs = self._agent.register_memory(
                    [(region.address, region.nbytes, region.device_id, "")], _MEM[region.memory_kind])
                self._registered.append(descs)
            # Registration adds the regions' remote keys to the metadata peers must load.
            self._metadata = self._agent.get_agent_metadata()
        if self._etcd is not None:
            self._etcd.publish()  # a new generation; retried by its thread where etcd does not take it

    @property
    def metadata(self) -> bytes:
        """What a hint carries for a peer to reach this agent: the metadata, or in etcd mode
        the token of its latest generation (peers look it up by name)."""
        return self._etcd.token if self._etcd is not None else self._metadata

    def ensure_peer(self, name: str, metadata: bytes) -> bool:
        """Make ``name`` reachable. True once loaded; False while etcd has not given what the
        hint needs yet (asked again later, rate-limited: ``EtcdMetadata.lookup``).

        ``metadata``: the hint's endpoint (NIXL metadata, or an etcd token). Raises
        ValueError for metadata NIXL cannot parse or naming another agent, or a token where
        etcd is not configured; PeerGone when the peer cannot be reached, restarted while
        requests to its previous run are alive, or (etcd) was replaced since the hint.
        """
        if metadata and metadata in self._peers.get(name, ()):
            # Loaded already (every submission after the first): not worth waiting for the lock,
            # which the progress thread holds through each NIXL call it makes.
            return True
        wanted = parse_token(metadata)
        if wanted is not None or (not metadata and self._etcd is not None):
            return self._ensure_from_etcd(name, wanted)
        if not metadata:
            raise ValueError(f"hint for agent {name!r} carries no NIXL metadata and etcd is not configured")
        with self._lock:
            return self._load(name, metadata)

    def _ensure_from_etcd(self, name: str, wanted: Version | None) -> bool:
        if self._etcd is None:
            raise ValueError(f"hint for agent {name!r} names its NIXL metadata in etcd, and etcd is not "
                             f"configured here ({ETCD_ENV})")
        held = self._versions.get(name)
        if held is not None and (wanted is None or held.covers(wanted)):
            return True
        found = self._etcd.lookup(name)  # outside our lock: bounded by the etcd client's timeout
        if found is None:
            return False
        if wanted is not None and found.version.instance != wanted.instance:
            raise PeerGone(f"agent {name!r} was replaced since the hint was made (etcd holds another process "
                           f"of that name: instance {found.version.instance}, the hint's is {wanted.instance})")
        if wanted is not None and found.version.generation < wanted.generation:
            return False  # the metadata the hint needs is not in etcd yet: asked again after the backoff
        with self._lock:
            held = self._versions.get(name)
            if held is None or not held.covers(found.version):
                self._load(name, found.metadata)
                self._versions[name] = found.version
        self._etcd.found(name)
        return True

    def _load(self, name: str, metadata: bytes) -> bool:
        """Under the lock: load ``name``'s metadata (over what we hold of it, or in place of a
        previous process of that name). ValueError or PeerGone as ``ensure_peer``."""
        known = self._peers.get(name)
        if known is not None and metadata in known:
            return True
        try:
            loaded = self._agent.add_remote_agent(metadata)
        except Exception as exc:
            if known is None or type(exc).__name__ != "nixlNotAllowedError":
                raise _refused(name, exc) from None
            if _metadata_agent(metadata) != name:
                # Another agent's refusal: a restart of ``name`` it is not, and the
                # peer we know under that name stays loaded.
                raise ValueError(f"hint names agent {name!r} but its metadata is agent "
                                 f"{_metadata_agent(metadata)!r}: {exc}") from None
            loaded = self._load_restarted(name, metadata)
        loaded_name = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
        if loaded_name != name:
            # Undo only what this call added: a peer we already know stays loaded (its
            # transfers may be in flight), or a wrong hint would cut it off.
            if loaded_name not in self._peers:
                self._invalidate(loaded_name)
            raise ValueError(f"hint names agent {name!r} but its metadata is agent {loaded_name!r}")
        self._peers.setdefault(name, set()).add(metadata)
        self._gone.discard(name)
        return True

    def _load_restarted(self, name: str, metadata: bytes) -> Any:
        """NIXL refused ``name``'s new connection info: another process of that name. Its
        predecessor's state goes only once none of our requests to it is alive."""
        alive = self._alive.get(name, 0)
        if alive:
            raise PeerGone(f"agent {name!r} restarted (its connection changed) while {alive} of our requests to "
                           "its previous run are in flight: submit again once they ended")
        self._peers.pop(name, None)
        self._versions.pop(name, None)
        self._invalidate(name)
        try:
            return self._agent.add_remote_agent(metadata)
        except Exception as exc:
            raise _refused(name, exc) from None

    def knows(self, name: str) -> bool:
        with self._lock:
            return name in self._peers

    def forget(self, name: str) -> None:
        """Drop a peer's remote state, so that a restarted peer of that name can be added."""
        with self._lock:
            self._versions.pop(name, None)
            self._unproven.discard(name)
            self._gone.discard(name)
            self._stuck.pop(name, None)
            if self._peers.pop(name, None) is not None:
                self._invalidate(name)

    def gone(self, name: str) -> None:
        """The backend found ``name`` gone (``Liveness.lost``): from now on a disconnect from it
        is final, with no reconnect, until it is loaded again (``forget``, then a new hint)."""
        with self._lock:
            self._gone.add(name)

    def _reconnect(self, peer: str) -> bool:
        """Under the lock: a call to ``peer`` failed as disconnected. UCX closes an endpoint whose
        peer was silent past its TCP timeouts (``kvxfer.ucx_env.tcp_liveness``), also across a
        partition that has healed since. So, where nothing of ours to it may still move (no
        request alive, no failed post whose handle would not release) and the backend has not
        declared it gone, drop it and load again every metadata version we hold of it (the
        regions of each), once until the peer proves alive again (a transfer to it completes,
        or a notification from it arrives). False where that is not allowed or fails: then it
        is gone. A peer that really died fails the new connection once its SYNs go unanswered
        (UCX_TCP_SYN_CNT, set from the deadline too), or the retried call, and is not
        reconnected to a second time."""
        versions = [m for m in self._peers.get(peer, ()) if m]
        if (not versions or peer in self._gone or peer in self._unproven or self._alive.get(peer, 0)
                or self._stuck.get(peer, 0)):
            return False
        self._unproven.add(peer)
        self._invalidate(peer)
        try:
            for metadata in versions:
                self._agent.add_remote_agent(metadata)
        except Exception as exc:
            log.info("could not reconnect to agent %r: %s", peer, exc)
            self._peers.pop(peer, None)
            self._versions.pop(peer, None)
            return False
        log.info("reconnected to agent %r: UCX had closed its endpoint", peer)
        return True

    def _invalidate(self, name: str) -> None:
        try:
            self._agent.remove_remote_agent(name)
        except Exception as exc:  # already gone is what we want
            log.debug("remove_remote_agent(%s): %s", name, exc)

    # --- transfers ----------------------------------------------------------------------
    def post(self, op: str, local: np.ndarray, local_kind: MemoryKind, remote: np.ndarray,
             remote_kind: MemoryKind, peer: str, notif: bytes = b"") -> Post:
        """Create and post one transfer of paired (address, bytes, device) descriptors; a
        ``notif`` reaches the peer once the transfer's bytes are in place there."""
        with self._lock:
            try:
                return self._post(op, local, local_kind, remote, remote_kind, peer, notif)
            except PeerGone:
                if not self._reconnect(peer):
                    raise
                return self._post(op, local, local_kind, remote, remote_kind, peer, notif)

    def _post(self, op: str, local: np.ndarray, local_kind: MemoryKind, remote: np.ndarray,
              remote_kind: MemoryKind, peer: str, notif: bytes) -> Post:
        try:
            handle = self._agent.initialize_xfer(
                op, self._agent.get_xfer_descs(local, _MEM[local_kind]),
                self._agent.get_xfer_descs(remote, _MEM[remote_kind]), peer, notif)
        except Exception as exc:
            if _is_disconnect(exc):
                raise PeerGone(f"agent {peer!r} disconnected") from None
            raise XferError(f"NIXL refused a {op} of {len(local)} descriptors to {peer!r}: {exc}") from None
        try:
            state = self._agent.transfer(handle)
        except Exception as exc:
            self._release_quietly(handle, peer)
            if _is_disconnect(exc):
                raise PeerGone(f"agent {peer!r} disconnected") from None
            raise XferError(f"NIXL failed to post a {op} to {peer!r}: {exc}") from None
        if state == "ERR":
            self._release_quietly(handle, peer)
            raise XferError(f"NIXL could not post a {op} to {peer!r}")
        if state == "DONE":
            self._unproven.discard(peer)
        self._alive[peer] = self._alive.get(peer, 0) + 1
        self._request_peer[handle] = peer
        return Post(handle, state)

    def state(self, handle: Any) -> str:
        """"DONE", "PROC", or "ERR"; "GONE" when the peer disconnected."""
        with self._lock:
            try:
                state = str(self._agent.check_xfer_state(handle))
            except Exception as exc:
                return "GONE" if _is_disconnect(exc) else "ERR"
            if state == "DONE" and self._unproven:
                self._unproven.discard(self._request_peer.get(handle, ""))
            return state

    def release(self, handle: Any) -> bool:
        """Release a handle; NIXL aborts it if still active. False when it could not (the
        request may still touch memory: keep it and try again)."""
        with self._lock:
            try:
                handle.release()
            except Exception as exc:
                log.warning("NIXL could not release transfer handle %r yet: %s", handle, exc)
                return False
            peer = self._request_peer.pop(handle, None)
            if peer is not None:
                self._alive[peer] -= 1
                if not self._alive[peer]:
                    del self._alive[peer]
            return True

    def _release_quietly(self, handle: Any, peer: str) -> None:
        try:
            handle.release()
        except Exception as exc:
            # It may still move bytes: the peer is never reconnected to (``_reconnect``).
            self._stuck[peer] = self._stuck.get(peer, 0) + 1
            log.warning("NIXL could not release a failed transfer handle to %r: %s", peer, exc)

    # --- notifications ------------------------------------------------------------------
    def notify(self, peer: str, message: bytes) -> None:
        """Send a notification; PeerGone when the peer disconnected, PeerUnknown when its
        metadata is not loaded."""
        with self._lock:
            if peer not in self._peers:
                raise PeerUnknown(f"agent {peer!r} is not loaded")
            try:
                self._agent.send_notif(peer, message)
            except Exception as exc:
                if not (_is_disconnect(exc) and self._reconnect(peer)):
                    raise PeerGone(f"notification to agent {peer!r} failed: {exc}") from None
                try:
                    self._agent.send_notif(peer, message)
                except Exception as again:
                    raise PeerGone(f"notification to agent {peer!r} failed: {again}") from None

    def notifications(self) -> dict[str, list[bytes]]:
        with self._lock:
            notes = dict(self._agent.get_new_notifs())
            if self._unproven:
                self._unproven.difference_update(notes)
            return notes

    # --- end ----------------------------------------------------------------------------
    def close(self) -> None:
        """Take our metadata out of etcd (first, so that peers stop finding us; bounded by the
        client's timeout), then drop peers and registrations. Call only when no transfer
        handle is alive."""
        if self._etcd is not None:
            self._etcd.close()
        with self._lock:
            for name in list(self._peers):
                self.forget(name)
            for descs in self._registered:
                try:
                    self._agent.deregister_memory(descs)
                except Exception as exc:
                    log.warning("NIXL deregister_memory failed: %s", exc)
            self._registered.clear()

