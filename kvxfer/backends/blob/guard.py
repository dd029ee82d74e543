"""The blob backend's calls into its driver, made so that no driver can stop its thread.

A driver is code the backend does not control (a store client, a directory another process
shares): besides StoreError it may raise anything (``ShmDriver.put`` racing a removal raises
FileNotFoundError), or answer with fewer statuses than keys, or with something that is not a
status. The backend's thread is the only one that moves rows, so each of these becomes the
batch's keys FAILED with a reason that names what happened, and the thread goes on.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence

import numpy as np

from kvxfer.backends.blob.driver import BlobDriver, KeyStatus, Span, StoreError
from kvxfer.contract import IndexArray

log = logging.getLogger(__name__)


def move(driver: BlobDriver, put: bool, keys: Sequence[bytes], addresses: IndexArray,
         sizes: IndexArray) -> tuple[list[KeyStatus], str]:
    """The driver's status of each key and ""; or every key FAILED and why, when the call
    raised or its answer is not one KeyStatus per key. A key FAILED so may still have been
    stored or written: a row is True only where the driver said OK."""
    op = "put" if put else "get"
    try:
        answer = (driver.put if put else driver.get)(keys, addresses, sizes)
    except StoreError as exc:
        return [KeyStatus.FAILED] * len(keys), f"store {driver.name!r}: {exc}"
    except Exception as exc:
        return [KeyStatus.FAILED] * len(keys), f"store {driver.name!r}: {op} raised {named(exc)}"
    problem = malformed(answer, len(keys), KeyStatus)
    if problem:
        return [KeyStatus.FAILED] * len(keys), f"store {driver.name!r}: {op} of {len(keys)} keys answered {problem}"
    return list(answer), ""


def present(driver: BlobDriver, keys: Sequence[bytes]) -> bool:
    """Whether the driver says every key holds a blob now. A call that raises or answers
    anything but one bool per key says no: a fetch waits on, and its get names the failure."""
    try:
        answer = driver.exists(keys)
    except Exception as exc:
        log.debug("store %r: exists raised %s", driver.name, named(exc))
        return False
    if malformed(answer, len(keys), (bool, np.bool_)):
        return False
    return all(answer)


def release(driver: BlobDriver, spans: Iterable[Span], backend: str) -> None:
    """Unregister ``spans`` and close the driver, whatever either raises (the store may be
    gone: closing still releases the connection)."""
    for span in spans:
        try:
            driver.unregister(span)
        except Exception as exc:
            log.warning("blob backend %s: unregistering from store %r failed: %s", backend, driver.name, named(exc))
    try:
        driver.close()
    except Exception as exc:
        log.warning("blob backend %s: closing store %r failed: %s", backend, driver.name, named(exc))


def malformed(answer: object, n: int, kind: type | tuple[type, ...]) -> str:
    """What is wrong with ``answer`` as a list of ``n`` values of ``kind``; "" if nothing."""
    if not isinstance(answer, (list, tuple)):
        return f"a {type(answer).__name__}, not a list"
    if len(answer) != n:
        return f"{len(answer)} value{'' if len(answer) == 1 else 's'}"
    for i, value in enumerate(answer):
        if not isinstance(value, kind):
            return f"{type(value).__name__} {value!r:.40} for key {i}"
    return ""


def named(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
