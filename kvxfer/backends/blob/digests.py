"""Row digests in a store: each row's digest under a second key, beside its blob.

A store keeps blobs for whoever fetches them later, with no completion record between the
two ends, so the digest (``kvxfer.backends.common.integrity``) is stored too: under the row's
key plus ``DIGEST_SUFFIX``, 8 bytes, little-endian. A put stores the batch's digests first,
computed from the rows it is about to put, then the rows: a fetcher that finds a row finds
its digest (a row replaced meanwhile fails its check rather than passing with the old one). A
get reads the rows, then their digests, and checks each landed row; a row whose digest is
missing or differs is not delivered.

The digests move through one scratch buffer of ``batch_rows`` words, registered with the
driver like the pool's regions (Mooncake reads and writes registered memory only); the
backend's one thread uses it for one batch at a time.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvxfer.backends.blob import guard
from kvxfer.backends.blob.driver import BlobDriver, KeyStatus, Span
from kvxfer.backends.common.integrity import U64, CorruptFn, region_digests
from kvxfer.contract import BoolArray, IndexArray, View

DIGEST_SUFFIX = b"#d64"


class StoreDigests:
    """The scratch buffer and the digest half of each batch."""

    def __init__(self, batch_rows: int) -> None:
        self._words = np.zeros(batch_rows, dtype="<u8")
        self.span = Span(int(self._words.ctypes.data), int(self._words.nbytes))

    def _addresses(self, n: int) -> IndexArray:
        return self.span.address + 8 * np.arange(n, dtype=np.int64)

    def put(self, driver: BlobDriver, keys: Sequence[bytes], digests: U64) -> tuple[BoolArray, str]:
        """Store ``digests`` under the keys' digest keys; which were stored, and the first failure."""
        n = len(keys)
        self._words[:n] = digests
        statuses, failure = guard.move(driver, True, [k + DIGEST_SUFFIX for k in keys], self._addresses(n),
                                       np.full(n, 8, dtype=np.int64))
        return _ok(statuses), failure

    def get(self, driver: BlobDriver, keys: Sequence[bytes]) -> tuple[BoolArray, U64, str]:
        """The stored digests of ``keys`` (where the mask is True), and the first failure."""
        n = len(keys)
        statuses, failure = guard.move(driver, False, [k + DIGEST_SUFFIX for k in keys], self._addresses(n),
                                       np.full(n, 8, dtype=np.int64))
        return _ok(statuses), self._words[:n].astype(np.uint64), failure


def _ok(statuses: Sequence[KeyStatus]) -> BoolArray:
    return np.fromiter((s is KeyStatus.OK for s in statuses), dtype=np.bool_, count=len(statuses))


def batch_digests(view: View, group: IndexArray, slots: IndexArray) -> U64:
    """The digest of each row of a batch: row i is slot ``slots[i]`` of group ``group[i]``."""
    out = np.zeros(slots.size, dtype=np.uint64)
    for g in np.unique(group).tolist():
        sel = group == g
        out[sel] = region_digests(view.groups[g].region, slots[sel])
    return out


def corrupt_batch(corrupt: CorruptFn, view: View, group: IndexArray, slots: IndexArray) -> None:
    """Show the fault hook the rows of a batch that just landed, group by group."""
    for g in np.unique(group).tolist():
        sel = group == g
        corrupt(view.groups[g].region, slots[sel])
