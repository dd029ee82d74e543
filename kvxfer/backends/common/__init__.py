"""What every backend shares: submission checks and row matching (``matching``), registered
regions (``regions``), transfer ids and used-hint accounting (``transfers``), the attempt a
progress thread concludes (``attempt``), and the engine that holds them together
(``engine``): the contract's calls, revocation, passive waits' conclusions, the progress
thread and shutdown's first step.

The names below are public to the layers above (the worker sets a backend's integrity and
reads what it refused): ``RowCheck``, a backend's integrity setting and its count of refused
rows (``backend.integrity``); ``CorruptFn``, the fault hook a backend takes as
``corrupt_landed``; ``Corruptor``, the one ``kvxfer serve --inject-corruption`` makes. The
modules themselves are the backends' own: code above them imports these names from here.
"""

from kvxfer.backends.common.corruption import Corruptor
from kvxfer.backends.common.integrity import CorruptFn, RowCheck

__all__ = ["CorruptFn", "Corruptor", "RowCheck"]
