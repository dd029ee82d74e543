"""How an attempt ended: Delivered, Failed or Cancelled, each with per-row masks.

A mask is one bool per row of a view group; True means that row's bytes are in place at
the destination. Masks are what a lease holder trusts to mark arrival, so they are kept
exact: a read-only plain ``numpy.ndarray`` of bool is kept as given (its giver promises
not to write it or memory it shares); anything else is copied into a plain read-only
array. A masked array in particular is copied, since ``all()`` on it skips masked rows
and would overstate delivery.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import InitVar, dataclass
from typing import Any, Union

import numpy as np

from kvxfer.contract.arrays import BoolArray
from kvxfer.contract.rows import View


def freeze_mask(mask: Any, index: int = 0) -> BoolArray:
    """Return ``mask`` as a read-only one-dimensional bool array, copying unless safe to keep."""
    dtype = getattr(mask, "dtype", None)
    if dtype is None:
        raise TypeError(f"mask {index} must be a numpy bool array, got {type(mask).__name__}")
    if dtype != np.bool_:
        raise TypeError(f"mask {index} must have dtype bool, got {dtype}")
    if mask.ndim != 1:
        raise ValueError(f"mask {index} must be one-dimensional, got shape {mask.shape}")
    if type(mask) is np.ndarray and not mask.flags.writeable:
        return mask
    # np.array drops subclasses (subok=False): a masked array becomes its plain data.
    out = np.array(mask, dtype=np.bool_, copy=True)
    out.flags.writeable = False
    return out


def freeze_masks(masks: Sequence[Any], view: View | None) -> tuple[BoolArray, ...]:
    if isinstance(masks, np.ndarray) or not isinstance(masks, Sequence):
        raise TypeError("masks must be a sequence of bool arrays, one per view group")
    frozen = tuple(freeze_mask(m, i) for i, m in enumerate(masks))
    if view is not None:
        check_masks(view, frozen)
    return frozen


def check_masks(view: View, masks: Sequence[BoolArray]) -> None:
    """Raise ValueError unless ``masks`` has one mask per group of ``view``, of its length."""
    if len(masks) != len(view.groups):
        raise ValueError(f"{len(masks)} masks for a view of {len(view.groups)} groups")
    for mask, group in zip(masks, view.groups):
        if mask.shape != (len(group),):
            raise ValueError(
                f"mask for group {group.layer_group!r} has shape {mask.shape}, the group has {len(group)} rows"
            )


@dataclass(frozen=True, eq=False)
class _OutcomeBase:
    masks: tuple[BoolArray, ...]

    @property
    def rows_delivered(self) -> int:
        return int(sum(int(m.sum()) for m in self.masks))

    @property
    def all_delivered(self) -> bool:
        return all(bool(m.all()) for m in self.masks)


@dataclass(frozen=True, eq=False)
class Delivered(_OutcomeBase):
    """The submission concluded normally. Rows still False had no counterpart at the peer."""

    view: InitVar[View | None] = None

    def __post_init__(self, view: View | None) -> None:
        object.__setattr__(self, "masks", freeze_masks(self.masks, view))


@dataclass(frozen=True, eq=False)
class Failed(_OutcomeBase):
    """The submission failed; ``masks`` says exactly which rows arrived before it did."""

    reason: str = ""

    def __init__(self, reason: str, masks: Sequence[Any], view: View | None = None) -> None:
        if not isinstance(reason, str) or not reason:
            raise ValueError("Failed needs a non-empty reason")
        object.__setattr__(self, "reason", reason)
        object.__setattr__(self, "masks", freeze_masks(masks, view))


@dataclass(frozen=True, eq=False)
class Cancelled(_OutcomeBase):
    """The submission was cancelled, here or by the peer; ``masks`` says what arrived."""

    by_peer: bool = False

    def __init__(self, by_peer: bool, masks: Sequence[Any], view: View | None = None) -> None:
        object.__setattr__(self, "by_peer", bool(by_peer))
        object.__setattr__(self, "masks", freeze_masks(masks, view))


Outcome = Union[Delivered, Failed, Cancelled]
