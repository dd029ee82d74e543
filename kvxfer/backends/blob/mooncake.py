"""A Mooncake Store as the blob store: ``MooncakeDriver``, one client of a Mooncake master.

    python -m kvxfer.backends.blob.mooncake_master --port 50051     # once per cluster
    driver = MooncakeDriver("127.0.0.1:50051", segment_bytes=1 << 30)

Mooncake keeps each blob in the memory segment of one client (``segment_bytes`` of this
process, given to the store at set-up) and the master only knows where: a put here asks for
this client's own segment (it goes to another client's when this one has none or is full),
so a prefill worker's rows stay in its memory and a decode worker reads them from there.
Blobs a client holds go when it closes or dies (they read as missing then). The master
must run without eviction for a full store to answer FULL (``MooncakeMaster`` does: without
it the master silently drops old blobs, which then read as missing).

Bytes move straight from and into caller memory (``batch_upsert_from`` or ``batch_put_from``,
``batch_get_into``); ``register`` hands the spans to Mooncake's transfer engine. A put over a
key that holds a blob replaces it (upsert), as the other drivers do, unless the driver is made
with ``keep_stored``: then it leaves that blob and answers OK (Mooncake's put-if-absent),
whatever its bytes or size. That is for keys that name their content (a worker's block names):
replacing a blob in place makes every get of it answer REPLICA_IS_NOT_READY (-703) until the
new bytes are in, so a lookup racing another worker's put of the same block missed it, and the
rewrite brings nothing. A get that finds a blob of
another size reports WRONG_SIZE; a blob smaller than the row has by then been copied into
the start of the row (Mooncake reports sizes only after the copy), which the row's False
mask covers. Calls are serialized by a lock, and none reaches the Mooncake client after
``close``: Mooncake crashes the process on a call to a closed client.

Install: ``pip install 'kvxfer[store]'`` (the ``mooncake-transfer-engine-non-cuda`` wheel),
and the system library ``libibverbs1`` (``apt-get install libibverbs1``), which the wheel
loads even over TCP.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from kvxfer.backends.blob.driver import BlobDriver, KeyStatus, Span, StoreError
from kvxfer.contract import IndexArray

log = logging.getLogger(__name__)

T = TypeVar("T")

# Mooncake's error codes (mooncake-store/include/types.h) that the driver tells apart.
NO_AVAILABLE_HANDLE = -200  # put: no segment has room for the object
INVALID_PARAMS = -600       # get: among others, a destination smaller than the object
REPLICA_IS_NOT_READY = -703  # get: the blob is being written (a put of it not finished)
OBJECT_NOT_FOUND = -704     # never put, removed, evicted, or its holder gone
CODE_NAMES = {NO_AVAILABLE_HANDLE: "NO_AVAILABLE_HANDLE", INVALID_PARAMS: "INVALID_PARAMS",
              REPLICA_IS_NOT_READY: "REPLICA_IS_NOT_READY", OBJECT_NOT_FOUND: "OBJECT_NOT_FOUND", -706: "OBJECT_HAS_LEASE", -707: "LEASE_EXPIRED",
              -800: "TRANSFER_FAIL", -900: "RPC_FAIL"}
INSTALL_HINT = ("pip install 'kvxfer[store]' (the mooncake-transfer-engine-non-cuda wheel), and the system library "
                "libibverbs1 (apt-get install libibverbs1)")
# Set-up against a master that does not answer retries for ~90 s by default; once is enough
# here (the driver checks first that the master's port answers). A value the user set stays.
SETUP_RETRIES_ENV = "MC_STORE_CLIENT_SETUP_RETRIES"
CONNECT_TIMEOUT_S = 2.0
MIN_SEGMENT_BYTES = 16 << 20  # Mooncake refuses a smaller segment (set-up fails with INVALID_PARAMS)


def code_name(code: int) -> str:
    return f"{code} ({CODE_NAMES[code]})" if code in CODE_NAMES else str(code)


class MooncakeDriver(BlobDriver):
    """One Mooncake Store client (see the module doc). ``master``: "host:port" of the master;
    ``segment_bytes``: the memory this client gives the store (0: it holds no blobs and its
    puts go to other clients' segments); ``host``: the address other clients reach this one
    at; ``protocol``/``device``: Mooncake's transfer protocol ("tcp", or "rdma" with its
    device names); ``key_prefix``: put before each key's hex, to keep several users of one
    master apart."""

    name = "mooncake"

    def __init__(self, master: str, *, segment_bytes: int = 256 << 20, host: str = "127.0.0.1",
                 protocol: str = "tcp", device: str = "", key_prefix: str = "kvxfer/",
                 keep_stored: bool = False) -> None:
        if segment_bytes < 0 or 0 < segment_bytes < MIN_SEGMENT_BYTES:
            raise ValueError(f"segment_bytes must be 0 or at least {MIN_SEGMENT_BYTES} (Mooncake's least segment), "
                             f"got {segment_bytes}")
        try:
            from mooncake.store import MooncakeDistributedStore, ReplicateConfig
        except (ImportError, OSError) as exc:
            raise StoreError(f"the Mooncake store is not installed ({exc}): {INSTALL_HINT}") from None
        self.master = master
        self.segment_bytes = segment_bytes
        self.key_prefix = key_prefix
        self.keep_stored = keep_stored  # a put leaves a stored blob (module docstring)
        self._lock = threading.Lock()
        self._spans: dict[int, int] = {}  # address -> size, registered with Mooncake
        _check_reachable(master)
        os.environ.setdefault(SETUP_RETRIES_ENV, "1")
        store = MooncakeDistributedStore()
        started = time.monotonic()
        try:
            rc = store.setup(host, "P2PHANDSHAKE", segment_bytes, 0, protocol, device, master)
        except (RuntimeError, TypeError, ValueError) as exc:
            raise StoreError(f"Mooncake master {master}: client set-up raised {exc}") from None
        if rc != 0:
            store.close()  # safe after a failed set-up, and releases its threads now
            raise StoreError(f"Mooncake master {master}: client set-up failed with code {code_name(rc)} after "
                             f"{time.monotonic() - started:.1f}s (is the master reachable from {host}, with "
                             f"protocol {protocol!r}?)")
        self._store: Any = store  # None once closed: never touched again
        self.hostname = str(store.get_hostname())
        self._config = ReplicateConfig()
        if segment_bytes:
            self._config.preferred_segment = self.hostname

    # --- the calls, guarded --------------------------------------------------------------
    def _call(self, what: str, fn: Callable[[Any], T]) -> T:
        with self._lock:
            if self._store is None:
                raise StoreError(f"the Mooncake driver for master {self.master} is closed")
            try:
                return fn(self._store)
            except (RuntimeError, TypeError, ValueError) as exc:
                raise StoreError(f"Mooncake {what} raised {exc}") from None

    def _batch(self, what: str, n: int, fn: Callable[[Any], list[int]]) -> list[int]:
        codes = self._call(what, fn) if n else []
        if len(codes) != n:
            raise StoreError(f"Mooncake {what} answered {len(codes)} results for {n} keys")
        return [int(c) for c in codes]

    def _names(self, keys: Sequence[bytes]) -> list[str]:
        return [self.key_prefix + k.hex() for k in keys]

    # --- BlobDriver --------------------------------------------------------------------------
    def register(self, span: Span) -> None:
        if self._spans.get(span.address) == span.size:
            return
        rc = self._call("register_buffer", lambda s: s.register_buffer(span.address, span.size))
        if rc != 0:
            raise StoreError(f"Mooncake refused to register {span.size} bytes at {span.address:#x}: code "
                             f"{code_name(rc)}")
        self._spans[span.address] = span.size

    def unregister(self, span: Span) -> None:
        if span.address not in self._spans:
            return  # never registered here, or gone with the closed client
        try:
            rc = self._call("unregister_buffer", lambda s: s.unregister_buffer(span.address))
        except StoreError:
            if self._store is None:
                return
            raise
        self._spans.pop(span.address, None)
        if rc != 0:
            raise StoreError(f"Mooncake refused to unregister the span at {span.address:#x}: code {code_name(rc)}")

    def put(self, keys: Sequence[bytes], addresses: IndexArray, sizes: IndexArray) -> list[KeyStatus]:
        names, ptrs, lens = self._names(keys), addresses.tolist(), sizes.tolist()
        if self.keep_stored:
            # Put-if-absent: an upsert of a stored key takes its replica out of reach (gets answer
            # REPLICA_IS_NOT_READY) until it is rewritten, so a get racing it misses a blob the
            # store holds; where a key names its content the rewrite brings nothing. A key already
            # there answers 0 (OK) and keeps its blob, even one of another size (a get of the new
            # size then says WRONG_SIZE), and costs only the master's look-up.
            codes = self._batch("batch_put_from", len(names),
                                lambda s: s.batch_put_from(names, ptrs, lens, self._config))
        else:
            codes = self._batch("batch_upsert_from", len(names),
                                lambda s: s.batch_upsert_from(names, ptrs, lens, self._config))
        return [_put_status(c) for c in codes]

    def get(self, keys: Sequence[bytes], addresses: IndexArray, sizes: IndexArray) -> list[KeyStatus]:
        names, ptrs, lens = self._names(keys), addresses.tolist(), sizes.tolist()
        codes = self._batch("batch_get_into", len(names), lambda s: s.batch_get_into(names, ptrs, lens))
        out = [_get_status(c, n) for c, n in zip(codes, lens, strict=True)]
        for i, c in enumerate(codes):
            if c == INVALID_PARAMS:
                out[i] = self._sized(names[i], lens[i])
        return out

    def _sized(self, name: str, size: int) -> KeyStatus:
        """After INVALID_PARAMS on a get: WRONG_SIZE when the blob is of another size."""
        try:
            found = int(self._call("get_size", lambda s: s.get_size(name)))
        except StoreError:
            return KeyStatus.FAILED
        if found == OBJECT_NOT_FOUND:
            return KeyStatus.MISSING
        return KeyStatus.WRONG_SIZE if 0 <= found != size else KeyStatus.FAILED

    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        """StoreError when Mooncake could not tell for a key (it answers -1): an error read as
        "missing" would hide a fault as a blob that went."""
        names = self._names(keys)
        codes = self._batch("batch_is_exist", len(names), lambda s: s.batch_is_exist(names))
        unknown = [(n, c) for n, c in zip(names, codes, strict=True) if c not in (0, 1)]
        if unknown:
            raise StoreError(f"Mooncake could not tell whether {len(unknown)} of {len(names)} blobs exist "
                             f"(first {unknown[0][0]!r}: code {code_name(unknown[0][1])})")
        return [c == 1 for c in codes]

    def remove(self, keys: Sequence[bytes]) -> list[KeyStatus]:
        names = self._names(keys)
        codes = self._batch("batch_remove", len(names), lambda s: s.batch_remove(names, True))
        return [KeyStatus.OK if c == 0 else KeyStatus.MISSING if c == OBJECT_NOT_FOUND else KeyStatus.FAILED
                for c in codes]

    def close(self) -> None:
        """Idempotent. Takes a second or two (Mooncake unmounts the segment, and its blobs go),
        7-18 s when the master is gone and this client has a segment; Mooncake may hold the GIL
        meanwhile, so other Python threads of the process wait too."""
        with self._lock:  # waits for a call in flight: none may run on a closed client
            store, self._store = self._store, None
            if store is None:
                return
            self._spans.clear()
            try:
                store.close()
            except RuntimeError as exc:
                log.warning("closing the Mooncake client of master %s: %s", self.master, exc)


def _put_status(code: int) -> KeyStatus:
    if code == 0:
        return KeyStatus.OK
    return KeyStatus.FULL if code == NO_AVAILABLE_HANDLE else KeyStatus.FAILED


def _get_status(code: int, size: int) -> KeyStatus:
    if code >= 0:
        return KeyStatus.OK if code == size else KeyStatus.WRONG_SIZE
    return KeyStatus.MISSING if code == OBJECT_NOT_FOUND else KeyStatus.FAILED


def _check_reachable(master: str) -> None:
    """StoreError at once when nothing listens at ``master`` (Mooncake's own set-up would
    retry for seconds before failing)."""
    host, sep, port = master.rpartition(":")
    if not sep or not port.isdigit():
        raise StoreError(f"Mooncake master address {master!r} is not host:port")
    try:
        socket.create_connection((host.strip("[]"), int(port)), CONNECT_TIMEOUT_S).close()
    except OSError as exc:
        raise StoreError(f"Mooncake master {master} is not reachable: {exc.strerror or exc}") from None
