"""Temporary alias while the floor-plan move lands: kvxfer.backends.ipc.mappings."""
import sys

import kvxfer.backends.ipc.mappings as _moved

sys.modules[__name__] = _moved
