"""Temporary alias while the floor-plan move lands: kvxfer.backends.nixl.notes."""
import sys

import kvxfer.backends.nixl.notes as _moved

sys.modules[__name__] = _moved
