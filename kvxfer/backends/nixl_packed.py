"""Temporary alias while the floor-plan move lands: kvxfer.backends.nixl.packed."""
import sys

import kvxfer.backends.nixl.packed as _moved

sys.modules[__name__] = _moved
