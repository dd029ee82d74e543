"""The doorbell ring (kvxfer.backends.ipc.doorbells): its file, its hint extra, what an active
end agrees to open, and the removal of rings whose makers died."""

from __future__ import annotations

import fcntl
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from kvxfer.backends.ipc.doorbells import (
    BELL_BYTES,
    BELL_WORDS,
    BellOpener,
    BellRing,
    bell_export,
    bell_slot,
    bell_value,
    parse_bell,
)
from kvxfer.testing import host_cuda


def test_extra_names_the_ring_and_a_cleared_word(tmp_path: pathlib.Path) -> None:
    ring = BellRing(str(tmp_path))
    try:
        slot = bell_slot("transfer-7")
        assert 0 <= slot < BELL_WORDS and bell_slot("transfer-7") == slot
        ring.words[slot] = 99
        path, got = parse_bell(ring.extra(slot))
        assert (path, got) == (ring.path, slot) and ring.words[slot] == 0
        assert os.stat(path).st_size == BELL_BYTES and os.stat(path).st_mode & 0o777 == 0o600
    finally:
        ring.close()
    assert not os.path.exists(ring.path)


@pytest.mark.parametrize("watched", [4, 200], ids=["few-waits", "many-waits"])
def test_take_returns_and_clears_only_set_words(tmp_path: pathlib.Path, watched: int) -> None:
    ring = BellRing(str(tmp_path))
    try:
        ring.words[[3, 9, 40, 500]] = [7, 0, 11, 13]
        slots = np.array([3, 9, 40, 41] + list(range(1000, 1000 + watched - 4)), dtype=np.int64)
        assert ring.take(slots) == [(3, 7), (40, 11)]
        assert ring.words[500] == 13 and np.count_nonzero(ring.words) == 1  # unwatched: left
        assert ring.take(np.array([3], dtype=np.int64)) == []
    finally:
        ring.close()


def test_value_is_never_zero_and_differs_by_token() -> None:
    assert bell_value(bytes(16)) == 1
    assert bell_value(b"\x01" * 16) != bell_value(b"\x02" * 16)


@pytest.mark.parametrize("data, named", [
    (b"", "too short"),
    ((BELL_WORDS).to_bytes(4, "little") + b"/dev/shm/kvxfer-bell-1-0123456789ab", f"word {BELL_WORDS}"),
    ((0).to_bytes(4, "little") + b"\xff\xfe", "not UTF-8"),
    ((0).to_bytes(4, "little") + b"/dev/shm/kvxfer-bell-1-0123456789ab/../../etc", "not a kvxfer doorbell ring"),
    ((0).to_bytes(4, "little") + b"kvxfer-bell-1-0123456789ab", "not a kvxfer doorbell ring"),
])
def test_parse_refuses_by_name(data: bytes, named: str) -> None:
    with pytest.raises(ValueError, match=named):
        parse_bell(data)


def test_opener_maps_a_ring_and_a_queued_store_lands_in_it(tmp_path: pathlib.Path) -> None:
    ring = BellRing(str(tmp_path))
    opener = BellOpener(host_cuda, 0, str(tmp_path))
    try:
        base = opener.open(bell_export(ring.path))
        host_cuda.stream_write_word(0, 0, base + 8 * 5, 0xABCDEF)
        assert ring.words[5] == 0xABCDEF
        opener.close(base)
        with pytest.raises(host_cuda.CopyError):  # unregistered by close()
            host_cuda.host_unregister(0, base)
    finally:
        ring.close()


def test_opener_refuses_files_that_are_not_rings(tmp_path: pathlib.Path) -> None:
    other = tmp_path / "elsewhere"
    other.mkdir()
    opener = BellOpener(host_cuda, 0, str(tmp_path))
    wrong_size = tmp_path / "kvxfer-bell-1-0123456789ab"
    wrong_size.write_bytes(b"\0" * 64)
    with pytest.raises(OSError, match="is not a 32768-byte file"):
        opener.open(bell_export(str(wrong_size)))
    outside = other / "kvxfer-bell-1-0123456789ab"
    outside.write_bytes(b"\0" * BELL_BYTES)
    with pytest.raises(OSError, match="is not in"):
        opener.open(bell_export(str(outside)))
    link = tmp_path / "kvxfer-bell-2-0123456789ab"
    link.symlink_to(outside)
    with pytest.raises(OSError):  # a link is not followed, even to a ring-sized file
        opener.open(bell_export(str(link)))
    assert wrong_size.read_bytes() == b"\0" * 64 and outside.read_bytes() == b"\0" * BELL_BYTES


def test_a_new_ring_removes_rings_no_process_holds(tmp_path: pathlib.Path) -> None:
    # A ring whose maker exited (its lock went with it) is removed; a live one, and files
    # that are not rings, are left.
    code = ("import sys; from kvxfer.backends.ipc.doorbells import BellRing; "
            "r = BellRing(sys.argv[1]); print(r.path)")  # exits without close(): the file stays
    dead = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, check=True)
    dead_path = dead.stdout.strip()
    assert os.path.exists(dead_path)
    live = BellRing(str(tmp_path))
    unrelated = tmp_path / "kvxfer-bell-notes.txt"
    unrelated.write_text("keep")
    try:
        assert not os.path.exists(dead_path)
        fd = os.open(live.path, os.O_RDONLY)
        try:
            with pytest.raises(BlockingIOError):  # the maker holds it
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            os.close(fd)
        BellRing(str(tmp_path)).close()  # another sweep
        assert os.path.exists(live.path) and unrelated.exists()
    finally:
        live.close()
