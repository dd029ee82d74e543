"""The copy kernel's row check: end-to-end integrity for the IPC backend.

With the check on, each row-copy kernel takes every row's digest
(``kvxfer.backends.common.integrity``: the same digest the other backends send) twice: over
the bytes it read at the source, and over the bytes it reads back where it wrote them (a
volatile load, which comes from L2 while the line is still there). Its last block compares the
two and writes one byte per row into host memory mapped for the device: 0 when they agree.
Only after the job's event has completed are those bytes read: a row whose byte is not 0 is
False in both ends' masks, and the job fails with a reason starting ``digest mismatch``, never
DELIVERED. A doorbell rings only from a small copy's kernel, and only if every row checked out.

The active end (push: the publisher; pull: the fetcher) runs the kernel, so it checks when its
own integrity is on or when the passive end's hint asks for it (``EXTRA_CHECK``): a push
fetcher with integrity on never receives rows nobody checked.

The fault hook (``kvxfer serve --inject-corruption``): the active end asks ``pick(region name, slots)``
which rows to damage and marks their bytes ``CORRUPT_ROW`` before the launch; the kernel flips
one bit of each where it landed, after its store and before its read-back.
"""

from __future__ import annotations

import mmap
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import numpy as np

from kvxfer.backends.common.integrity import DIGEST_K, MISMATCH
from kvxfer.backends.common.matching import GroupMatch
from kvxfer.contract import BoolArray, IndexArray

EXTRA_CHECK = "ipc.check"  # in a passive end's hint: the active end's kernel must check the rows
UNSET = 0xFF  # a row's byte before its kernel ran (a row never copied reads as failed)
CORRUPT_ROW = 0xFE  # the fault hook: the kernel damages this row where it landed
PickFn = Callable[[str, IndexArray], BoolArray]  # which of these rows (region name, slots) to damage as they land


_STRANDED: list[CheckBytes] = []  # registered pages a broken context would not give back: kept mapped


class CheckBytes:
    """Page-aligned host bytes, registered with CUDA so that kernels write them (one per row)."""

    def __init__(self, cuda: ModuleType, device: int, rows: int) -> None:
        size = -(-max(rows, 1) // mmap.PAGESIZE) * mmap.PAGESIZE
        self._map = mmap.mmap(-1, size)  # its own pages: a registration never overlaps another's
        self.array = np.frombuffer(self._map, dtype=np.uint8)
        self.host = int(self.array.ctypes.data)
        self.rows = size
        try:
            self.device_ptr = int(cuda.host_register(device, self.host, size))
        except BaseException:
            del self.array
            self._map.close()
            raise

    def close(self, cuda: ModuleType, device: int) -> None:
        try:
            cuda.host_unregister(device, self.host)
        except cuda.CopyError:
            _STRANDED.append(self)  # still registered: its pages must stay mapped, never reused
            return
        del self.array
        self._map.close()


class CheckPool:
    """The active end's check buffers, reused across jobs (registration costs far more than a job).
    Every buffer made stays the pool's until close(): one a device fault may still be written by
    is never given back (``CopyQueue.retire``) nor reused, and unmapped only once unregistered."""

    def __init__(self, cuda: ModuleType, device: int) -> None:
        self._cuda = cuda
        self._device = device
        self._free: list[CheckBytes] = []
        self._made: list[CheckBytes] = []

    def take(self, rows: int) -> CheckBytes:
        for i, buf in enumerate(self._free):
            if buf.rows >= rows:
                return self._free.pop(i)
        buf = CheckBytes(self._cuda, self._device, rows)
        self._made.append(buf)
        return buf

    def give(self, buf: CheckBytes) -> None:
        self._free.append(buf)

    def close(self) -> None:
        self._free.clear()
        while self._made:
            self._made.pop().close(self._cuda, self._device)


@dataclass(frozen=True, slots=True)
class CheckedLaunch:
    """One kernel's rows in its job's check bytes: view group ``group``, ``n`` rows of ``match`` at ``offset``."""

    group: int
    match: GroupMatch
    n: int
    offset: int


def arm(buf: CheckBytes, plan: list[tuple[int, GroupMatch, int, tuple, tuple]], writes_peer: bool,
        pick: PickFn | None) -> list[CheckedLaunch]:
    """Lay the plan's kernels out in ``buf``, every byte UNSET, the rows ``pick`` chose CORRUPT_ROW."""
    launches = []
    offset = 0
    for gi, match, n, _src, dst in plan:
        buf.array[offset:offset + n] = UNSET
        if pick is not None:
            assert match.peer is not None
            # The rows as they land: in the peer's region (push) or ours (pull), at the destination's slots.
            region = match.peer.region if writes_peer else match.local.region.name
            chosen = np.asarray(pick(region, np.asarray(dst[1][:n], dtype=np.int64)), dtype=np.bool_)
            buf.array[offset:offset + n][chosen] = CORRUPT_ROW
        launches.append(CheckedLaunch(gi, match, n, offset))
        offset += n
    return launches


def kernel_args(buf: CheckBytes | None, launch: CheckedLaunch | None, corrupt: bool) -> dict[str, object]:
    """The row-copy call's check arguments for one kernel (none without a check)."""
    if buf is None or launch is None:
        return {}
    return {"check_ptr": buf.device_ptr + launch.offset, "check_k": DIGEST_K, "corrupt": corrupt}


def verdict(buf: CheckBytes, launches: list[CheckedLaunch], local_masks: list[BoolArray],
            peer_masks: list[BoolArray], peer_index: dict[str, int]) -> tuple[int, str | None]:
    """Once the job's event completed: the rows that failed their check made False in both ends'
    masks (new arrays: masks may be shared constants), and the reason; (0, None) when all passed."""
    failed = 0
    shown: list[str] = []
    for launch in launches:
        bad = np.flatnonzero(buf.array[launch.offset:launch.offset + launch.n])
        if bad.size == 0:
            continue
        failed += int(bad.size)
        match = launch.match
        assert match.peer is not None
        local = np.array(local_masks[launch.group], dtype=np.bool_)
        local[match.local_rows[bad]] = False
        local_masks[launch.group] = local
        pi = peer_index[match.peer.layer_group]
        peer = np.array(peer_masks[pi], dtype=np.bool_)
        peer[match.peer_rows[bad]] = False
        peer_masks[pi] = peer
        rows = match.local_rows[bad]
        shown.append(f"group {match.local.layer_group!r} rows [{', '.join(map(str, rows[:8].tolist()))}"
                     f"{', ...' if rows.size > 8 else ''}]")
    if not failed:
        return 0, None
    total = sum(launch.n for launch in launches)
    return failed, (f"{MISMATCH}: {failed} of {total} rows read back where they landed with other bytes than "
                    f"the copy kernel read ({'; '.join(shown)})")
