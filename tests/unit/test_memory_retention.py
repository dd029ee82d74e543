"""The kit keeps memory that an unquiesced attempt may still touch, and only that."""

from __future__ import annotations

import gc
import weakref

from kvxfer.testing.memory import retain_if_unquiesced
from kvxfer.testing.nixl_pairs import host_rows


def test_memory_an_unquiesced_attempt_may_touch_is_never_freed_and_quiesced_memory_is() -> None:
    kept, freed = host_rows((("K", 64, 4),)), host_rows((("F", 64, 4),))
    kept_ref, freed_ref = weakref.ref(kept), weakref.ref(freed)
    retain_if_unquiesced(frozenset({"an attempt"}), kept)
    retain_if_unquiesced(frozenset(), freed)
    del kept, freed
    gc.collect()
    assert kept_ref() is not None, "rows a late request may still write were freed"
    assert freed_ref() is None, "rows no attempt can touch were kept"
