"""Hints are frozen and hashable by value; the two rejections share a base; the contract
imports nothing heavy."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from kvxfer import KvxferError
from kvxfer.contract import (
    CacheKind,
    Hint,
    HintGroup,
    InvalidSubmission,
    MemoryKind,
    SubmissionRejected,
    TransferMode,
)


def group(slots: list[int]) -> HintGroup:
    return HintGroup("g", CacheKind.PAGED, "r", 4096, 64, 32, MemoryKind.HOST, 0, np.array(slots), np.arange(len(slots)))


def hint(slots: list[int], **kw: object) -> Hint:
    fields: dict[str, object] = dict(backend="nixl", mode=TransferMode.PUSH, agent="a", request="q",
                                     transfer_id="t1", layout=b"L", groups=(group(slots),))
    fields.update(kw)
    return Hint(**fields)  # type: ignore[arg-type]


def test_hash_and_equality_by_value() -> None:
    a, b = hint([1, 2, 3]), hint([1, 2, 3])
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1
    assert a != hint([1, 2, 4])
    assert a != hint([1, 2, 3], transfer_id="t2")


def test_frozen_and_arrays_read_only() -> None:
    h = hint([1, 2])
    with pytest.raises(AttributeError):
        h.agent = "b"  # type: ignore[misc]
    with pytest.raises(ValueError):
        h.groups[0].slots[0] = 7


def test_caller_array_snapshot() -> None:
    slots = np.array([4, 5])
    g = HintGroup("g", CacheKind.PAGED, "r", 0, 8, 8, MemoryKind.HOST, 0, slots, [0, 1])
    slots[0] = 0
    assert g.slots.tolist() == [4, 5]


def test_hint_describes_only_the_other_end() -> None:
    # No field of a hint names local rows: everything is the describing end's own geometry.
    names = set(Hint.__dataclass_fields__)
    # (``geometry`` and ``tokens``: the describing end's engine layout and its token range.)
    assert names == {"backend", "mode", "agent", "request", "transfer_id", "layout", "groups",
                     "endpoint", "extras", "mac", "run", "audience", "expires_ms", "geometry", "tokens"}


def test_hint_slot_outside_region_refused() -> None:
    with pytest.raises(ValueError, match="outside"):
        group([0, 32])


def test_mode_must_be_enum() -> None:
    with pytest.raises(TypeError, match="TransferMode"):
        hint([1], mode="push")


def test_rejections_share_base_and_document_safety() -> None:
    for cls in (InvalidSubmission, SubmissionRejected):
        assert issubclass(cls, KvxferError)
        assert "Nothing escaped" in (cls.__doc__ or "")


def test_contract_imports_nothing_heavy() -> None:
    code = (
        "import sys, json; import kvxfer.contract; "
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in ('kvxfer','torch','nixl','msgpack'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    modules = json.loads(out)
    assert not [m for m in modules if m.split(".")[0] in ("torch", "nixl", "msgpack")], modules
    ours = [m for m in modules if m.startswith("kvxfer")]
    # kvxfer.ucx_env (the standard library only) runs when the package is imported: see its doc.
    assert all(m in ("kvxfer", "kvxfer.ucx_env") or m.startswith("kvxfer.contract") for m in ours), ours


def test_hint_group_geometry_overflow_refused() -> None:
    with pytest.raises(ValueError, match="overflows 64 bits"):
        HintGroup("g", CacheKind.PAGED, "r", (1 << 64) - 64, 64, 2, MemoryKind.HOST, 0, [0], [0])


def test_hint_group_repeated_ordinal_refused() -> None:
    with pytest.raises(ValueError, match="repeats an ordinal"):
        HintGroup("g", CacheKind.PAGED, "r", 0, 64, 4, MemoryKind.HOST, 0, [0, 1], [3, 3])
