"""The conformance kit over the blob backend: the in-memory store, and the shared-memory
directory store (/dev/shm) that processes of one host share."""

from __future__ import annotations

import functools
import shutil
import tempfile
from collections.abc import Callable, Iterator

import pytest

from kvxfer.backends.blob import BlobDriver, ShmDriver
from kvxfer.contract import TransferMode
from kvxfer.testing.blob_pairs import blob_pair
from kvxfer.testing.conformance import CHECKS, Pair, PairFactory


@pytest.fixture(params=["memory", "shm"])
def make_pair(request: pytest.FixtureRequest) -> Iterator[PairFactory]:
    if request.param == "memory":
        yield blob_pair
        return
    root = tempfile.mkdtemp(prefix="kvxfer-kit-", dir="/dev/shm")
    try:
        def driver(path: str) -> BlobDriver:
            return ShmDriver(path)

        def factory(mode: TransferMode) -> Pair:
            # A fresh directory per pair, as the kit makes a fresh pair per case.
            return blob_pair(mode, functools.partial(driver, tempfile.mkdtemp(dir=root)))
        yield factory
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("mode", list(TransferMode), ids=lambda m: m.value)
def test_conformance(check: Callable[[PairFactory, TransferMode], None], mode: TransferMode,
                     make_pair: PairFactory) -> None:
    check(make_pair, mode)
