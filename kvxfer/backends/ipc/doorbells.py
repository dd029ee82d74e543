"""Doorbells: completion words that the GPU writes into shared host memory, for a waiting end
that busy-polls.

An IpcBackend with ``busy_poll=True`` already spins on its sockets, but a socket still needs
the active end's CPU between the copy and the peer: it must see the copy's event complete,
then send the record, before the passive end can conclude. With a doorbell the GPU stores
one 8-byte word into the passive end's ring (``BellRing``) once every row is in place: a
small copy's kernel does it from its last block to finish, a larger copy's stream runs a
one-thread kernel after its row kernels (``cuda_copy_rows_then``). The passive end's spin
reads the word without a system call. The record still
follows over the socket, as before: it is what carries partial masks, failures and cancels,
and it covers a ring word that was missed (below).

- The ring is a file of ``BELL_WORDS`` words in /dev/shm, made by the passive end. Its
  describe() names it in the hint (``EXTRA_BELL``: the word's slot and the file's path).
  The slot comes from the transfer id, so nothing is kept per transfer; two transfers that
  share a slot at once only lose the doorbell (the later store overwrites the earlier),
  never correctness.
- The value stored is the transfer's done-token (``CompletionFrames.done_token``) folded to 64
  bits: the passive end concludes only on the value of a wait it holds. A stale or foreign
  value in a slot is cleared and ignored; the socket record then ends that wait.
- The active end opens the file only if it is a kvxfer ring in /dev/shm of its own user,
  of the exact size (a hint must never make it write into another file); it maps and
  page-locks it once per peer (``BellOpener`` through ``mappings``), and unmaps it
  once that peer is gone and no store of ours is queued.
- The ring's maker holds an exclusive lock on the file while it lives; the next ring made
  on the machine removes the files nobody holds a lock on, left by processes that died
  (``_sweep``). A lock, not a process id: /dev/shm may be shared across pid namespaces.
"""

from __future__ import annotations

import fcntl
import functools
import logging
import mmap
import os
import re
import secrets
import stat
import struct
import zlib
from types import ModuleType

import numpy as np

from kvxfer.backends.ipc.mappings import Export
from kvxfer.backends.ipc.shm_map import map_shared, unmap

log = logging.getLogger(__name__)

EXTRA_BELL = "ipc.bell"
BELL_WORDS = 4096
BELL_BYTES = 8 * BELL_WORDS
BELL_DIR = "/dev/shm"
_PREFIX = "kvxfer-bell-"
_NAME = re.compile(r"kvxfer-bell-(\d+)-[0-9a-f]{12}")
_SLOT = struct.Struct("<I")  # then the ring's path, utf-8 (CopyQueue.peer_bell reads the slot so too)
_HANDLE_TAG = b"bell:"  # an Export's handle is the path: never equal to a 64-byte CUDA IPC handle


def bell_value(token: bytes) -> int:
    """The 64-bit word that stands for ``token`` (never 0, which means "not rung")."""
    return int.from_bytes(token[:8], "little") | 1


def bell_slot(transfer_id: str) -> int:
    return zlib.crc32(transfer_id.encode("utf-8", "surrogatepass")) % BELL_WORDS


