"""Temporary alias while the floor-plan move lands: kvxfer.backends.ipc.shm_map."""
import sys

import kvxfer.backends.ipc.shm_map as _moved

sys.modules[__name__] = _moved
