"""Strict typed reads of a decoded msgpack map, each failure a WireError naming the field.

msgpack hands back plain Python objects whatever the bytes said; a ``Fields`` reader
checks the exact key set and the exact type (a bool is not an int, bytes are not str)
and size of each value, so the codecs above it never see a value of the wrong shape.
"""

from __future__ import annotations

import enum
import functools
from typing import Any, TypeVar

from kvxfer.wire.errors import WireError

E = TypeVar("E", bound=enum.Enum)
_UINT64_MAX = (1 << 64) - 1


def describe(value: object) -> str:
    """A short name of a value's msgpack type, for error messages (never the value itself)."""
    names = {type(None): "nil", bool: "bool", int: "int", float: "float", str: "str", bytes: "bin", list: "array", dict: "map"}
    return names.get(type(value), type(value).__name__)


class Fields:
    """The fields of one map, read by name; ``where`` prefixes every error (e.g. "hint group 2")."""

    def __init__(self, value: Any, where: str, required: frozenset[str], optional: frozenset[str] = frozenset()):
        if type(value) is not dict:
            raise WireError(f"{where}: expected a map, got {describe(value)}")
        self._value: dict[str, Any] = value
        self.where = where
        if value.keys() == required:  # the usual message: one set comparison, nothing to report
            return
        keys = set(value)
        missing = required - keys
        if missing:
            raise WireError(f"{where}: missing field(s) {', '.join(sorted(missing))}")
        unknown = keys - required - optional
        if unknown:
            shown = sorted(repr(k)[:40] for k in unknown)[:5]  # bounded: keys come from the peer
            raise WireError(f"{where}: unknown field(s) {', '.join(shown)}")

    def has(self, name: str) -> bool:
        return name in self._value

    def text(self, name: str, max_bytes: int, *, empty: bool = False) -> str:
        value = self._value[name]
        if type(value) is str and (value or empty) and 4 * len(value) <= max_bytes:
            return value  # certainly within the limit (UTF-8 takes at most 4 bytes a character)
        if type(value) is not str:
            raise WireError(f"{self.where}: field {name} must be str, got {describe(value)}")
        check_str(value, f"{self.where}: field {name}", max_bytes, empty=empty)
        return value

    def binary(self, name: str, max_bytes: int) -> bytes:
        value = self._value[name]
        if type(value) is not bytes:
            raise WireError(f"{self.where}: field {name} must be bin, got {describe(value)}")
        if len(value) > max_bytes:
            raise WireError(f"{self.where}: field {name} is {len(value)} bytes, the limit is {max_bytes}")
        return value

    def uint(self, name: str) -> int:
        value = self._value[name]
        if type(value) is not int or not 0 <= value <= _UINT64_MAX:
            raise WireError(f"{self.where}: field {name} must be a non-negative int, got {describe(value)}")
        return value

    def array(self, name: str, max_items: int) -> list[Any]:
        value = self._value[name]
        if type(value) is not list:
            raise WireError(f"{self.where}: field {name} must be an array, got {describe(value)}")
        if len(value) > max_items:
            raise WireError(f"{self.where}: field {name} has {len(value)} items, the limit is {max_items}")
        return value

    def choice(self, name: str, cls: type[E]) -> E:
        value = self._value[name]
        members = _members(cls)
        member = members.get(value) if type(value) is str else None
        if member is None:
            shown = repr(value) if type(value) is str and len(value) <= 64 else describe(value)
            raise WireError(f"{self.where}: field {name} must be one of {list(members)}, got {shown}")
        return member


@functools.cache
def _members(cls: type[E]) -> dict[Any, E]:
    """An enum's members by value, built once per enum (records are decoded per transfer)."""
    return {m.value: m for m in cls}


def check_str(value: str, what: str, max_bytes: int, *, empty: bool = False) -> None:
    """Refuse an empty (unless allowed) or oversized string; the size counts UTF-8 bytes."""
    if value and 4 * len(value) <= max_bytes:
        return  # certainly within the limit: UTF-8 takes at most 4 bytes a character
    if not value and not empty:
        raise WireError(f"{what} must not be empty")
    # len(str) <= len(utf8) <= 4 * len(str): skip the encode when the answer is certain.
    if len(value) > max_bytes or (4 * len(value) > max_bytes and len(value.encode("utf-8", "surrogatepass")) > max_bytes):
        raise WireError(f"{what} is longer than the limit of {max_bytes} bytes")
