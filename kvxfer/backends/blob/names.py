"""Which key each row goes under in a store, and how a hint carries the keys.

A store has no peer to describe its rows: a row's key is its block's name. The pool's block
names (``kvxfer.pool.block_names``: chained over the token ids, under the layout identity)
let any instance with the same layout find a prefix another one stored; layouts that differ
never share a name. A lease holder that knows its requests' tokens gives the backend such a
``Namer``; ``request_names`` (the default) names a row by its request, layer group and block
ordinal under the view's layout, for two ends that agree on request ids (the router's).

The names of a described view travel in its hint, one extra per layer group
(``names:<group>``: the names of the hint group's rows, in its order, NAME_BYTES each).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence

from kvxfer.contract import Hint, InvalidSubmission, View

NAME_BYTES = 16
Namer = Callable[[View], Sequence[Sequence[bytes]]]
"""A view's row names, one sequence per layer group in the view's order, NAME_BYTES each."""


def request_names(view: View) -> list[list[bytes]]:
    """Names from (layout, layer group, request, block ordinal)."""
    out = []
    for group in view.groups:
        salt = view.layout + b"|" + group.layer_group.encode() + b"|" + view.request.encode() + b"|"
        out.append([hashlib.blake2b(salt + int(o).to_bytes(8, "little"), digest_size=NAME_BYTES).digest()
                    for o in group.ordinals])
    return out


def names_extras(view: View, names: Sequence[Sequence[bytes]]) -> tuple[tuple[str, bytes], ...]:
    """The hint extras for ``names``; InvalidSubmission if they do not fit the view's rows."""
    if len(names) != len(view.groups):
        raise InvalidSubmission(f"names for {len(names)} layer groups, the view of {view.request!r} has "
                                f"{len(view.groups)}")
    extras = []
    for group, group_names in zip(view.groups, names):
        if len(group_names) != len(group) or any(len(n) != NAME_BYTES for n in group_names):
            raise InvalidSubmission(f"group {group.layer_group!r}: {len(group)} rows need {len(group)} names of "
                                    f"{NAME_BYTES} bytes each")
        extras.append((f"names:{group.layer_group}", b"".join(group_names)))
    return tuple(extras)


def hint_names(hint: Hint, group: str, rows: int) -> list[bytes]:
    """The names a hint gives its group's rows; InvalidSubmission when it gives none or too few."""
    data = hint.extra(f"names:{group}")
    if data is None or len(data) != rows * NAME_BYTES:
        raise InvalidSubmission(f"hint for transfer {hint.transfer_id} names no store keys for the {rows} rows of "
                                f"group {group!r}: a store hint comes from a blob backend's describe()")
    return [data[i * NAME_BYTES:(i + 1) * NAME_BYTES] for i in range(rows)]
