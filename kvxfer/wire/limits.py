"""Size limits of the wire format: every string, array and message is bounded.

The decoder refuses anything beyond them before it allocates for it (msgpack's own
per-object limits), so a hostile peer cannot make a receiver build huge objects. The
encoder checks the same limits, so an oversized message fails at the sender, by name.
"""

from __future__ import annotations

from dataclasses import dataclass

MiB = 1 << 20


@dataclass(frozen=True)
class Limits:
    message_bytes: int = 64 * MiB  # the whole encoded message, envelope included
    string_bytes: int = 4096  # any str field (names, ids, reasons), in UTF-8 bytes
    rows: int = 1 << 20  # rows of one hint group, rows of one completion mask
    groups: int = 256  # groups of a hint, masks of a completion record
    layout_bytes: int = 4096  # Hint.layout (a digest, in practice 32 bytes)
    endpoint_bytes: int = 4 * MiB  # Hint.endpoint: may carry a whole NIXL agent metadata blob
    extras: int = 64  # (key, value) pairs in Hint.extras
    extra_bytes: int = 4 * MiB  # one Hint.extras value
    blob_bytes: int = 4 * MiB  # the payload of encode_blob

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if type(value) is not int or value <= 0:
                raise ValueError(f"Limits.{name} must be a positive int, got {value!r}")


DEFAULT_LIMITS = Limits()