class BellRing:
    """The waiting end's doorbell words: a /dev/shm file mapped here and by active peers."""

    def __init__(self, directory: str = BELL_DIR) -> None:
        _sweep(directory)
        self.path = os.path.join(directory, f"{_PREFIX}{os.getpid()}-{secrets.token_hex(6)}")
        # Made under a name _sweep ignores, locked, then renamed: never seen unlocked.
        making = self.path + ".new"
        fd = os.open(making, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held while we live: see _sweep
            os.ftruncate(fd, BELL_BYTES)
            self._map = mmap.mmap(fd, BELL_BYTES)
            os.rename(making, self.path)
        except BaseException:
            os.unlink(making)
            os.close(fd)
            raise
        self._fd = fd
        self.words: np.ndarray = np.frombuffer(self._map, dtype=np.uint64)

    def extra(self, slot: int) -> bytes:
        """The hint extra (``EXTRA_BELL``) naming word ``slot``, cleared now: it is this
        transfer's from here on (an earlier transfer's late store is told apart by value)."""
        self.words[slot] = 0
        return _SLOT.pack(slot) + self.path.encode()

    def take(self, slots: np.ndarray) -> list[tuple[int, int]]:
        """(slot, value) of every non-zero word among ``slots``, each cleared."""
        words = self.words
        if slots.size <= 32:  # the usual few waits: item() beats numpy's per-call cost
            out = []
            for slot in slots.tolist():
                value = words.item(slot)
                if value:
                    out.append((slot, value))
                    words[slot] = 0
            return out
        values = words[slots]
        rung = np.flatnonzero(values)
        out = [(int(slots[i]), int(values[i])) for i in rung.tolist()]  # one per completed transfer
        words[slots[rung]] = 0
        return out

    def close(self) -> None:
        if self._map.closed:
            return
        del self.words  # the array holds the map's buffer
        self._map.close()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        os.close(self._fd)


def parse_bell(data: bytes) -> tuple[str, int]:
    """(path, slot) from a hint's ``EXTRA_BELL``; ValueError naming what is wrong."""
    if len(data) <= _SLOT.size:
        raise ValueError(f"{EXTRA_BELL} is {len(data)} bytes, too short")
    (slot,) = _SLOT.unpack_from(data)
    if slot >= BELL_WORDS:
        raise ValueError(f"{EXTRA_BELL} names word {slot} of a ring of {BELL_WORDS}")
    try:
        path = data[_SLOT.size:].decode()
    except UnicodeDecodeError as exc:
        raise ValueError(f"{EXTRA_BELL} path is not UTF-8: {exc}") from exc
    directory, name = os.path.split(path)
    if not _NAME.fullmatch(name) or not directory:
        raise ValueError(f"{EXTRA_BELL} path {path!r} is not a kvxfer doorbell ring")
    return path, slot


@functools.lru_cache(maxsize=256)  # one per peer ring: asked for at every transfer to it
def bell_export(path: str) -> Export:
    """The ring as an Export, so that ``mappings`` opens it once per peer and closes it
    after quiescence like a device allocation."""
    return Export(_HANDLE_TAG + path.encode(), 0, BELL_BYTES)


class BellOpener:
    """Maps a peer's ring and page-locks it for the device (``mappings.Opener``)."""

    def __init__(self, native: ModuleType, device: int, directory: str = BELL_DIR) -> None:
        self._native = native
        self._device = device
        self._directory = os.path.realpath(directory)
        self._host: dict[int, int] = {}  # device address -> host address

    def open(self, export: Export) -> int:
        path = export.handle[len(_HANDLE_TAG):].decode()
        if os.path.dirname(os.path.realpath(path)) != self._directory:
            raise OSError(f"doorbell ring {path!r} is not in {self._directory}")
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_size != BELL_BYTES:
                raise OSError(f"doorbell ring {path!r} is not a {BELL_BYTES}-byte file of this user")
            host = map_shared(fd, BELL_BYTES)
        finally:
            os.close(fd)
        try:
            device = int(self._native.host_register(self._device, host, BELL_BYTES))
        except BaseException:
            unmap(host, BELL_BYTES)
            raise
        self._host[device] = host
        return device

    def close(self, base: int) -> None:
        host = self._host.pop(base)
        try:
            self._native.host_unregister(self._device, host)
        finally:
            unmap(host, BELL_BYTES)


def _sweep(directory: str) -> None:
    """Remove rings that no process holds locked (their makers died without closing them)."""
    try:
        names = [n for n in os.listdir(directory) if _NAME.fullmatch(n)]
    except OSError:
        return
    for name in names:
        path = os.path.join(directory, name)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            continue  # gone already, or not ours
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            continue  # its maker is alive
        try:
            os.unlink(path)
            log.info("removed doorbell ring %s, left by a process that exited", name)
        except OSError:
            pass
        finally:
            os.close(fd)
